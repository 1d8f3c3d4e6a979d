"""Fused experts: a hand-computed anchor, the twin against HF transformers' Qwen3-MoE and GPT-OSS
experts, the expert alignment (moe_align) against its definition, Triton against the twin (CPU
interpreter on small shapes, GPU grids), strided inputs and ``out=``, the AITER argument mapping,
validation and torch.compile."""

# T tokens, E experts, K top-k, H hidden, I intermediate

import importlib
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from atom_core.ops import fused_moe as fused_moe_module
from atom_core.ops.fused_moe import fused_experts
from atom_core.ops.reference import moe as reference
from atom_core.ops.tolerances import MOE
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, needs_gpu, needs_triton, non_contiguous_rows, rand

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
# 16-bit dtypes round the activation between the two GEMMs (the twin does too). A different fp32
# summation order can round one activation element the other way (1 ulp = 2**-8 relative in bf16),
# which moves the outputs it feeds by ~ulp(act) * |w2| — absolute, not relative to the output, so
# outputs near a cancellation need more atol than ELEMENTWISE gives.
MOE_TOL = MOE


def tol(dtype):
    atol, rtol = MOE_TOL[dtype]
    return {"atol": atol, "rtol": rtol}


def make_moe(tokens, experts, top_k, hidden, inter, dtype, *, biases=False, seed=0, device=DEVICE):
    """Random experts scaled so outputs are O(1), and a softmax routing of random logits."""
    g = torch.Generator().manual_seed(seed)
    x = rand(tokens, hidden, dtype=dtype, generator=g, device=device)
    w13 = (rand(experts, 2 * inter, hidden, generator=g, device=device) / math.sqrt(hidden)).to(dtype)
    w2 = (rand(experts, hidden, inter, generator=g, device=device) / math.sqrt(inter)).to(dtype)
    b13 = rand(experts, 2 * inter, dtype=dtype, generator=g, device=device) if biases else None
    b2 = rand(experts, hidden, dtype=dtype, generator=g, device=device) if biases else None
    weights, ids = reference.topk_softmax(rand(tokens, experts, generator=g, device=device), top_k, True)
    return x, w13, w2, weights, ids, b13, b2


def silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


# ----------------------------------------------------------------------------------------------- anchors

