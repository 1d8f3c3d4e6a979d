"""Fused experts with quantized weights (``fused_experts_quant``): the MXFP4 decode (twin and kernel)
bit for bit against the checkpoint decoder of ``models.mxfp4``, the kernels' tiled MXFP4 decode against
the per-element one it replaced, the twin against an independent float64 computation per format, Triton
against the twin (CPU interpreter on small shapes: odd token counts, H and I off the 128 grid, top-k
1/2/4, biases or not, every MXFP4 launch candidate), GPT-OSS's checkpoint tensors served as they are
stored, the AITER mapping against the stand-in, validation and torch.compile."""

# T tokens, E experts, K top-k, H hidden, I intermediate

import importlib
import importlib.util
import math
import warnings

import pytest
import torch

from atom_core.models import mxfp4 as checkpoint_mxfp4
from atom_core.ops import fused_moe as fused_moe_module
from atom_core.ops import quant as quant_ops
from atom_core.ops.dispatch import triton_interpret
from atom_core.ops.fused_moe import fused_experts_quant
from atom_core.ops.reference import moe as reference
from atom_core.ops.reference import quant as reference_quant
from atom_core.ops.selftest_cases_moe_quant import TOLERANCES, mxfp4_experts, quant_experts
from atom_core.ops.tolerances import MOE
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, ON_GPU, needs_gpu, needs_triton, non_contiguous_rows, rand

FORMATS = ["fp8_block", "fp8_channel", "mxfp4"]
FP8 = torch.float8_e4m3fn
needs_interpreter = pytest.mark.skipif(not triton_interpret(), reason="pins the CPU interpreter's arithmetic")


def tol(weight_format, dtype):
    atol, rtol = TOLERANCES[weight_format][dtype]
    return {"atol": atol, "rtol": rtol}


def make_case(weight_format, tokens, experts, top_k, hidden, inter, dtype, *, biases=False, seed=0, device=DEVICE):
    """hidden, (w13, w13_scale, w2, w2_scale), routing and optional biases; outputs of order 1."""
    g = torch.Generator().manual_seed(seed)
    x = rand(tokens, hidden, dtype=dtype, generator=g, device=device)
    weights = quant_experts(weight_format, seed + 1, experts, hidden, inter, device)
    routing = reference.topk_softmax(rand(tokens, experts, generator=g, device=device), top_k, True)
    b13 = rand(experts, 2 * inter, dtype=dtype, generator=g, device=device) if biases else None
    b2 = rand(experts, hidden, dtype=dtype, generator=g, device=device) if biases else None
    return x, weights, routing, b13, b2


# ------------------------------------------------------------------------------------- MXFP4 decode

