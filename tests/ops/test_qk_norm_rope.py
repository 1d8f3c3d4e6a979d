"""qk_norm_rope_: per-head RMSNorm of q and k, then RoPE, in place.

The twin is rms_norm then apply_rope_ (checked by hand and bit for bit against the two ops); the
Triton kernel is checked against the twin on views of one fused qkv buffer (v and the padding
must stay untouched), over dtypes, NeoX / GPT-J pairs, partial rotary, GQA and odd sizes.

Inputs: heads of scale 4 (so normalising changes them) and norm weights in [0.05, 0.2], which keeps
the normalised values below 1. Both backends round those values to the dtype before rotating
(as rms_norm's output is rounded); the kernel's inv_rms may differ from the twin's in the last
fp32 bit (another summation order), and Triton's CPU interpreter truncates to bf16 where torch
rounds to nearest, so a normalised value may land one ulp away, which the rotation carries into
the output: below 1 that ulp stays within ELEMENTWISE's absolute tolerance.
"""

import pytest
import torch

from atom_core import ops
from atom_core.ops import qk_norm_rope as qk_norm_rope_module
from atom_core.ops.dispatch import BackendUnavailable, backend_available, trace_backends
from atom_core.ops.reference import qk_norm_rope as reference
from atom_core.ops.rope import rope_cos_sin_cache
from atom_core.ops.tolerances import tolerance
from tests.ops.conftest import DEVICE, DTYPES, ON_GPU, needs_gpu, needs_triton

EPS = 1e-6


class FusedQKV:
    """A fused qkv buffer [T, (Hq + 2 Hk) D + pad] and q, k, v as head views of it (strided tokens)."""

    def __init__(self, tokens, hq, hk, head, *, dtype=torch.float32, seed=0, pad=8):
        g = torch.Generator().manual_seed(seed)
        self.shape = (tokens, hq, hk, head)
        self.buffer = (4 * torch.randn(tokens, (hq + 2 * hk) * head + pad, generator=g)).to(DEVICE, dtype)
        self.q_weight = (0.05 + 0.15 * torch.rand(head, generator=g)).to(DEVICE, dtype)
        self.k_weight = (0.05 + 0.15 * torch.rand(head, generator=g)).to(DEVICE, dtype)

    def views(self, buffer=None):
        _, hq, hk, head = self.shape
        buffer = self.buffer if buffer is None else buffer
        tokens = buffer.shape[0]
        q = buffer[:, : hq * head].view(tokens, hq, head)
        k = buffer[:, hq * head: (hq + hk) * head].view(tokens, hk, head)
        return q, k, buffer[:, (hq + hk) * head:]  # q, k, and v with the padding after it


def _positions(tokens, num_positions, seed=1):
    """Spread over the table, its first and last rows included."""
    positions = torch.randint(0, num_positions, (tokens,), generator=torch.Generator().manual_seed(seed))
    positions[0] = num_positions - 1
    if tokens > 1:
        positions[1] = 0
    return positions.to(DEVICE)


# ---------------------------------------------------------------- the twin