@pytest.mark.parametrize("backend", BACKENDS)
def test_anchor_by_hand(backend):
    # x = [1, 2]; E = 2, H = 2, I = 1, silu; w13 rows [gate; up].
    # expert 0: gate [1, 0]·x = 1, up [0, 1]·x = 2 → a = silu(1) * 2; w2 [[1], [-1]] → y0 = [a, -a]
    # expert 1: gate [0, 1]·x = 2, up [1, 1]·x = 3 → b = silu(2) * 3; w2 [[.5], [2]] → y1 = [b/2, 2b]
    x = torch.tensor([[1.0, 2.0]], device=DEVICE)
    w13 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 1.0]]], device=DEVICE)
    w2 = torch.tensor([[[1.0], [-1.0]], [[0.5], [2.0]]], device=DEVICE)
    a, b = silu(1.0) * 2, silu(2.0) * 3
    weights = torch.tensor([[0.25, 0.75]], device=DEVICE)
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    got = fused_experts(x, w13, w2, weights, ids, backend=backend)
    torch.testing.assert_close(got.cpu(), torch.tensor([[0.25 * a + 0.75 * b / 2, -0.25 * a + 0.75 * 2 * b]]))
    # A dropped choice (id -1) adds nothing: only 0.25 * y0 is left.
    got = fused_experts(x, w13, w2, weights, torch.tensor([[0, -1]], dtype=torch.int32, device=DEVICE),
                        backend=backend)
    torch.testing.assert_close(got.cpu(), torch.tensor([[0.25 * a, -0.25 * a]]))
    # swiglu_clamped with biases, one expert: rows interleaved [gate, up] = [1, 0]·x, [0, 1]·x.
    # gate = 1 + 9 → clamped to 7, up = 2 - 1 = 1: act = (1 + 1) * 7 * sigmoid(1.702 * 7); y = w2 * act + 0.5.
    w13_bias = torch.tensor([[9.0, -1.0]], device=DEVICE)
    act = 2 * 7 / (1 + math.exp(-1.702 * 7))
    got = fused_experts(x, w13[:1], w2[:1], torch.ones(1, 1, device=DEVICE), ids[:, :1], activation="swiglu_clamped",
                        w13_bias=w13_bias, w2_bias=torch.full((1, 2), 0.5, device=DEVICE), backend=backend)
    torch.testing.assert_close(got.cpu(), torch.tensor([[act + 0.5, -act + 0.5]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    x, w13, w2, weights, ids, _, _ = make_moe(0, 4, 2, 32, 32, torch.float32)
    assert fused_experts(x, w13, w2, weights, ids, backend=backend).shape == (0, 32)


# ------------------------------------------------------------------------------------ HF transformers

def hf_experts(module_path, class_name, config_name, **config):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_name)(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, **config)
    experts = getattr(importlib.import_module(module_path), class_name)(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return experts


def test_twin_matches_hf_qwen3_moe_experts():
    experts = hf_experts("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts", "Qwen3MoeConfig",
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    x = torch.randn(13, 32)
    weights, ids = reference.topk_softmax(torch.randn(13, 8), 2, True)
    want = experts(x, ids.long(), weights)
    # Qwen3-MoE stores gate_up_proj [E, 2I, H] as [gate | up] halves and down_proj [E, H, I]: our layout.
    got = reference.fused_experts(x, experts.gate_up_proj.detach(), experts.down_proj.detach(), weights, ids)
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)


def test_twin_matches_hf_gpt_oss_experts():
    experts = hf_experts("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts", "GptOssConfig",
                         num_local_experts=8, num_experts_per_tok=4, intermediate_size=16)
    x = 3 * torch.randn(13, 32)  # large enough that the clamps at +-7 act
    weights, ids = reference.gpt_oss_topk(torch.randn(13, 8), 4)
    want = experts(x, ids.long(), weights)
    # GPT-OSS stores x @ W: gate_up_proj [E, H, 2I] (columns interleaved gate, up), down_proj [E, I, H].
    w13 = experts.gate_up_proj.detach().transpose(1, 2)
    w2 = experts.down_proj.detach().transpose(1, 2)
    got = reference.fused_experts(x, w13, w2, weights, ids, "swiglu_clamped", experts.gate_up_proj_bias.detach(),
                                  experts.down_proj_bias.detach())
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ moe_align

@needs_triton
@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 300), experts=st.integers(1, 130), top_k=st.integers(1, 8),
       block_m=st.sampled_from([16, 32, 64]), dtype=st.sampled_from([torch.int32, torch.int64]))
@example(tokens=130, experts=128, top_k=8, block_m=64, dtype=torch.int64)  # 1,040 choices: one step of 2,048
@example(tokens=300, experts=16, top_k=8, block_m=16, dtype=torch.int32)   # 2,400: two steps, the second partial
@example(tokens=1, experts=8, top_k=2, block_m=16, dtype=torch.int32)
def test_moe_align_matches_its_definition(tokens, experts, top_k, block_m, dtype):
    from atom_core.ops.triton.moe_align import align_sizes, moe_align
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-1, experts + 1, (tokens, top_k), generator=g, dtype=dtype)  # -1 and E: dropped
    ids_dev = ids.to(DEVICE)
    sorted_entries, block_experts, num_padded = (t.cpu() for t in moe_align(ids_dev, experts, block_m))
    num_entries = tokens * top_k
    max_padded, max_blocks = align_sizes(num_entries, experts, block_m)
    assert sorted_entries.shape == (max_padded,) and block_experts.shape == (max_blocks,)

    flat = ids.flatten().tolist()
    runs = [[n for n, e in enumerate(flat) if e == expert] for expert in range(experts)]
    padded = [math.ceil(len(run) / block_m) * block_m for run in runs]
    assert num_padded.item() == sum(padded)
    start = 0
    for expert, run in enumerate(runs):
        segment = sorted_entries[start:start + padded[expert]].tolist()
        assert sorted(segment[: len(run)]) == run  # this expert's choices, in any order,
        assert segment[len(run):] == [num_entries] * (padded[expert] - len(run))  # then padding
        assert block_experts[start // block_m:(start + padded[expert]) // block_m].tolist() == \
            [expert] * (padded[expert] // block_m)
        start += padded[expert]
    assert (block_experts[start // block_m:] == -1).all()


# ------------------------------------------------------------------------------------- Triton vs twin

CPU_CASES = [  # (tokens, experts, top_k, hidden, inter, activation, biases, dtype)
    (1, 4, 1, 32, 32, "silu", False, torch.float32),
    (7, 8, 2, 64, 32, "silu", True, torch.bfloat16),
    (33, 8, 2, 48, 64, "swiglu_clamped", True, torch.float32),
    (7, 4, 2, 64, 48, "swiglu_clamped", False, torch.bfloat16),
    (33, 4, 1, 32, 32, "silu", False, torch.float16),
    (7, 8, 2, 40, 24, "swiglu_clamped", True, torch.float16),
]


@needs_triton
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, activation, biases, dtype", CPU_CASES)
def test_triton_matches_twin_small(tokens, experts, top_k, hidden, inter, activation, biases, dtype):
    x, w13, w2, weights, ids, b13, b2 = make_moe(tokens, experts, top_k, hidden, inter, dtype, biases=biases,
                                                 seed=tokens + experts)
    if activation == "swiglu_clamped" and dtype == torch.float32:
        x = 4 * x  # reach the clamps (in 16 bits, activations of ~50 would make MOE_TOL's atol too tight)
    got = fused_experts(x, w13, w2, weights, ids, activation=activation, w13_bias=b13, w2_bias=b2, backend="triton")
    want = reference.fused_experts(x, w13, w2, weights, ids, activation, b13, b2)
    torch.testing.assert_close(got, want, **tol(dtype))


@needs_triton
@pytest.mark.parametrize("block_m, group_m", [(32, 2), (16, 3)])
def test_triton_other_tile_configs(block_m, group_m):
    # Several M blocks per N stripe (GROUP_M), a larger expert padding unit, a ragged last K step.
    from atom_core.ops.triton import fused_moe as triton_moe
    x, w13, w2, weights, ids, b13, b2 = make_moe(33, 4, 2, 48, 40, torch.float32, biases=True, seed=5)
    out = torch.empty_like(x)
    config = triton_moe.BlockConfig(block_m, 16, 32, group_m, 4, 2)
    triton_moe.fused_experts(x, w13, w2, weights, ids, "silu", b13, b2, out, config=config)
    want = reference.fused_experts(x, w13, w2, weights, ids, "silu", b13, b2)
    torch.testing.assert_close(out, want, **tol(torch.float32))


@needs_triton
def test_triton_strided_inputs_out_given_and_dropped_choices():
    x, w13, w2, weights, ids, b13, b2 = make_moe(7, 4, 2, 32, 32, torch.float32, biases=True, seed=9)
    x = non_contiguous_rows(x)
    w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H] view of an [E, H, 2I] buffer
    ids = ids.t().contiguous().t()  # column-major [T, K]
    ids[3, 1] = -1  # a dropped choice
    weights = non_contiguous_rows(weights)
    out = non_contiguous_rows(torch.full((7, 32), float("nan"), device=DEVICE))
    got = fused_experts(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, out=out, backend="triton")
    assert got is out
    torch.testing.assert_close(out, reference.fused_experts(x, w13, w2, weights, ids, "silu", b13, b2),
                               **tol(torch.float32))


@needs_triton
@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 8), top_k=st.integers(1, 4), experts=st.integers(1, 6), data=st.data())
@example(tokens=8, top_k=2, experts=3, data=None)  # 16 choices: the most one block holds
def test_triton_small_batch_sorts_in_program_any_ids(tokens, top_k, experts, data):
    # At most BLOCK_M (16) choices: no moe_align launch; each GEMM program finds its expert and rows from topk_ids,
    # whatever they hold: repeats within a token, dropped (-1) and out-of-range ids.
    from atom_core.ops.triton import fused_moe as triton_moe
    if tokens * top_k > 16:
        tokens = 16 // top_k
    x, w13, w2, _, _, b13, b2 = make_moe(tokens, experts, 1, 32, 16, torch.float32, biases=True, seed=3)
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    if data is None:
        ids = torch.tensor([[0, 0], [1, -1], [2, 3], [0, 2]] * 2, dtype=torch.int32, device=DEVICE)
    else:
        ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, experts), min_size=top_k, max_size=top_k),
                                              min_size=tokens, max_size=tokens)), dtype=torch.int32, device=DEVICE)
    align = triton_moe.moe_align
    sorts = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_moe, "moe_align", lambda *args: sorts.append(args) or align(*args))
        got = fused_experts(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, backend="triton")
    assert sorts == []
    torch.testing.assert_close(got, reference.fused_experts(x, w13, w2, weights, ids, "silu", b13, b2),
                               **tol(torch.float32))


