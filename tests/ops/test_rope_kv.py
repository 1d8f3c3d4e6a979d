"""rope_store_kv_: RoPE on q and k, then the KV-store of the rotated k and v, in one op. The Triton kernel
against the twin and against the two Triton launches it replaces (bit for bit), over strided views of a
fused qkv buffer, partial rotary dims, both pairings, fp8 caches and padding slots. (The Llama parity tests
check that the attention layer runs it, on Triton, against HF.)"""

import importlib

import pytest
import torch

from atom_core import ops
from atom_core.ops import rope_kv
from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.tolerances import ELEMENTWISE, FP8_KV, tolerance
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, DTYPES, needs_triton
from tests.ops.test_kv_cache import _aiter_reshape_and_cache_flash
from tests.ops.test_rope import _aiter_rope_semantics

SENTINEL = 448.0  # randn data never reaches it; every cache dtype holds it exactly (fp8 e4m3: its largest value)


def _inputs(tokens, hq, hk, head, rotary, dtype, cache_dtype, *, num_blocks=8, block_size=4, seed=0):
    """q, k, v as head views of one fused qkv buffer, a rope table, positions, sentinel-filled caches, a slot
    mapping of distinct shuffled slots with one padding token (-1), and the fp8 scales."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hk) * head, generator=g).to(DEVICE, dtype)
    q = qkv[:, : hq * head].view(tokens, hq, head)
    k = qkv[:, hq * head: (hq + hk) * head].view(tokens, hk, head)
    v = qkv[:, (hq + hk) * head:].view(tokens, hk, head)
    cos_sin, _ = ops.rope_cos_sin_cache(rotary, 64, 10000.0, device=DEVICE)
    positions = torch.randint(0, 64, (tokens,), generator=g).to(DEVICE)
    caches = [torch.full((num_blocks, block_size, hk, head), SENTINEL).to(DEVICE, cache_dtype)
              for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[tokens // 2] = -1
    scales = (torch.tensor([0.5], device=DEVICE), torch.tensor([0.25], device=DEVICE)) \
        if cache_dtype == FP8_DTYPE else (None, None)
    return qkv, q, k, v, positions, cos_sin, caches, slots.to(DEVICE), scales


def _run(fused: bool, backend: str, tokens, hq, hk, head, rotary, is_neox, dtype, cache_dtype):
    """(q, k, k_cache, v_cache) after the fused op, or after apply_rope_ then store_kv_, on ``backend``."""
    _, q, k, v, positions, cos_sin, (k_cache, v_cache), slots, (k_scale, v_scale) = _inputs(
        tokens, hq, hk, head, rotary, dtype, cache_dtype)
    if fused:
        ops.rope_store_kv_(q, k, v, positions, cos_sin, k_cache, v_cache, slots, is_neox=is_neox, k_scale=k_scale,
                           v_scale=v_scale, backend=backend)
    else:
        ops.apply_rope_(q, k, positions, cos_sin, is_neox=is_neox, backend=backend)
        ops.store_kv_(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale, backend=backend)
    return q, k, k_cache, v_cache


SHAPES = [  # (T, Hq, Hk, D, R, is_neox)
    (1, 32, 8, 128, 128, True),   # a Llama-3-8B decode token
    (7, 4, 2, 64, 64, False),     # GPT-J pairing, several tokens per program
    (5, 8, 1, 64, 32, True),      # partial rotary: dims R..D are stored unrotated
    (3, 4, 4, 80, 80, True),      # a head dim that is no power of two (padded tiles)
]


# every shape, input dtype and cache dtype (the input's, or fp8)
GRID = pytest.mark.parametrize("shape, dtype, cache_dtype", [(shape, dtype, cache) for shape in SHAPES
                                                             for dtype in DTYPES for cache in (dtype, FP8_DTYPE)])


@needs_triton
@GRID
def test_triton_gives_the_bits_of_triton_rope_then_triton_store(shape, dtype, cache_dtype):
    fused = _run(True, "triton", *shape, dtype, cache_dtype)
    apart = _run(False, "triton", *shape, dtype, cache_dtype)
    for got, want in zip(fused, apart):
        assert torch.equal(got.float(), want.float())


@needs_triton
@GRID
def test_triton_matches_the_twin(shape, dtype, cache_dtype):
    got = _run(True, "triton", *shape, dtype, cache_dtype)
    want = _run(True, "torch", *shape, dtype, cache_dtype)
    for name, g, w in zip(("q", "k", "k_cache", "v_cache"), got, want):
        # fp8 caches: one e4m3 step (2**-3 relative), as the rotation's last-bit differences from the twin can
        # move a value across a rounding boundary of the cache's grid
        tol = dict(atol=2 * FP8_KV[0], rtol=2.0**-3) if cache_dtype == FP8_DTYPE and name.endswith("cache") \
            else tolerance(dtype, ELEMENTWISE)
        torch.testing.assert_close(g.float(), w.float(), **tol, msg=name)


def test_padding_slot_and_unlisted_slots_keep_their_values_and_v_is_stored_unrotated():
    tokens, hk, head = 6, 2, 64
    qkv, q, k, v, positions, cos_sin, (k_cache, v_cache), slots, _ = _inputs(tokens, 4, hk, head, head,
                                                                              torch.float32, torch.float32)
    v_before = v.clone()
    ops.rope_store_kv_(q, k, v, positions, cos_sin, k_cache, v_cache, slots, backend="torch")
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            block, offset = divmod(s, k_cache.shape[1])
            written[block, offset] = True
            assert torch.equal(k_cache[block, offset], k[t]) and torch.equal(v_cache[block, offset], v_before[t])
    assert (k_cache[~written] == SENTINEL).all() and (v_cache[~written] == SENTINEL).all()
    assert written.sum() == tokens - 1  # the padding token wrote nothing


def test_a_short_slot_mapping_is_refused_by_name_outside_debug_mode():
    _, q, k, v, positions, cos_sin, (k_cache, v_cache), slots, _ = _inputs(4, 4, 2, 64, 64, torch.float32,
                                                                           torch.float32)
    with ops.debug_checks(False), pytest.raises(ValueError, match="slot_mapping must have one slot per token"):
        ops.rope_store_kv_(q, k, v, positions, cos_sin, k_cache, v_cache, slots[:3])


def test_debug_mode_names_a_cos_sin_cache_wider_than_the_head():
    _, q, k, v, positions, _, (k_cache, v_cache), slots, _ = _inputs(4, 4, 2, 64, 64, torch.float32, torch.float32)
    too_wide, _ = ops.rope_cos_sin_cache(128, 64, 10000.0, device=DEVICE)
    with ops.debug_checks(), pytest.raises(ValueError, match="cos_sin_cache"):
        ops.rope_store_kv_(q, k, v, positions, too_wide, k_cache, v_cache, slots)



def test_aiter_backend_runs_the_rope_adapter_then_the_store_adapter_like_the_twin(monkeypatch):
    """Against stand-ins of AITER's rope and reshape_and_cache_flash with their documented semantics."""
    fake = fake_aiter.install(monkeypatch, {"rope_cached_positions_2c_fwd_inplace": _aiter_rope_semantics,
                                            "reshape_and_cache_flash": _aiter_reshape_and_cache_flash})
    for name in ("atom_core.ops.aiter.rope", "atom_core.ops.aiter.kv_cache"):
        importlib.import_module(name)  # fresh: bound to this fake
    def run(fn):
        _, q, k, v, positions, cos_sin, caches, slots, _ = _inputs(5, 4, 2, 32, 16, torch.bfloat16, torch.bfloat16)
        q, k, v, positions, cos_sin, slots = (t.cpu() for t in (q, k, v, positions, cos_sin, slots))
        caches = [c.cpu() for c in caches]
        fn(q, k, v, positions, cos_sin, *caches, slots, True, None, None)
        return q, k, *caches

    got = run(rope_kv._aiter_rope_store_kv)
    want = run(rope_kv._torch_rope_store_kv)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tolerance(torch.bfloat16, ELEMENTWISE))
    assert [name for name, _ in fake.calls] == ["rope_cached_positions_2c_fwd_inplace", "reshape_and_cache_flash"]