def _random_blocks(rows, groups, exponents, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, groups, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(exponents[0], exponents[1] + 1, (rows, groups), generator=g).to(torch.uint8)
    return blocks, scales


def test_e2m1_table_and_twin_decode_are_bit_exact_with_the_checkpoint_decoder():
    assert reference.E2M1_VALUES == checkpoint_mxfp4.E2M1_VALUES  # the ops copy of models' table
    blocks, scales = _random_blocks(64, 5, (0, 254))
    want = checkpoint_mxfp4.dequantize_mxfp4(blocks, scales, torch.float32)
    got = reference.dequantize_mxfp4(blocks.flatten(-2), scales)  # GPT-OSS blocks [.., G, 16] as [.., G * 16]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0, subnormals, inf alike


@needs_triton
def test_kernel_mxfp4_decode_is_bit_exact_with_the_checkpoint_decoder():
    # Every code in every nibble position, E8M0 exponents over the whole finite range (2**-127 ... 2**127:
    # subnormal and infinite products included); a GPU may flush subnormals, so it gets 2 ... 254.
    from atom_core.ops.triton.moe_quant_tiles import decode_mxfp4

    blocks, scales = _random_blocks(96, 6, (2, 254) if ON_GPU else (0, 254), seed=1)
    want = checkpoint_mxfp4.dequantize_mxfp4(blocks, scales, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy overflows to inf, as it should
        got = decode_mxfp4(blocks.flatten(-2).to(DEVICE), scales.to(DEVICE)).cpu()
    wrong = (got.view(torch.int32) != want.view(torch.int32)).nonzero().tolist()
    packed = blocks.flatten(-2)
    first = [(r, c, got[r, c].item(), want[r, c].item(), (int(packed[r, c // 2]) >> 4 * (c % 2)) & 15,
              int(scales[r, c // 32])) for r, c in wrong[:6]]
    assert not wrong, f"{len(wrong)} of {got.numel()} differ; first (row, column, got, want, code, e8m0): {first}"


@needs_triton
def test_kernel_mxfp4_tiled_decode_is_bit_exact_with_the_per_element_decode():
    # The GEMMs' decode (scale tiles broadcast over their blocks, fp16 pair bits, one multiply by the scale)
    # against the per-element e2m1_value * e8m0_value it replaced, in every dtype the dots take: all 16 codes
    # in both nibbles (bytes 0..255) times all 256 E8M0 bytes (subnormal 2**-127, overflow to inf, NaN
    # included). Row r's block g (bytes 16g..16g+15: every low code, high code g) has scale (r + 17g) % 256,
    # so every (scale, code) pair occurs in both nibbles, and a scale broadcast to the wrong block shows.
    from atom_core.ops.triton.moe_quant_tiles import decode_mxfp4

    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scales = ((torch.arange(256)[:, None] + 17 * torch.arange(16)[None, :]) % 256).to(torch.uint8)
    assert torch.equal(scales.unique(), torch.arange(256, dtype=torch.uint8))
    for dtype, int_view in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16), (torch.float16, torch.int16)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy overflows to inf, as it should
            got = decode_mxfp4(packed.to(DEVICE), scales.to(DEVICE), dtype).cpu()
            want = decode_mxfp4(packed.to(DEVICE), scales.to(DEVICE), dtype, tiled=False).cpu()
        nan = want.isnan()
        assert nan.sum() == 16 * 32 and torch.equal(got.isnan(), nan), dtype  # scale 255 (NaN payloads may differ)
        wrong = ((got.view(int_view) != want.view(int_view)) & ~nan).nonzero().tolist()
        first = [(r, c, got[r, c].item(), want[r, c].item(), (c // 2 >> 4 * (c % 2)) & 15, int(scales[r, c // 32]))
                 for r, c in wrong[:6]]
        assert not wrong, f"{dtype}: {len(wrong)} differ; first (row, column, got, want, code, e8m0): {first}"


# ------------------------------------------------------------------------------------- twin vs float64

def _float64_weights(weight_format, w, scale):
    """[E, N, K] float64, decoded without the twin's helpers: the checkpoint decoder for MXFP4, index
    arithmetic for the fp8 scales."""
    if weight_format == "mxfp4":
        experts, rows, half = w.shape
        return checkpoint_mxfp4.dequantize_mxfp4(w.view(experts, rows, half // 16, 16), scale, torch.float32).double()
    if weight_format == "fp8_channel":
        return w.double() * scale.double()
    rows, cols = torch.arange(w.shape[1]) // 128, torch.arange(w.shape[2]) // 128
    return w.double() * scale.double()[:, rows][:, :, cols]


def _float64_activation(weight_format, v):
    """v [C] float64 as the fp8 GEMMs read it: scale = amax / 448 per row or per 128 columns, the value
    rounded to e4m3fn (the cast rounds to nearest even), times the scale."""
    if weight_format == "mxfp4":
        return v
    size = 128 if weight_format == "fp8_block" else v.numel()
    out = torch.empty_like(v)
    for start in range(0, v.numel(), size):
        part = v[start:start + size]
        scale = max(part.abs().max().item(), 1e-10) / 448
        out[start:start + size] = (part / scale).clamp(-448, 448).to(FP8).double() * scale
    return out


def _float64_experts(weight_format, x, w13, s13, w2, s2, weights, ids, activation, b13, b2):
    """Token by token, choice by choice, in float64 (the activation between the GEMMs kept in float64
    too: hidden is fp32 here, whose rounding the twin skips as well)."""
    w13d, w2d = _float64_weights(weight_format, w13, s13), _float64_weights(weight_format, w2, s2)
    inter = w2d.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = _float64_activation(weight_format, x[t].double())
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13d[e] @ xt + (0 if b13 is None else b13[e].double())
            if activation == "silu":
                gate, up = h[:inter], h[inter:]
                a = gate / (1 + torch.exp(-gate)) * up
            else:
                gate, up = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
                a = (up + 1) * gate / (1 + torch.exp(-1.702 * gate))
            y = w2d[e] @ _float64_activation(weight_format, a) + (0 if b2 is None else b2[e].double())
            out[t] += float(weights[t, k]) * y
    return out


@pytest.mark.parametrize("weight_format, activation, biases", [("fp8_block", "silu", False),
                                                               ("fp8_channel", "swiglu_clamped", True),
                                                               ("mxfp4", "swiglu_clamped", True)])
def test_twin_matches_an_independent_float64_computation(weight_format, activation, biases):
    # H = 160 and I = 96: partial 128-blocks in both GEMMs (fp8_block), whole 32-blocks (MXFP4).
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case(weight_format, 5, 4, 2, 160, 96, torch.float32,
                                                               biases=biases, seed=3, device="cpu")
    got = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format, activation, b13, b2)
    want = _float64_experts(weight_format, x, w13, s13, w2, s2, weights, ids, activation, b13, b2)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_twin_equals_the_unquantized_twin_on_decoded_weights_for_mxfp4():
    # Weight-only: nothing but the decode differs from fused_experts.
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case("mxfp4", 7, 4, 2, 64, 32, torch.bfloat16, biases=True,
                                                               device="cpu")
    got = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, "mxfp4", "swiglu_clamped", b13, b2)
    dense = [reference.dequantize_mxfp4(w, s).to(torch.bfloat16) for w, s in ((w13, s13), (w2, s2))]
    assert torch.equal(got, reference.fused_experts(x, *dense, weights, ids, "swiglu_clamped", b13, b2))


# ----------------------------------------------------------------------------------- Triton vs twin

# (format, tokens, experts, top_k, hidden, inter, activation, biases, dtype): odd T; H, I multiples of 32 off
# the 64/128 grid (partial fp8 blocks, a ragged last K step); every format with top-k 1, 2 and 4, with and
# without biases.
TRITON_CASES = [
    ("fp8_block", 1, 4, 1, 160, 96, "silu", False, torch.bfloat16),
    ("fp8_block", 7, 8, 2, 96, 32, "swiglu_clamped", True, torch.float32),
    ("fp8_block", 33, 4, 4, 160, 96, "silu", True, torch.float16),
    ("fp8_channel", 1, 4, 1, 96, 32, "swiglu_clamped", True, torch.bfloat16),
    ("fp8_channel", 7, 8, 2, 160, 96, "silu", False, torch.float32),
    ("fp8_channel", 33, 4, 4, 96, 64, "silu", True, torch.bfloat16),
    ("mxfp4", 1, 4, 1, 160, 96, "silu", True, torch.float32),
    ("mxfp4", 7, 8, 2, 96, 32, "swiglu_clamped", True, torch.bfloat16),
    ("mxfp4", 33, 4, 4, 160, 64, "swiglu_clamped", False, torch.float16),
]


@needs_triton
@pytest.mark.parametrize("weight_format, tokens, experts, top_k, hidden, inter, activation, biases, dtype",
                         TRITON_CASES)
def test_triton_matches_twin(weight_format, tokens, experts, top_k, hidden, inter, activation, biases, dtype):
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case(weight_format, tokens, experts, top_k, hidden, inter,
                                                               dtype, biases=biases, seed=tokens + top_k)
    got = fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format=weight_format, activation=activation,
                              w13_bias=b13, w2_bias=b2, backend="triton")
    want = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format, activation, b13, b2)
    torch.testing.assert_close(got, want, **tol(weight_format, dtype))


@needs_triton
@pytest.mark.parametrize("weight_format", ["fp8_block", "fp8_channel"])
def test_triton_reads_hidden_quantized_by_the_norm_and_quantizes_only_the_activation(weight_format):
    from atom_core import ops
    from atom_core.ops.triton import fused_moe as triton_moe
    x, (w13, s13, w2, s2), (weights, ids), _, _ = make_case(weight_format, 7, 8, 2, 160, 96, torch.bfloat16, seed=5)
    norm_weight = torch.rand(160, generator=torch.Generator().manual_seed(1)).to(DEVICE) + 0.5
    hidden = torch.empty_like(x)
    q, scale = ops.rms_norm_quant(x, norm_weight, 1e-6, group_size=128 if weight_format == "fp8_block" else 160,
                                  normed=hidden, backend="triton")
    quantize = triton_moe._quantize_input
    inputs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_moe, "_quantize_input", lambda x, *rest: inputs.append(x.shape) or quantize(x, *rest))
        got = fused_experts_quant(hidden, w13, s13, w2, s2, weights, ids, weight_format=weight_format, hidden_q=q,
                                  hidden_scale=scale, backend="triton")
    assert inputs == [(14, 96)]  # the activation only: hidden's quantization came from the norm
    want = reference.fused_experts_quant(hidden, w13, s13, w2, s2, weights, ids, weight_format)
    torch.testing.assert_close(got, want, **tol(weight_format, torch.bfloat16))


@pytest.mark.parametrize("weight_format", ["fp8_block", "fp8_channel"])
def test_hidden_quantization_that_is_not_hiddens_or_comes_alone_is_refused(weight_format):
    from atom_core.ops.validation import debug_checks
    x, (w13, s13, w2, s2), (weights, ids), _, _ = make_case(weight_format, 3, 4, 2, 256, 128, torch.float32,
                                                            device="cpu")
    q, scale = (reference_quant.per_group_quant(x, FP8, 128) if weight_format == "fp8_block"
                else reference_quant.per_token_quant(x, FP8))
    args = (x, w13, s13, w2, s2, weights, ids)
    with pytest.raises(ValueError, match="hidden_q and hidden_scale come together"):
        fused_experts_quant(*args, weight_format=weight_format, hidden_q=q, backend="torch")
    with debug_checks():
        fused_experts_quant(*args, weight_format=weight_format, hidden_q=q, hidden_scale=scale, backend="torch")
        with pytest.raises(ValueError, match="not hidden's .* quantization"):
            fused_experts_quant(*args, weight_format=weight_format, hidden_q=q, hidden_scale=2 * scale,
                                backend="torch")
        with pytest.raises(ValueError, match="hidden_scale must have shape"):
            fused_experts_quant(*args, weight_format=weight_format, hidden_q=q, hidden_scale=scale[:, :1].repeat(1, 3),
                                backend="torch")


@needs_interpreter
@pytest.mark.parametrize("weight_format", ["fp8_block", "fp8_channel"])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_triton_quantizes_activations_as_the_twin_up_to_one_rounding_flip_of_silu(weight_format, seed):
    # In the interpreter (IEEE fp32, no fp8 accumulation shortcuts) the quantized hidden equals the twin's
    # bit for bit, so fp32 outputs differ by summation order only (MOE's fp32 tolerance, not MOE_FP8's),
    # except where the down GEMM's input, silu(gate) * up, lands within an ulp of an fp8 rounding boundary:
    # the kernel's exp and torch's may differ by an ulp (Triton 3.9's interpreter does, at seed 11: one
    # value of token 0), and that value then rounds to the neighbouring fp8 code. Such a flip moves one
    # token's row only, by one fp8 step of one value; a quantization that differs from the twin's (scale,
    # rounding, group) moves most rows.
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case(weight_format, 9, 4, 2, 160, 96, torch.float32,
                                                               biases=True, seed=seed)
    got = fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format=weight_format, w13_bias=b13,
                              w2_bias=b2, backend="triton")
    want = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format, "silu", b13, b2)
    atol, rtol = MOE[torch.float32]
    off_rows = ((got - want).abs() > atol + rtol * want.abs()).any(dim=1).nonzero().flatten().tolist()
    assert len(off_rows) <= 1, off_rows
    torch.testing.assert_close(got, want, **tol(weight_format, torch.float32))  # a flip stays within fp8's


@needs_triton
@pytest.mark.parametrize("weight_format, block_m, block_n, block_k, group_m", [("fp8_channel", 32, 16, 64, 2),
                                                                              ("mxfp4", 16, 32, 32, 3),
                                                                              ("fp8_block", 16, 16, 128, 2)])
def test_triton_other_tile_configs(weight_format, block_m, block_n, block_k, group_m):
    # Several M blocks per N stripe, other padding units, one MXFP4 scale block per K step.
    from atom_core.ops.triton import fused_moe as triton_moe
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case(weight_format, 33, 4, 2, 96, 64, torch.float32,
                                                               biases=True, seed=5)
    out = torch.empty_like(x)
    config = triton_moe.BlockConfig(block_m, block_n, block_k, group_m, 4, 2)
    triton_moe.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format, "silu", b13, b2, out,
                                   config=config)
    want = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format, "silu", b13, b2)
    torch.testing.assert_close(out, want, **tol(weight_format, torch.float32))


@needs_triton
@pytest.mark.parametrize("weight_format", ["fp8_block", "fp8_channel"])
@pytest.mark.parametrize("block_m, block_n", [(16, 64), (16, 128), (32, 64)])
def test_triton_fp8_tiles_multiplied_transposed_match_twin(weight_format, block_m, block_n):
    # Rows < 64 by columns >= 64: both GEMMs accumulate w^T · a^T (swaps_ab; sm90's fp8 wgmma), then transpose.
    # H = 160: a masked K step in gate/up; I = 192: a whole and a masked step in down (block format: its
    # scales per step too); 33 tokens on 4 experts: several M blocks of one expert.
    from atom_core.ops.triton import fused_moe as triton_moe
    config = triton_moe.BlockConfig(block_m, block_n, 128, 1, 4, 2)
    assert triton_moe.swaps_ab(config)
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case(weight_format, 33, 4, 2, 160, 192, torch.bfloat16,
                                                               biases=True, seed=block_m + block_n)
    out = torch.empty_like(x)
    triton_moe.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format, "silu", b13, b2, out,
                                   config=config)
    want = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format, "silu", b13, b2)
    torch.testing.assert_close(out, want, **tol(weight_format, torch.bfloat16))


@needs_triton
def test_triton_refuses_tile_configs_that_split_a_scale_block():
    from atom_core.ops.triton import fused_moe as triton_moe
    x, (w13, s13, w2, s2), (weights, ids), _, _ = make_case("fp8_block", 3, 4, 2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="BLOCK_K = 128"):
        triton_moe.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, "fp8_block", "silu", None, None,
                                       torch.empty_like(x), config=triton_moe.BlockConfig(16, 16, 64, 1, 4, 2))
    x, (w13, s13, w2, s2), (weights, ids), _, _ = make_case("mxfp4", 3, 4, 2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        triton_moe.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, "mxfp4", "silu", None, None,
                                       torch.empty_like(x), config=triton_moe.BlockConfig(16, 16, 16, 1, 4, 2))