@needs_triton
def test_triton_batch_past_one_block_is_sorted_by_moe_align():
    from atom_core.ops.triton import fused_moe as triton_moe
    x, w13, w2, weights, ids, b13, b2 = make_moe(9, 4, 2, 32, 16, torch.float32, biases=True, seed=4)  # 18 choices
    align = triton_moe.moe_align
    sorts = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_moe, "moe_align", lambda *args: sorts.append(args) or align(*args))
        got = fused_experts(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, backend="triton")
    assert len(sorts) == 1
    torch.testing.assert_close(got, reference.fused_experts(x, w13, w2, weights, ids, "silu", b13, b2),
                               **tol(torch.float32))


GPU_TOKENS = [1, 7, 129, 4099]
GPU_EXPERTS_TOPK = [(8, 1), (8, 2), (64, 2), (64, 8), (128, 8)]


@needs_gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS)
@pytest.mark.parametrize("experts, top_k", GPU_EXPERTS_TOPK)
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
def test_gpu_triton_matches_twin(tokens, experts, top_k, activation):
    dtype = torch.bfloat16
    biases = activation == "swiglu_clamped"
    x, w13, w2, weights, ids, b13, b2 = make_moe(tokens, experts, top_k, 1024, 384, dtype, biases=biases, seed=tokens)
    got = fused_experts(x, w13, w2, weights, ids, activation=activation, w13_bias=b13, w2_bias=b2, backend="triton")
    want = reference.fused_experts(x, w13, w2, weights, ids, activation, b13, b2)
    torch.testing.assert_close(got, want, **tol(dtype))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 99, 989])
