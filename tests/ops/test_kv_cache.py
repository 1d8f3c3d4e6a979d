import importlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from atom_core import ops
from atom_core.ops import kv_cache as kv_cache_module
from atom_core.ops.dispatch import BackendUnavailable, backend_available, trace_backends
from atom_core.ops.kv_cache import store_kv_
from atom_core.ops.reference import kv_cache as reference
from atom_core.ops.tolerances import FP8_KV
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, DTYPES, ON_GPU, needs_triton, rand

FP8 = torch.float8_e4m3fn
SENTINEL = 1000.0  # randn data never reaches it; bf16, fp16 and fp32 hold it exactly


def naive_store(k, v, k_cache, v_cache, slot_mapping):
    """Token by token, written independently of the twin: slot s -> block s // BS, offset s % BS."""
    block_size = k_cache.shape[1]
    for t, s in enumerate(slot_mapping.tolist()):
        if s == -1:
            continue
        k_cache[s // block_size, s % block_size] = k[t]
        v_cache[s // block_size, s % block_size] = v[t]


def filled_caches(num_blocks, block_size, heads, head_size, dtype, device=DEVICE):
    k_cache = torch.full((num_blocks, block_size, heads, head_size), SENTINEL, dtype=dtype, device=device)
    return k_cache, k_cache.clone()


def test_twin_by_hand():
    # BS = 4: slot 5 is block 1, offset 1 (5 = 1*4 + 1); slot 3 is block 0, offset 3; -1 is skipped.
    k = torch.tensor([[[1.0]], [[2.0]], [[3.0]]])  # [T=3, Hk=1, D=1]
    k_cache, v_cache = filled_caches(2, 4, 1, 1, torch.float32, "cpu")
    reference.store_kv_(k, -k, k_cache, v_cache, torch.tensor([5, -1, 3]))
    want = torch.full((2, 4), SENTINEL)
    want[1, 1], want[0, 3] = 1.0, 3.0
    torch.testing.assert_close(k_cache[..., 0, 0], want)
    want[1, 1], want[0, 3] = -1.0, -3.0
    torch.testing.assert_close(v_cache[..., 0, 0], want)


def test_fp8_rounding_by_hand():
    # e4m3 between 1 and 2 steps by 1/8, so 1.0625 ties to even 1.0 and 1.1875 ties to even 1.25;
    # 500 saturates to 448; below 2**-6 the step is 2**-9: 2**-10 ties to 0, 3 * 2**-10 ties to 2**-8.
    x = torch.tensor([1.0625, 1.1875, 500.0, -500.0, 2**-10, 3 * 2**-10, -1.1875, 0.3])
    want = [1.0, 1.25, 448.0, -448.0, 0.0, 2**-8, -1.25, 0.3125]  # 0.3 = 1.2 * 2**-2 -> 1.25 * 2**-2
    assert reference.quantize_fp8(x, torch.tensor([1.0])).float().tolist() == want
    # With scale 2 the stored value is x / 2.
    assert reference.quantize_fp8(2 * x, torch.tensor([2.0])).float().tolist() == want


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 16]),
    num_blocks=st.integers(1, 6),
    data=st.data(),
)
def test_twin_writes_exactly_the_mapped_slots(block_size, num_blocks, data):
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=num_slots))
    padding = data.draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)))
    slot_mapping = torch.tensor([-1 if pad else s for s, pad in zip(slots, padding)], dtype=torch.int64)
    k = torch.randn(len(slots), 2, 3)
    v = torch.randn(len(slots), 2, 3)
    got_k, got_v = filled_caches(num_blocks, block_size, 2, 3, torch.float32, "cpu")
    want_k, want_v = got_k.clone(), got_v.clone()
    reference.store_kv_(k, v, got_k, got_v, slot_mapping)
    naive_store(k, v, want_k, want_v, slot_mapping)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    written = (got_k != SENTINEL).all(-1).all(-1).flatten().nonzero().flatten().tolist()
    assert written == sorted(s for s in slot_mapping.tolist() if s >= 0)