def _mxfp4_candidates():
    """Every launch config of MXFP4_BLOCK_CONFIGS, once (none where Triton is not installed)."""
    if importlib.util.find_spec("triton") is None:
        return []
    from atom_core.ops.triton import fused_moe as triton_moe
    return list(dict.fromkeys(cfg for configs in triton_moe.MXFP4_BLOCK_CONFIGS.values() for cfg in configs))


def _config_id(cfg):
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}-g{cfg.group_m}-w{cfg.num_warps}-s{cfg.num_stages}"


def test_mxfp4_candidates_follow_the_block_k_rule_and_quant_block_config_picks_each_regimes_first():
    pytest.importorskip("triton")
    from atom_core.ops.triton import fused_moe as triton_moe
    for cfg in _mxfp4_candidates():
        triton_moe.check_mxfp4_block_k(cfg.block_k)
    # GPT-OSS-20B: E 32, K 4, rows per expert m = T / 8; regimes end at m = 16, 64, 256
    for tokens, regime in ((1, "decode"), (128, "decode"), (129, "small"), (512, "small"), (513, "prefill"),
                           (2048, "prefill"), (2049, "long"), (4096, "long")):
        assert triton_moe.mxfp4_regime(tokens, 4, 32) == regime, tokens
        first = triton_moe.MXFP4_BLOCK_CONFIGS[regime][0]
        assert triton_moe.quant_block_config(tokens, 4, 32, torch.bfloat16, "mxfp4") == first
        fp32 = triton_moe.quant_block_config(tokens, 4, 32, torch.float32, "mxfp4")
        assert fp32.block_k == max(first.block_k // 2, 32) and fp32.block_m == first.block_m


@needs_triton
@pytest.mark.parametrize("config", _mxfp4_candidates(), ids=_config_id)
def test_triton_mxfp4_matches_twin_under_every_launch_candidate(config):
    # Every config quant_block_config may pick or the sweep may time. H = BLOCK_K + 32: one whole K step and
    # a masked one of a single scale block; I = 64: whole steps for BLOCK_K 64, a lone masked step above;
    # 33 tokens on 4 experts: several M blocks of one expert for BLOCK_M 16 (GROUP_M walks them), padding for 256.
    from atom_core.ops.triton import fused_moe as triton_moe
    hidden = config.block_k + 32
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case("mxfp4", 33, 4, 2, hidden, 64, torch.bfloat16,
                                                               biases=True, seed=config.block_k + config.block_m)
    out = torch.empty_like(x)
    triton_moe.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, "mxfp4", "swiglu_clamped", b13, b2, out,
                                   config=config)
    want = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, "mxfp4", "swiglu_clamped", b13, b2)
    torch.testing.assert_close(out, want, **tol("mxfp4", torch.bfloat16))


