"""``paged_attention(quantize=True)``: the output quantized to fp8 with one scale per head, defined as
``per_group_quant`` of the output (in q's dtype) with ``group_size = D``. A Triton decode split over the
context quantizes in its reduce kernel's epilogue, so the result must equal the same kernels' unquantized
output quantized by ``per_group_quant`` bit for bit; one split and prefill run ``per_group_quant`` after the
kernel."""

import pytest
import torch

from atom_core import ops
from atom_core.ops.attention import uses_split_k_decode
from atom_core.ops.reference import quant as reference_quant
from atom_core.ops.triton.attention_decode import paged_attention_decode
from tests.ops.conftest import needs_gpu, needs_triton
from tests.ops.test_attention import SCALE, PagedBatch, sinks_for

FP8 = torch.float8_e4m3fn


def per_head_quant(out: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: per_group_quant of out [T, H, D] viewed as [T, H * D], groups of D."""
    num_tokens, _, head_dim = out.shape
    q, scale = ops.per_group_quant(out.reshape(num_tokens, -1), group_size=head_dim, backend=backend)
    return q.view(out.shape), scale


def assert_same_bits(got: tuple, want: tuple) -> None:
    (got_q, got_scale), (want_q, want_scale) = got, want
    assert got_q.dtype == FP8 and got_scale.dtype == torch.float32 and got_scale.shape == got_q.shape[:2]
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_scale, want_scale)


def decode(batch, num_splits, quantize, **features):
    kw = batch.kwargs(**features)
    args = (*batch.args(), kw["scale"], kw.get("sliding_window"), kw.get("logit_softcap", 0.0), kw.get("sinks"),
            kw["k_scale"], kw["v_scale"])
    if not quantize:
        out = torch.empty_like(batch.q)
        paged_attention_decode(*args, out, None, num_splits=num_splits)
        return out
    out = torch.empty(batch.q.shape, dtype=FP8, device=batch.q.device)
    out_scale = torch.empty(batch.q.shape[:2], device=batch.q.device)
    paged_attention_decode(*args, out, out_scale, num_splits=num_splits)
    return out, out_scale


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "reduce"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, features", [
    (128, {}),                          # the block-FP8 o_proj case: one 1 x 128 group per head
    (32, {"fp8": True, "sinks": True}),  # fp8 cache (v_scale applied before the quantization), sinks
    (40, {"sliding_window": 5}),        # a head padded to 64 lanes: the padding is no part of the amax
])
def test_triton_decode_quantizes_its_output_as_per_group_quant_does(num_splits, dtype, head_dim, features):
    features = dict(features)
    batch = PagedBatch([1, 2, 1], [30, 11, 0], block_size=4, head_dim=head_dim, dtype=dtype, fp8=features.pop("fp8", False),
                       pad_rows_to=4, seed=head_dim + num_splits)  # a 2-token row, a context-0 row, a padding row
    if features.pop("sinks", False):
        features["sinks"] = sinks_for(batch.q.shape[1])
    got = decode(batch, num_splits, True, **features)
    assert_same_bits(got, per_head_quant(decode(batch, num_splits, False, **features), "triton"))


@needs_triton
@pytest.mark.parametrize("query_lens, cached_lens", [([1, 1], [9, 3]), ([5, 1, 3], [0, 12, 4]), ([12, 1], [0, 6])],
                         ids=["decode", "multi_token_decode", "prefill"])
def test_public_op_quantized_output_equals_its_output_quantized(query_lens, cached_lens):
    batch = PagedBatch(query_lens, cached_lens, head_dim=64, dtype=torch.bfloat16, seed=5)
    assert uses_split_k_decode(batch.layout.max_seqlen_q, 4, 2) == (max(query_lens) <= 8)  # prefill: unified
    out = ops.paged_attention(*batch.args(), scale=SCALE, backend="triton")
    assert_same_bits(ops.paged_attention(*batch.args(), scale=SCALE, quantize=True, backend="triton"),
                     per_head_quant(out, "triton"))
    # the twin (torch backend) by the same definition, over its own output
    twin_out = ops.paged_attention(*batch.args(), scale=SCALE, backend="torch")
    assert_same_bits(ops.paged_attention(*batch.args(), scale=SCALE, quantize=True, backend="torch"),
                     per_head_quant(twin_out, "torch"))


@needs_triton
def test_quantized_output_dequantizes_to_the_twin_within_fp8_rounding():
    # e4m3's 3 mantissa bits: each value within half a step, 2**-4 of its magnitude (below 2**-6 * scale,
    # the subnormal step 2**-9 * scale), on top of the attention's own tolerance
    batch = PagedBatch([1, 1, 1], [17, 40, 5], head_dim=128, seed=9)
    q, scale = ops.paged_attention(*batch.args(), scale=SCALE, quantize=True, backend="triton")
    want = batch.twin()
    got = q.to(torch.float32) * scale[:, :, None]
    bound = want.abs() * 2.0 ** -4 + scale[:, :, None] * 2.0 ** -9 + 1e-5
    assert torch.all((got - want).abs() <= bound)
    amax = want.abs().amax(dim=-1)
    torch.testing.assert_close(scale, amax / reference_quant.qmax(FP8), rtol=1e-5, atol=1e-12)


def test_quantize_allocates_its_outputs():
    batch = PagedBatch([1], [3], device="cpu")
    with pytest.raises(ValueError, match="quantize=True.*out=None"):
        ops.paged_attention(*batch.args(), scale=SCALE, quantize=True, out=torch.empty_like(batch.q))


@needs_gpu
@pytest.mark.parametrize("num_rows, context", [(1, 4099), (64, 512), (7, 17)])
def test_gpu_decode_quantizes_its_output_as_per_group_quant_does(num_rows, context):
    # The split count the GPU heuristic picks: several (a reduce) at 1 row, one at 64 rows.
    batch = PagedBatch([1] * num_rows, [context - 1] * num_rows, block_size=16, num_heads=32, num_kv_heads=8,
                       head_dim=128, dtype=torch.bfloat16, seed=num_rows)
    out = ops.paged_attention(*batch.args(), scale=SCALE, backend="triton")
    assert_same_bits(ops.paged_attention(*batch.args(), scale=SCALE, quantize=True, backend="triton"),
                     per_head_quant(out, "triton"))