def test_gpu_other_dtypes_and_odd_sizes(dtype, tokens):
    x, w13, w2, weights, ids, b13, b2 = make_moe(tokens, 60, 4, 1000, 333, dtype, biases=True, seed=tokens)
    got = fused_experts(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, backend="triton")
    torch.testing.assert_close(got, reference.fused_experts(x, w13, w2, weights, ids, "silu", b13, b2), **tol(dtype))


@needs_gpu
def test_gpu_decode_under_cuda_graph():
    x, w13, w2, weights, ids, _, _ = make_moe(8, 128, 8, 2048, 768, torch.bfloat16)
    out = torch.empty_like(x)
    fused_experts(x, w13, w2, weights, ids, out=out, backend="triton")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w13, w2, weights, ids, out=out, backend="triton")
    new_weights, new_ids = reference.topk_softmax(rand(8, 128), 8, True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(rand(8, 2048, dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out, reference.fused_experts(x, w13, w2, weights, ids), **tol(torch.bfloat16))


# ----------------------------------------------------------------------------- compile, AITER, errors

def test_compiles_in_one_graph():
    x, w13, w2, weights, ids, b13, b2 = make_moe(5, 4, 2, 16, 8, torch.float32, biases=True, device="cpu")

    def moe(x):
        return fused_experts(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, backend="torch") * 2

    torch.testing.assert_close(torch.compile(moe, fullgraph=True, backend="aot_eager")(x), moe(x))


def test_custom_op_passes_opcheck():
    x, w13, w2, weights, ids, b13, b2 = make_moe(5, 4, 2, 16, 8, torch.float32, biases=True, device="cpu")
    torch.library.opcheck(torch.ops.atom_core.fused_experts.default,
                          (x, w13, w2, weights, ids, "silu", b13, b2, torch.empty_like(x), "torch"))


def test_aiter_adapter_argument_mapping(monkeypatch):
    def aiter_fused_moe(hidden_states, w1, w2, topk_weight, topk_ids, bias1, bias2, **defaults):
        assert bias1 is None and bias2 is None
        return reference.fused_experts(hidden_states, w1, w2, topk_weight, topk_ids)

    fake = fake_aiter.install(monkeypatch, {"fused_moe": aiter_fused_moe})
    aiter_moe = importlib.import_module("atom_core.ops.aiter.moe")  # fresh: bound to this fake
    x, w13, w2, weights, ids, _, _ = make_moe(5, 4, 2, 16, 8, torch.bfloat16, device="cpu")
    out = torch.empty_like(x)
    aiter_moe.fused_experts(x, w13, w2, weights, ids, "silu", None, None, out)
    torch.testing.assert_close(out, reference.fused_experts(x, w13, w2, weights, ids))
    name, args = fake.calls[-1]
    assert name == "fused_moe"
    assert args["hidden_states"] is x and args["w1"] is w13 and args["w2"] is w2
    assert args["topk_weight"] is weights and args["topk_ids"] is ids
    assert args["quant_type"] == 0 and args["activation"] == 0  # QuantType.No, ActivationType.Silu (defaults)


def test_aiter_refusals():
    x, w13, w2, weights, ids, b13, b2 = make_moe(5, 4, 2, 16, 8, torch.bfloat16, biases=True, device="cpu")
    supports = fused_moe_module._aiter_supports
    assert supports(x, w13, w2, weights, ids, "silu", None, None, x) is None
    assert "silu" in supports(x, w13, w2, weights, ids, "swiglu_clamped", None, None, x)
    assert "biases" in supports(x, w13, w2, weights, ids, "silu", b13, b2, x)
    assert "fp16/bf16" in supports(x.float(), w13.float(), w2.float(), weights, ids, "silu", None, None, x)
    assert "int32 topk_ids" in supports(x, w13, w2, weights, ids.long(), "silu", None, None, x)
    assert "contiguous" in supports(non_contiguous_rows(x), w13, w2, weights, ids, "silu", None, None, x)


def _args(**change):
    x, w13, w2, weights, ids, _, _ = make_moe(3, 4, 2, 16, 8, torch.float32, device="cpu")
    args = dict(hidden=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    kwargs = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    return lambda: fused_experts(*args.values(), **kwargs)


@pytest.mark.parametrize(
    "call, match",
    [
        (_args(hidden=torch.randn(16)), "hidden must have 2 dims"),
        (_args(hidden=torch.randn(3, 16).int()), "hidden dtype"),
        (_args(w13=torch.randn(4, 16, 16, dtype=torch.float16)), "w13 dtype"),
        (_args(w13=torch.randn(4, 15, 16)), "w13 must hold 2I rows"),
        (_args(w13=torch.randn(4, 16, 12)), "w13 must have shape"),
        (_args(w2=torch.randn(4, 16, 9)), "w2 must have shape"),
        (_args(w2=torch.randn(3, 16, 8)), "w2 must have shape"),
        (_args(topk_ids=torch.zeros(3, 2)), "topk_ids dtype"),
        (_args(topk_ids=torch.zeros(4, 2, dtype=torch.int32)), "topk_ids must have shape"),
        (_args(topk_weights=torch.ones(3, 3)), "topk_weights must have shape"),
        (_args(activation="gelu"), "activation must be one of"),
        (_args(w13_bias=torch.zeros(4, 8)), "w13_bias must have shape"),
        (_args(w2_bias=torch.zeros(16)), "w2_bias must have 2 dims"),
        (_args(out=torch.empty(3, 17)), "out must have shape"),
        (_args(out=torch.empty(3, 16, dtype=torch.float16)), "out must have dtype"),
        (_args(backend="cuda"), "unknown backend"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