@needs_triton
@pytest.mark.parametrize("block_k", [16, 48, 96, 160])
def test_triton_mxfp4_refuses_block_k_off_the_rule(block_k):
    from atom_core.ops.triton import fused_moe as triton_moe
    x, (w13, s13, w2, s2), (weights, ids), _, _ = make_case("mxfp4", 3, 4, 2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match=f"power of two and a multiple of 32 .*got {block_k}"):
        triton_moe.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, "mxfp4", "silu", None, None,
                                       torch.empty_like(x), config=triton_moe.BlockConfig(16, 16, block_k, 1, 4, 2))


@needs_triton
def test_triton_strided_inputs_out_given_and_dropped_choices():
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case("mxfp4", 7, 4, 2, 64, 32, torch.float32, biases=True,
                                                               seed=9)
    x = non_contiguous_rows(x)
    s13 = s13.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H/32] view of an [E, H/32, 2I] buffer
    ids = ids.t().contiguous().t()
    ids[3, 1] = -1  # a dropped choice
    out = non_contiguous_rows(torch.full((7, 64), float("nan"), device=DEVICE))
    got = fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format="mxfp4", w13_bias=b13, w2_bias=b2,
                              out=out, backend="triton")
    assert got is out
    want = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, "mxfp4", "silu", b13, b2)
    torch.testing.assert_close(out, want, **tol("mxfp4", torch.float32))