def test_twin_by_hand():
    # One head, D = 4, R = 2, base 100 (inv_freq [1]): x = [2, 2, 2, 2] has rms 2, so with weight
    # [1, 2, 3, 4] it normalises to n = [1, 2, 3, 4] (up to eps); then the pair (n0, n1) turns by the
    # angle p (NeoX and GPT-J agree at R = 2) and dims 2, 3 stay normalised.
    cache, _ = rope_cos_sin_cache(2, 4, 100.0)
    c, s = cache[3, 0].item(), cache[3, 1].item()  # cos 3, sin 3
    scale = 2 / (4 + EPS) ** 0.5
    want = torch.tensor([1 * c - 2 * s, 2 * c + 1 * s, 3.0, 4.0]) * scale
    for is_neox in (True, False):
        q, k = torch.full((1, 1, 4), 2.0), torch.full((1, 1, 4), -2.0)
        reference.qk_norm_rope_(q, k, torch.tensor([1.0, 2, 3, 4]), torch.tensor([1.0, 1, 1, 1]), torch.tensor([3]),
                                cache, eps=EPS, is_neox=is_neox)
        torch.testing.assert_close(q[0, 0], want)
        torch.testing.assert_close(k[0, 0], -torch.tensor([c - s, s + c, 1.0, 1.0]) * scale)  # its own weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_torch_backend_is_rms_norm_then_apply_rope_bit_for_bit(dtype, is_neox):
    tokens, hq, hk, head, rotary = 7, 4, 2, 32, 16
    qkv = FusedQKV(tokens, hq, hk, head, dtype=dtype, seed=2)
    cache, _ = rope_cos_sin_cache(rotary, 50, 10000.0, device=DEVICE)
    positions = _positions(tokens, 50)
    want = qkv.buffer.clone()
    q, k, _ = qkv.views(want)
    for x, weight in ((q, qkv.q_weight), (k, qkv.k_weight)):  # what Qwen3's RMSNorm module did
        x.copy_(ops.rms_norm(x.reshape(-1, head), weight, EPS, backend="torch").view(x.shape))
    ops.apply_rope_(q, k, positions, cache, is_neox=is_neox, backend="torch")
    q, k, _ = qkv.views()
    with trace_backends() as calls:
        ops.qk_norm_rope_(q, k, qkv.q_weight, qkv.k_weight, positions, cache, eps=EPS, is_neox=is_neox,
                          backend="torch")
    assert calls == [("qk_norm_rope_", "torch")]
    assert torch.equal(qkv.buffer, want)


# ---------------------------------------------------------------- Triton kernel vs twin

# (tokens, q heads, kv heads, head size, rotary dim): Qwen3 decode; GLM's partial rotary; odd sizes with
# a rotary dim whose half is no power of two; a longer batch; heads past one tile (D = 512 holds 8
# heads a tile: the head loop runs twice for q); MQA.
SHAPES = [(1, 16, 8, 128, 128), (5, 12, 2, 64, 32), (19, 3, 1, 48, 40), (70, 4, 2, 80, 80), (3, 12, 2, 512, 512),
          (2, 8, 1, 64, 64)]
if ON_GPU:
    SHAPES += [(4096, 32, 8, 128, 128), (989, 64, 4, 128, 64), (257, 16, 2, 256, 64), (33, 40, 8, 128, 128)]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-Hq{}-Hk{}-D{}-R{}".format(*s))
@pytest.mark.parametrize("is_neox", [True, False])
def test_triton_matches_twin_on_fused_qkv_views(dtype, shape, is_neox):
    tokens, hq, hk, head, rotary = shape
    qkv = FusedQKV(tokens, hq, hk, head, dtype=dtype, seed=tokens * head + rotary)
    cache, _ = rope_cos_sin_cache(rotary, 5000, 10000.0, device=DEVICE)
    positions = _positions(tokens, 5000)
    want = qkv.buffer.clone()
    want_q, want_k, _ = qkv.views(want)
    reference.qk_norm_rope_(want_q, want_k, qkv.q_weight, qkv.k_weight, positions, cache, eps=EPS, is_neox=is_neox)
    v_before = qkv.views()[2].clone()
    q, k, v = qkv.views()
    with trace_backends() as calls:
        ops.qk_norm_rope_(q, k, qkv.q_weight, qkv.k_weight, positions, cache, eps=EPS, is_neox=is_neox,
                          backend="triton")
    assert calls == [("qk_norm_rope_", "triton")]
    assert torch.equal(v, v_before)  # v and the padding: not a bit written
    torch.testing.assert_close(q, want_q, **tolerance(dtype))
    torch.testing.assert_close(k, want_k, **tolerance(dtype))