def _boundary_slot_mapping(num_tokens, num_blocks, block_size, generator):
    """Distinct slots, biased to block edges (offsets 0 and BS - 1), with about a quarter set to -1."""
    edges = [b * block_size + o for b in range(num_blocks) for o in {0, block_size - 1}]
    rest = [s for s in torch.randperm(num_blocks * block_size, generator=generator).tolist() if s not in set(edges)]
    slots = (edges + rest)[:num_tokens]
    slots = torch.tensor(slots)[torch.randperm(len(slots), generator=generator)]
    slots[torch.rand(len(slots), generator=generator) < 0.25] = -1
    return slots


# (tokens, kv heads, head size, block size, blocks)
# The last CPU shape has more heads than one tile holds at D = 128, so the head loop runs twice.
SHAPES = [(1, 1, 64, 16, 2), (19, 2, 111, 4, 9), (99, 3, 128, 16, 8), (7, 20, 128, 4, 3)]
if ON_GPU:
    SHAPES += [(989, 8, 128, 16, 80), (4096, 8, 128, 16, 300), (700, 1, 256, 1, 800), (333, 4, 64, 32, 12)]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_twin_on_fused_qkv_views(dtype, shape):
    num_tokens, heads, head_size, block_size, num_blocks = shape
    g = torch.Generator().manual_seed(num_tokens + head_size)
    # k and v are head views into one fused qkv buffer: token stride (2 + 2 Hk) D + 5.
    qkv = rand(num_tokens, (2 + 2 * heads) * head_size + 5, dtype=dtype, generator=g)
    k = qkv[:, 2 * head_size: (2 + heads) * head_size].view(num_tokens, heads, head_size)
    v = qkv[:, (2 + heads) * head_size: (2 + 2 * heads) * head_size].view(num_tokens, heads, head_size)
    slot_mapping = _boundary_slot_mapping(num_tokens, num_blocks, block_size, g).to(DEVICE)
    got_k, got_v = filled_caches(num_blocks, block_size, heads, head_size, dtype)
    want_k, want_v = got_k.clone(), got_v.clone()
    with trace_backends() as calls:
        store_kv_(k, v, got_k, got_v, slot_mapping, backend="triton")
    assert calls == [("store_kv_", "triton")]
    reference.store_kv_(k, v, want_k, want_v, slot_mapping)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)  # a copy: bit exact