@needs_triton
@pytest.mark.parametrize("weight_format", ["fp8_block", "fp8_channel"])
@pytest.mark.parametrize("layout", ["rows_strided", "column_major"])
def test_triton_fp8_matches_twin_for_strided_hidden_with_a_dropped_choice(weight_format, layout):
    # fp8 quantizes hidden in a launch of its own, whose kernels read each row as contiguous: a row-strided
    # hidden goes in with its row stride, a column-major one is made contiguous first. The activation rows of
    # the dropped choice are never written, quantized all the same, and must not reach the output.
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case(weight_format, 7, 4, 2, 160, 96, torch.float32,
                                                               biases=True, seed=13)
    x = non_contiguous_rows(x) if layout == "rows_strided" else x.t().contiguous().t()
    ids[3, 1] = -1
    got = fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format=weight_format, w13_bias=b13,
                              w2_bias=b2, backend="triton")
    want = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format, "silu", b13, b2)
    torch.testing.assert_close(got, want, **tol(weight_format, torch.float32))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_empty_batch(backend):
    x, (w13, s13, w2, s2), (weights, ids), _, _ = make_case("fp8_block", 0, 4, 2, 64, 32, torch.float32)
    assert fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format="fp8_block",
                               backend=backend).shape == (0, 64)


@needs_gpu
@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("tokens", [1, 7, 64, 256, 1029])
def test_gpu_triton_matches_twin(weight_format, tokens):
    # Qwen3-30B-A3B's expert shapes (fp8), GPT-OSS-20B's (MXFP4, with its activation and biases).
    gpt_oss = weight_format == "mxfp4"
    experts, top_k, hidden, inter = (32, 4, 2880, 2880) if gpt_oss else (128, 8, 2048, 768)
    activation = "swiglu_clamped" if gpt_oss else "silu"
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case(weight_format, tokens, experts, top_k, hidden, inter,
                                                               torch.bfloat16, biases=gpt_oss, seed=tokens)
    got = fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format=weight_format, activation=activation,
                              w13_bias=b13, w2_bias=b2, backend="triton")
    want = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format, activation, b13, b2)
    torch.testing.assert_close(got, want, **tol(weight_format, torch.bfloat16))