@needs_triton
def test_triton_rotates_the_normalised_values_rounded_as_rms_norm_stores_them():
    # fp16, which the interpreter rounds to nearest as torch does: the kernel then equals the twin but
    # for the rare value an inv_rms one fp32 bit off rounds the other way (measured 0.006% of them);
    # rotating the unrounded fp32 values instead changes about a third of the outputs by an ulp.
    qkv = FusedQKV(64, 4, 2, 64, dtype=torch.float16, seed=9)
    cache, _ = rope_cos_sin_cache(64, 5000, 10000.0, device=DEVICE)
    positions = _positions(64, 5000)
    want = qkv.buffer.clone()
    want_q, want_k, _ = qkv.views(want)
    reference.qk_norm_rope_(want_q, want_k, qkv.q_weight, qkv.k_weight, positions, cache, eps=EPS)
    q, k, _ = qkv.views()
    ops.qk_norm_rope_(q, k, qkv.q_weight, qkv.k_weight, positions, cache, eps=EPS, backend="triton")
    differ = (qkv.buffer != want).float().mean().item()
    assert differ < 0.01, f"{differ:.2%} of the outputs differ from the twin's"


@needs_triton
def test_triton_strided_heads_strided_positions_fp32_weights_and_bf16_cache():
    # Heads strided inside a token (head stride D + 6), fp32 weights on bf16 heads, a bf16 table, positions
    # read through a strided view.
    g = torch.Generator().manual_seed(3)
    q = (4 * torch.randn(5, 3, 70, generator=g)).to(DEVICE, torch.bfloat16)[..., :64]
    k = (4 * torch.randn(5, 2, 64, generator=g)).to(DEVICE, torch.bfloat16)
    q_weight, k_weight = (0.05 + 0.15 * torch.rand(2, 64, generator=g)).to(DEVICE)
    cache, _ = rope_cos_sin_cache(32, 77, 10000.0, dtype=torch.bfloat16, device=DEVICE)
    positions = torch.tensor([0, 9, 76, 9, 1, 9, 75, 9, 38], device=DEVICE)[::2]
    want_q, want_k = q.clone(), k.clone()
    reference.qk_norm_rope_(want_q, want_k, q_weight, k_weight, positions, cache, eps=EPS, is_neox=False)
    ops.qk_norm_rope_(q, k, q_weight, k_weight, positions, cache, eps=EPS, is_neox=False, backend="triton")
    torch.testing.assert_close(q, want_q, **tolerance(torch.bfloat16))
    torch.testing.assert_close(k, want_k, **tolerance(torch.bfloat16))


@needs_triton
def test_triton_position_outside_the_table_zeroes_the_rotary_dims_and_normalises_the_rest():
    # Debug checks off (they would refuse it): like apply_rope_, the kernel does not read the row.
    tokens, hq, hk, head, rotary = 3, 2, 1, 16, 8
    qkv = FusedQKV(tokens, hq, hk, head, seed=4)
    cache, _ = rope_cos_sin_cache(rotary, 10, 10000.0, device=DEVICE)
    positions = torch.tensor([4, -1, 10], device=DEVICE)
    q, k, _ = qkv.views()
    normalised = [ops.reference.rms_norm(x.reshape(-1, head), w, EPS).view(x.shape)
                  for x, w in ((q, qkv.q_weight), (k, qkv.k_weight))]
    with ops.debug_checks(False):
        ops.qk_norm_rope_(q, k, qkv.q_weight, qkv.k_weight, positions, cache, eps=EPS, backend="triton")
    for x, n in zip((q, k), normalised):
        assert bool((x[1:, :, :rotary] == 0).all()) and not bool((x[0, :, :rotary] == 0).any())
        torch.testing.assert_close(x[1:, :, rotary:], n[1:, :, rotary:])