@needs_triton
def test_triton_strided_pool_and_heads():
    # K and V caches carved from one pool [NB, 2, BS, Hk, D + 3] (block stride covers both, head
    # stride D + 3), k with strided heads and a strided slot_mapping: every stride the kernel takes
    # differs from packed.
    g = torch.Generator().manual_seed(7)
    num_blocks, block_size, heads, head_size = 5, 8, 3, 24
    pool = torch.full((num_blocks, 2, block_size, heads, head_size + 3), SENTINEL, device=DEVICE)
    got_k, got_v = pool[:, 0, ..., :head_size], pool[:, 1, ..., :head_size]
    k = rand(10, heads, head_size + 6, generator=g)[..., :head_size]
    v = rand(10, heads, head_size, generator=g)
    slots = [0, 7, 8, 39, -1, 15, 16, 31, -1, 20]
    slot_mapping = torch.tensor([[s, 1] for s in slots], device=DEVICE)[:, 0]  # stride 2
    want = pool.clone()
    reference.store_kv_(k, v, want[:, 0, ..., :head_size], want[:, 1, ..., :head_size], slot_mapping)
    store_kv_(k, v, got_k, got_v, slot_mapping, backend="triton")
    assert torch.equal(pool, want)  # the 3 padding dims per head are untouched too


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_fp8_cache_equals_the_twin_bytes_and_round_trips(dtype):
    g = torch.Generator().manual_seed(11)
    num_tokens, heads, head_size, block_size, num_blocks = 37, 2, 64, 16, 4
    k = rand(num_tokens, heads, head_size, dtype=dtype, generator=g) * 3
    v = rand(num_tokens, heads, head_size, dtype=dtype, generator=g) * 50  # some past 448 * v_scale
    k_scale, v_scale = torch.tensor([0.05], device=DEVICE), torch.tensor([0.1], device=DEVICE)
    slot_mapping = _boundary_slot_mapping(num_tokens, num_blocks, block_size, g).to(DEVICE)
    got_k = torch.zeros(num_blocks, block_size, heads, head_size, device=DEVICE).to(FP8)
    got_v, want_k, want_v = got_k.clone(), got_k.clone(), got_k.clone()
    store_kv_(k, v, got_k, got_v, slot_mapping, k_scale=k_scale, v_scale=v_scale, backend="triton")
    reference.store_kv_(k, v, want_k, want_v, slot_mapping, k_scale, v_scale)
    # Against the twin: the same bytes (the same IEEE quotient, the same rounding to nearest even).
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    atol, rtol = FP8_KV
    # Round trip: dequantized cache rows give k back within the fp8 tolerance (k stays in range).
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    stored_k = got_k[slots // block_size, slots % block_size].float() * k_scale
    torch.testing.assert_close(stored_k, k[keep].float(), atol=atol, rtol=rtol)
    stored_v = got_v[slots // block_size, slots % block_size].float() * v_scale
    assert stored_v.abs().max().item() == pytest.approx(448 * 0.1)  # saturated, not inf/nan


@needs_triton
@settings(deadline=None, max_examples=25)
@given(values=st.lists(st.floats(width=32, allow_nan=False), min_size=2, max_size=128),
       scale=st.floats(min_value=2.0**-20, max_value=2.0**20, width=32))
@example(values=[3e38, -3e38, float("inf"), float("-inf"), 1e30, 0.0, -0.0], scale=1e-3)  # quotients past fp32
def test_triton_fp8_store_equals_the_twin_bytes_for_any_values_and_scale(values, scale):
    # Any scale, not only powers of two (those divide exactly): the quotient must be the IEEE one, rounded
    # to nearest even and clamped to +-448 (infinities and quotients past fp32's range too), as the twin's
    # x / scale then cast.
    k = torch.tensor(values, dtype=torch.float32, device=DEVICE).view(-1, 1, 1)
    v = k.flip(0) * 3
    slots = torch.arange(k.shape[0], device=DEVICE)
    got_k, got_v, want_k, want_v = (torch.zeros(k.shape[0], 1, 1, 1, device=DEVICE).to(FP8) for _ in range(4))
    scale = torch.tensor([scale], device=DEVICE)
    store_kv_(k, v, got_k, got_v, slots, k_scale=scale, v_scale=scale, backend="triton")
    reference.store_kv_(k, v, want_k, want_v, slots, scale, scale)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


@needs_triton
def test_triton_fp8_rounding_by_hand():
    # The anchors of test_fp8_rounding_by_hand, through the kernel (scale 2: stored = x / 2).
    x = 2 * torch.tensor([1.0625, 1.1875, 500.0, -500.0, 2**-10, 3 * 2**-10, -1.1875, 0.3], device=DEVICE)
    k = x.view(8, 1, 1)
    k_cache = torch.zeros(1, 8, 1, 1, device=DEVICE).to(FP8)
    v_cache = k_cache.clone()
    scale = torch.tensor([2.0], device=DEVICE)
    store_kv_(k, k, k_cache, v_cache, torch.arange(8, device=DEVICE), k_scale=scale, v_scale=scale, backend="triton")
    assert k_cache.float().flatten().tolist() == [1.0, 1.25, 448.0, -448.0, 0.0, 2**-8, -1.25, 0.3125]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_large_slot_ids(backend):
    # Slots near 2**29 with D = 4: element offsets pass 2**31, so 32-bit offsets would wrap. The pool
    # is ~4 GiB of bf16 but untouched pages cost nothing on the CPU; only the listed slots are read.
    heads, head_size, block_size = 1, 4, 16
    slots = [2**29 - 1, 2**29, 2**29 + 17, 5, -1]
    num_blocks = (2**29 + 17) // block_size + 1
    k_cache = torch.empty(num_blocks, block_size, heads, head_size, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    watched = [s for s in slots if s >= 0] + [2**29 + 1, 2**29 - 2, 4]  # the written slots and neighbours
    for cache in (k_cache, v_cache):
        for s in watched:
            cache[s // block_size, s % block_size] = SENTINEL
    k = torch.arange(20.0, device=DEVICE).view(5, 1, 4).bfloat16()
    store_kv_(k, -k, k_cache, v_cache, torch.tensor(slots, device=DEVICE), backend=backend)
    for t, s in enumerate(slots[:4]):
        assert torch.equal(k_cache[s // block_size, s % block_size], k[t])
        assert torch.equal(v_cache[s // block_size, s % block_size], -k[t])
    for s in watched[4:]:
        assert (k_cache[s // block_size, s % block_size] == SENTINEL).all()


def test_empty_batch_is_a_no_op():
    k_cache, v_cache = filled_caches(2, 4, 1, 8, torch.float32)
    k = torch.empty(0, 1, 8, device=DEVICE)
    store_kv_(k, k, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert (k_cache == SENTINEL).all()


def test_scales_are_ignored_for_a_plain_cache():
    k = torch.randn(2, 1, 4)
    k_cache, v_cache = filled_caches(1, 4, 1, 4, torch.float32, "cpu")
    store_kv_(k, k, k_cache, v_cache, torch.tensor([0, 3]), k_scale=torch.tensor([4.0]), v_scale=torch.tensor([4.0]))
    torch.testing.assert_close(k_cache[0, [0, 3]], k)


def test_non_contiguous_head_dim_falls_back_to_torch_unless_triton_named():
    k = torch.randn(3, 1, 8, device=DEVICE)[..., ::2]
    k_cache, v_cache = filled_caches(2, 2, 1, 4, torch.float32, DEVICE)
    slots = torch.tensor([0, 3, -1], device=DEVICE)
    with trace_backends() as calls:
        store_kv_(k, k, k_cache, v_cache, slots)
    assert calls == [("store_kv_", "torch")]
    torch.testing.assert_close(k_cache[1, 1], k[1])
    if backend_available("triton"):
        with pytest.raises(BackendUnavailable, match="head dim of k, v and the caches contiguous"):
            store_kv_(k, k, k_cache, v_cache, slots, backend="triton")


def test_compiles_with_fullgraph():
    k_cache, v_cache = filled_caches(2, 4, 1, 4, torch.float32, "cpu")
    slot_mapping = torch.tensor([6, -1])

    def step(k, v):
        store_kv_(k, v, k_cache, v_cache, slot_mapping, backend="torch")
        return k_cache.sum()

    k = torch.randn(2, 1, 4)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(k, -k)
    torch.testing.assert_close(k_cache[1, 2], k[0])
    torch.testing.assert_close(got, k_cache.sum())


def _bad(**changes):
    args = dict(k=torch.randn(2, 1, 4), v=torch.randn(2, 1, 4), k_cache=torch.zeros(2, 4, 1, 4),
                v_cache=torch.zeros(2, 4, 1, 4), slot_mapping=torch.tensor([0, 1]))
    args.update(changes)
    return lambda: store_kv_(**args)


@pytest.mark.parametrize(
    "call, match",
    [
        (_bad(k=torch.randn(2, 4)), "k must have 3 dims"),
        (_bad(v=torch.randn(2, 1, 4).half()), "v dtype"),
        (_bad(v=torch.randn(3, 1, 4)), "v must have shape"),
        (_bad(k_cache=torch.zeros(2, 4, 2, 4)), "k_cache must have shape"),
        (_bad(k_cache=torch.zeros(2, 4, 1, 4).half()), "k_cache dtype"),
        (_bad(v_cache=torch.zeros(3, 4, 1, 4)), "v_cache must have shape"),
        (_bad(slot_mapping=torch.tensor([0, 1], dtype=torch.int32)), "slot_mapping dtype"),
        (_bad(slot_mapping=torch.tensor([0])), "slot_mapping must have shape"),
        (_bad(k_cache=torch.zeros(2, 4, 1, 4).to(FP8), v_cache=torch.zeros(2, 4, 1, 4).to(FP8)),
         "k_scale is required"),
        (_bad(k_cache=torch.zeros(2, 4, 1, 4).to(FP8), v_cache=torch.zeros(2, 4, 1, 4).to(FP8),
              k_scale=torch.tensor([1.0]), v_scale=torch.tensor([1.0, 2.0])), "v_scale must hold one"),
        (_bad(k_cache=torch.zeros(2, 4, 1, 4).to(FP8), v_cache=torch.zeros(2, 4, 1, 4).to(FP8),
              k_scale=torch.tensor([1.0]).half(), v_scale=torch.tensor([1.0])), "k_scale dtype"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def _aiter_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                                   v_scale):
    """AITER's documented behaviour: packed heads per token, caches written through a block stride."""
    assert kv_cache_dtype in ("auto", "fp8") and k_scale.dtype == v_scale.dtype == torch.float32
    for t, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        block, offset = divmod(s, key_cache.shape[1])
        for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
            row = x[t].float() / scale if kv_cache_dtype == "fp8" else x[t]
            cache[block, offset] = row.clamp(-448, 448).to(cache.dtype) if kv_cache_dtype == "fp8" else row


def test_aiter_adapter_argument_mapping(monkeypatch):
    fake = fake_aiter.install(monkeypatch, {"reshape_and_cache_flash": _aiter_reshape_and_cache_flash})
    aiter_kv_cache = importlib.import_module("atom_core.ops.aiter.kv_cache")  # fresh: bound to this fake

    k, v = torch.randn(3, 2, 8).bfloat16(), torch.randn(3, 2, 8).bfloat16()
    slot_mapping = torch.tensor([4, -1, 1])
    got_k, got_v = filled_caches(2, 4, 2, 8, torch.bfloat16, "cpu")
    want_k, want_v = got_k.clone(), got_v.clone()
    aiter_kv_cache.store_kv_(k, v, got_k, got_v, slot_mapping, None, None)
    reference.store_kv_(k, v, want_k, want_v, slot_mapping)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)

    scale = torch.tensor([0.5])
    got_k8 = torch.zeros(2, 4, 2, 8).to(FP8)
    got_v8, want_k8, want_v8 = got_k8.clone(), got_k8.clone(), got_k8.clone()
    aiter_kv_cache.store_kv_(k, v, got_k8, got_v8, slot_mapping, scale, scale)
    reference.store_kv_(k, v, want_k8, want_v8, slot_mapping, scale, scale)
    assert torch.equal(got_k8.float(), want_k8.float()) and torch.equal(got_v8.float(), want_v8.float())
    assert [args["kv_cache_dtype"] for _, args in fake.calls] == ["auto", "fp8"]
    assert fake.calls[1][1]["k_scale"] is scale and fake.calls[0][1]["k_scale"].item() == 1.0


def test_aiter_refuses_layouts_it_cannot_index(monkeypatch):
    k = torch.randn(3, 2, 8).bfloat16()
    caches = filled_caches(2, 4, 2, 8, torch.bfloat16, "cpu")
    slots = torch.tensor([0, 1, 2])
    supports = kv_cache_module._aiter_supports
    assert supports(k, k, *caches, slots, None, None) is None
    assert "fp16/bf16" in supports(k.float(), k.float(), *caches, slots, None, None)
    assert "slot_mapping as a packed array" in supports(k, k, *caches, torch.arange(6)[::2], None, None)
    strided_heads = torch.randn(3, 2, 10).bfloat16()[..., :8]
    assert "heads of each token of k packed" in supports(strided_heads, k, *caches, slots, None, None)
    pool = torch.zeros(2, 2, 4, 2, 8).bfloat16()  # [NB, K|V, BS, Hk, D]: block stride 2 BS Hk D
    assert "block stride for both caches" in supports(k, k, pool[:, 0], caches[1], slots, None, None)
    monkeypatch.setattr(kv_cache_module, "_aiter_fp8_is_e4m3fn", lambda device: False)
    fp8_caches = [c.to(FP8) for c in caches]
    assert "e4m3fnuz" in supports(k, k, *fp8_caches, slots, torch.ones(1), torch.ones(1))


@pytest.mark.parametrize("op", ["store_kv_", "rope_store_kv_"])
def test_a_store_into_an_fp8_pool_without_both_scales_is_refused_with_checks_off(op):
    from atom_core.ops.validation import debug_checks

    k, v = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    caches = [torch.zeros(4, 2, 1, 8, dtype=torch.float8_e4m3fn) for _ in range(2)]
    slots = torch.tensor([0, 3])
    args = (k, v, *caches, slots)
    if op == "rope_store_kv_":
        cos_sin = torch.randn(16, 8)
        args = (torch.randn(2, 2, 8), k, v, torch.tensor([0, 1]), cos_sin, *caches, slots)
    with debug_checks(False), pytest.raises(ValueError, match="fp8 cache needs k_scale and v_scale"):
        getattr(ops, op)(*args, k_scale=torch.ones(1))