@needs_gpu
def test_gpu_fp8_decode_under_cuda_graph():
    x, (w13, s13, w2, s2), (weights, ids), _, _ = make_case("fp8_block", 8, 128, 8, 2048, 768, torch.bfloat16)
    out = torch.empty_like(x)
    call = dict(weight_format="fp8_block", out=out, backend="triton")
    fused_experts_quant(x, w13, s13, w2, s2, weights, ids, **call)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts_quant(x, w13, s13, w2, s2, weights, ids, **call)
    new_weights, new_ids = reference.topk_softmax(rand(8, 128), 8, True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(rand(8, 2048, dtype=torch.bfloat16))
    graph.replay()
    want = reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, "fp8_block")
    torch.testing.assert_close(out, want, **tol("fp8_block", torch.bfloat16))


# ------------------------------------------------------------------------------- GPT-OSS checkpoints

def test_gpt_oss_checkpoint_tensors_are_served_as_stored():
    """GPT-OSS stores ``gate_up_proj_blocks`` [E, 2I, H/32, 16] (rows interleaved gate, up) with
    ``_scales`` [E, 2I, H/32] and biases, ``down_proj_*`` likewise: flattened to [E, N, K/2] they are the
    op's MXFP4 arguments, and the op equals HF transformers' GptOssExperts on the decoded weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts, hidden, inter, top_k = 4, 64, 32, 2
    config = transformers.GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                       num_experts_per_tok=top_k, num_attention_heads=4, num_key_value_heads=4)
    gate_up_blocks, gate_up_scales = _random_blocks(experts * 2 * inter, hidden // 32, (122, 125), seed=4)
    down_blocks, down_scales = _random_blocks(experts * hidden, inter // 32, (122, 125), seed=5)
    gate_up_blocks, gate_up_scales = gate_up_blocks.view(experts, 2 * inter, -1, 16), gate_up_scales.view(experts,
                                                                                                       2 * inter, -1)
    down_blocks, down_scales = down_blocks.view(experts, hidden, -1, 16), down_scales.view(experts, hidden, -1)
    g = torch.Generator().manual_seed(6)
    gate_up_bias, down_bias = torch.randn(experts, 2 * inter, generator=g), torch.randn(experts, hidden, generator=g)

    hf = GptOssExperts(config)
    with torch.no_grad():  # HF's x @ W layout: the decoded [E, N, K] transposed, as transformers' mxfp4 loader does
        hf.gate_up_proj.copy_(checkpoint_mxfp4.dequantize_mxfp4(gate_up_blocks, gate_up_scales, torch.float32)
                              .transpose(1, 2))
        hf.down_proj.copy_(checkpoint_mxfp4.dequantize_mxfp4(down_blocks, down_scales, torch.float32).transpose(1, 2))
        hf.gate_up_proj_bias.copy_(gate_up_bias)
        hf.down_proj_bias.copy_(down_bias)
    x = 3 * torch.randn(9, hidden, generator=g)  # large enough for the clamps at +-7
    weights, ids = reference.gpt_oss_topk(torch.randn(9, experts, generator=g), top_k)
    want = hf(x, ids.long(), weights).detach()

    backends = ["torch"] + (["triton"] if triton_interpret() or ON_GPU else [])
    for backend in backends:
        got = fused_experts_quant(x.to(DEVICE), gate_up_blocks.flatten(-2).to(DEVICE), gate_up_scales.to(DEVICE),
                                  down_blocks.flatten(-2).to(DEVICE), down_scales.to(DEVICE), weights.to(DEVICE),
                                  ids.to(DEVICE), weight_format="mxfp4", activation="swiglu_clamped",
                                  w13_bias=gate_up_bias.to(DEVICE), w2_bias=down_bias.to(DEVICE), backend=backend)
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4, msg=backend)


# ----------------------------------------------------------------------------- AITER, compile, errors

def _aiter_fused_moe(hidden_states, w1, w2, topk_weight, topk_ids, activation, quant_type, w1_scale, w2_scale,
                     a1_scale, a2_scale, bias1, bias2, **defaults):
    """AITER's fused_moe as its quant types define it: dynamic activation quantization per token
    (per_Token) or per 1 x 128 group (per_1x128), dequantized weights, silu on [gate | up] halves."""
    assert activation == 0 and bias1 is None and bias2 is None and a1_scale is None and a2_scale is None
    weight_format = {2: "fp8_channel", 4: "fp8_block"}[int(quant_type)]
    return reference.fused_experts_quant(hidden_states, w1, w1_scale, w2, w2_scale, topk_weight, topk_ids,
                                         weight_format)


@pytest.mark.parametrize("weight_format, quant_type", [("fp8_channel", "per_Token"), ("fp8_block", "per_1x128")])
def test_aiter_adapter_maps_fp8_formats_to_its_quant_types(monkeypatch, weight_format, quant_type):
    fake = fake_aiter.install(monkeypatch, {"fused_moe": _aiter_fused_moe})
    aiter_moe = importlib.import_module("atom_core.ops.aiter.moe")  # fresh: bound to this fake
    x, (w13, s13, w2, s2), (weights, ids), _, _ = make_case(weight_format, 5, 4, 2, 256, 128, torch.bfloat16,
                                                            device="cpu")
    out = torch.empty_like(x)
    aiter_moe.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format, "silu", None, None, out, None, None)
    torch.testing.assert_close(out, reference.fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format))
    name, args = fake.calls[-1]
    assert name == "fused_moe" and args["quant_type"] == getattr(fake.QuantType, quant_type)
    assert args["activation"] == fake.ActivationType.Silu
    assert args["w1"] is w13 and args["w2"] is w2 and args["w1_scale"] is s13 and args["w2_scale"] is s2


def test_aiter_refusals_name_the_reason(monkeypatch):
    supports = fused_moe_module._aiter_quant_supports

    def call(weight_format="fp8_block", hidden=256, inter=128, dtype=torch.bfloat16, activation="silu", biases=False):
        x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case(weight_format, 3, 4, 2, hidden, inter, dtype,
                                                                   biases=biases, device="cpu")
        return supports(x, w13, s13, w2, s2, weights, ids, weight_format, activation, b13, b2, x, None, None)

    assert "e4m3fnuz" in call()  # on this CPU, as on an MI300
    monkeypatch.setattr(quant_ops, "fp8_e4m3fn_native", lambda device: True)
    assert call() is None and call("fp8_channel", hidden=160, inter=96) is None
    assert "per_1x32" in call("mxfp4")
    assert "multiples of 128" in call(hidden=160)
    assert "multiples of 128" in call(inter=96)
    assert "silu" in call(activation="swiglu_clamped")
    assert "biases" in call(biases=True)
    assert "fp16/bf16" in call(dtype=torch.float32)


def test_compiles_in_one_graph_and_passes_opcheck():
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case("fp8_channel", 5, 4, 2, 64, 32, torch.float32,
                                                               biases=True, device="cpu")

    def moe(x):
        return fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format="fp8_channel", w13_bias=b13,
                                   w2_bias=b2, backend="torch") * 2

    torch.testing.assert_close(torch.compile(moe, fullgraph=True, backend="aot_eager")(x), moe(x))
    # opcheck compares the inputs before and after with ops torch's CPU lacks for fp8: the uint8 format here.
    x, (w13, s13, w2, s2), (weights, ids), b13, b2 = make_case("mxfp4", 5, 4, 2, 64, 32, torch.float32, biases=True,
                                                               device="cpu")
    torch.library.opcheck(torch.ops.atom_core.fused_experts_quant.default,
                          (x, w13, s13, w2, s2, weights, ids, "mxfp4", "swiglu_clamped", b13, b2, torch.empty_like(x),
                           None, None, "torch"))


def _args(weight_format="fp8_block", **change):
    x, (w13, s13, w2, s2), (weights, ids), _, _ = make_case(weight_format, 3, 4, 2, 64, 32, torch.float32,
                                                            device="cpu")
    args = dict(hidden=x, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, topk_weights=weights, topk_ids=ids)
    kwargs = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    kwargs.setdefault("weight_format", weight_format)
    return lambda: fused_experts_quant(*args.values(), **kwargs)


@pytest.mark.parametrize(
    "call, match",
    [
        (_args(weight_format="int4"), "weight_format must be one of"),
        (_args(w13=torch.zeros(4, 64, 64)), "w13 dtype"),
        (_args(w13_scale=torch.ones(4, 64, 1)), "w13_scale must have shape"),
        (_args(w2_scale=torch.ones(4, 1, 1, dtype=torch.float16)), "w2_scale dtype"),
        (_args("fp8_channel", w2_scale=torch.ones(4, 64)), "w2_scale must have 3 dims"),
        (_args("mxfp4", w13=torch.zeros(4, 64, 64, dtype=torch.uint8)), "w13 must have shape"),
        (_args("mxfp4", w13_scale=torch.zeros(4, 64, 2)), "w13_scale dtype"),
        (_args("mxfp4", hidden=torch.randn(3, 48)), "multiples of 32"),
        (_args(topk_ids=torch.zeros(3, 2)), "topk_ids dtype"),
        (_args(activation="gelu"), "activation must be one of"),
        (_args(w2_bias=torch.zeros(4, 63)), "w2_bias must have shape"),
        (_args(out=torch.empty(3, 65)), "out must have shape"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_mxfp4_experts_builder_gives_weights_of_the_intended_scale():
    # The test inputs' premise (outputs of order 1): weights with a std within 2x of cols**-0.5.
    packed, scales = mxfp4_experts(0, 2, 64, 256)
    std = reference.dequantize_mxfp4(packed, scales).std().item()
    assert 0.5 < std * math.sqrt(256) < 2