@needs_gpu
def test_triton_token_offsets_past_int32():
    # q's second token starts 2**31 elements into its buffer (4 GiB of bf16): int32 offsets would wrap.
    tokens, heads, head = 2, 4, 128
    buffer = torch.zeros(2**31 + heads * head, dtype=torch.bfloat16, device="cuda")
    q = buffer.as_strided((tokens, heads, head), (2**31, head, 1))
    g = torch.Generator().manual_seed(5)
    q.copy_((4 * torch.randn(tokens, heads, head, generator=g)).to("cuda", torch.bfloat16))
    k = (4 * torch.randn(tokens, 1, head, generator=g)).to("cuda", torch.bfloat16)
    q_weight = k_weight = (0.05 + 0.15 * torch.rand(head, generator=g)).to("cuda", torch.bfloat16)
    cache, _ = rope_cos_sin_cache(head, 64, 10000.0, device="cuda")
    positions = torch.tensor([3, 63], device="cuda")
    want_q, want_k = q.clone(), k.clone()
    reference.qk_norm_rope_(want_q, want_k, q_weight, k_weight, positions, cache, eps=EPS)
    ops.qk_norm_rope_(q, k, q_weight, k_weight, positions, cache, eps=EPS, backend="triton")
    torch.testing.assert_close(q, want_q, **tolerance(torch.bfloat16))
    torch.testing.assert_close(k, want_k, **tolerance(torch.bfloat16))
    assert int(buffer[heads * head: 2**31].count_nonzero()) == 0  # nothing written between the two tokens


@pytest.mark.parametrize("backend", [b for b in ("torch", "triton") if backend_available(b)])
def test_empty_batch_is_a_no_op(backend):
    qkv = FusedQKV(3, 2, 1, 8)
    before = qkv.buffer.clone()
    q, k, _ = qkv.views(qkv.buffer[:0])
    cache, _ = rope_cos_sin_cache(8, 4, 10000.0, device=DEVICE)
    with trace_backends() as calls:
        result = ops.qk_norm_rope_(q, k, qkv.q_weight, qkv.k_weight, torch.empty(0, dtype=torch.int64, device=DEVICE),
                                   cache, eps=EPS, backend=backend)
    assert calls == [("qk_norm_rope_", backend)] and result is None
    assert torch.equal(qkv.buffer, before)


# ---------------------------------------------------------------- what Triton refuses


def _small_call(**overrides):
    args = dict(q=torch.randn(3, 2, 16, device=DEVICE), k=torch.randn(3, 1, 16, device=DEVICE),
                q_weight=torch.ones(16, device=DEVICE), k_weight=torch.ones(16, device=DEVICE),
                positions=torch.tensor([0, 1, 3], device=DEVICE),
                cos_sin_cache=rope_cos_sin_cache(8, 4, 10000.0, device=DEVICE)[0])
    args.update(overrides)
    return args


@pytest.mark.parametrize("override, reason", [
    (lambda: {"q": torch.randn(3, 2, 32, device=DEVICE)[..., ::2]}, "head dim of q and k contiguous"),
    (lambda: {"k_weight": torch.ones(32, device=DEVICE)[::2]}, "q_weight and k_weight contiguous"),
    (lambda: {"cos_sin_cache": rope_cos_sin_cache(16, 4, 10000.0, device=DEVICE)[0][:, ::2]},
     "cos_sin_cache rows contiguous"),
])
def test_what_triton_cannot_serve_falls_back_to_torch_unless_triton_is_named(override, reason):
    args = _small_call(**override())
    want_q, want_k = args["q"].clone(), args["k"].clone()
    reference.qk_norm_rope_(want_q, want_k, args["q_weight"], args["k_weight"], args["positions"],
                            args["cos_sin_cache"], eps=EPS)
    with trace_backends() as calls:
        ops.qk_norm_rope_(**args, eps=EPS)
    assert calls == [("qk_norm_rope_", "torch")]
    torch.testing.assert_close(args["q"], want_q)
    if backend_available("triton"):
        with pytest.raises(BackendUnavailable, match=reason):
            ops.qk_norm_rope_(**args, eps=EPS, backend="triton")


def test_triton_refuses_a_head_past_one_tile():
    big = qk_norm_rope_module.TRITON_MAX_HEAD_DIM + 2
    args = _small_call(q=torch.empty(1, 1, big), k=torch.empty(1, 1, big), q_weight=torch.empty(big),
                       k_weight=torch.empty(big), positions=torch.zeros(1, dtype=torch.int64))
    reason = qk_norm_rope_module._triton_supports(*args.values(), EPS, True)
    assert reason == f"head dim {big} exceeds one tile ({big - 2})"
    assert qk_norm_rope_module._triton_supports(*_small_call().values(), EPS, True) is None


def test_there_is_no_aiter_backend_and_a_named_one_says_so():
    # The module docstring says why (a composition would beat neither path, and auto would prefer it).
    assert qk_norm_rope_module.QK_NORM_ROPE.backends == ["triton", "torch"]
    with pytest.raises(BackendUnavailable, match="has no aiter implementation"):
        ops.qk_norm_rope_(**_small_call(), eps=EPS, backend="aiter")


# ---------------------------------------------------------------- torch.compile, argument checks


def test_compiles_with_fullgraph_on_fused_qkv_views():
    qkv = FusedQKV(2, 2, 1, 8, seed=6)
    cache, _ = rope_cos_sin_cache(8, 16, 10000.0)
    positions = torch.tensor([3, 15])

    def step(buffer):
        q, k, _ = qkv.views(buffer)  # q and k alias one buffer
        ops.qk_norm_rope_(q, k, qkv.q_weight.cpu(), qkv.k_weight.cpu(), positions, cache, eps=EPS, backend="torch")
        return buffer * 1.0

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(qkv.buffer.cpu().clone())
    torch.testing.assert_close(got, step(qkv.buffer.cpu().clone()))


T, H, D = 2, 2, 8
COS_SIN = rope_cos_sin_cache(D, 4, 10000.0)[0]  # 4 positions


def _call(q=None, k=None, q_weight=None, k_weight=None, positions=None, cos_sin_cache=COS_SIN, eps=EPS, **kw):
    ops.qk_norm_rope_(torch.randn(T, H, D) if q is None else q, torch.randn(T, 1, D) if k is None else k,
                      torch.ones(D) if q_weight is None else q_weight, torch.ones(D) if k_weight is None else k_weight,
                      torch.arange(T) if positions is None else positions, cos_sin_cache, eps=eps, **kw)


@pytest.mark.parametrize("call, match", [
    (lambda: _call(q=torch.randn(T, D)), "q must have 3 dims"),
    (lambda: _call(q=torch.randn(T, H, D).int()), "q dtype"),
    (lambda: _call(k=torch.randn(T, 1, D).half()), "k dtype"),
    (lambda: _call(k=torch.randn(T + 1, 1, D)), "k must have shape"),
    (lambda: _call(q_weight=torch.ones(D + 1)), r"q_weight must have shape \(8,\)"),
    (lambda: _call(k_weight=torch.ones(1, D)), "k_weight must have 1 dims"),
    (lambda: _call(k_weight=[1.0] * D), "k_weight must be a torch.Tensor"),
    (lambda: _call(q_weight=torch.ones(D, device="meta")), "tensors must be on one device"),
    (lambda: _call(positions=torch.arange(T).int()), "positions dtype"),
    (lambda: _call(positions=torch.arange(T + 1)), "positions must have shape"),
    (lambda: _call(positions=torch.tensor([0, 4])), r"positions\[1\] = 4 is outside \[0, 4\)"),
    (lambda: _call(cos_sin_cache=COS_SIN[:, :5]), "cos_sin_cache must have an even number of columns"),
    (lambda: _call(cos_sin_cache=torch.cat([COS_SIN, COS_SIN], 1)), "cos_sin_cache must have an even number"),
    (lambda: _call(eps=0.0), r"eps must be > 0, got 0\.0"),
    (lambda: _call(eps=float("nan")), "eps must be > 0, got nan"),
    (lambda: _call(backend="gpu"), "unknown backend"),
])
def test_bad_arguments_are_named(call, match):
    with ops.debug_checks(), pytest.raises((ValueError, TypeError), match=match):
        call()
