import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from atom_core.cache import build_step_layout
from atom_core.ops import trace_backends
from atom_core.ops.attention import paged_attention, paged_attention_from_layout, uses_split_k_decode
from atom_core.ops.dispatch import backend_available
from atom_core.ops.reference import attention as twin
from atom_core.ops.tolerances import ATTENTION, tolerance
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, needs_gpu, needs_triton

FP8 = torch.float8_e4m3fn
SCALE = 0.3

try:
    import triton
    import triton.language as tl

    from atom_core.ops.triton.attention_unified import fp16_scales

    @triton.jit
    def _fp16_scales_kernel(amax_ptr, up_ptr, down_ptr):
        up, down = fp16_scales(tl.load(amax_ptr))
        tl.store(up_ptr, up)
        tl.store(down_ptr, down)
except ImportError:  # no Triton: the tests that launch it are skipped
    _fp16_scales_kernel = None


class PagedBatch:
    """A step's queries, a pool holding every row's context (NaN in slots no row owns) and its layout."""

    def __init__(self, query_lens, cached_lens, *, block_size=4, num_heads=4, num_kv_heads=2, head_dim=32,
                 dtype=torch.float32, fp8=False, pad_rows_to=None, seed=0, device=DEVICE):
        g = torch.Generator().manual_seed(seed)
        context = [q + c for q, c in zip(query_lens, cached_lens)]
        pages = [-(-n // block_size) for n in context]
        num_blocks = sum(pages) + 2  # two spare blocks nobody owns
        order = torch.randperm(num_blocks, generator=g).tolist()
        tables, used = [], 0
        for n in pages:
            tables.append(order[used:used + n])
            used += n
        self.layout = build_step_layout(query_lens, cached_lens, tables, block_size, pad_rows_to=pad_rows_to)
        slots = torch.cat([torch.tensor([t[j // block_size] * block_size + j % block_size for j in range(n)],
                                        dtype=torch.long) for t, n in zip(tables, context)])
        kv_shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k_scale = self.v_scale = None
        caches = []
        for scale in (0.5, 0.25):
            flat = torch.full(kv_shape, float("nan"))
            flat[slots] = torch.randn(len(slots), num_kv_heads, head_dim, generator=g)
            if fp8:  # the pool holds value / scale, as store_kv_ writes it
                flat = (flat / scale).to(FP8)
            caches.append(flat.to(dtype if not fp8 else FP8).view(num_blocks, block_size, num_kv_heads, head_dim))
        if fp8:
            self.k_scale, self.v_scale = torch.tensor([0.5], device=device), torch.tensor([0.25], device=device)
        self.k_cache, self.v_cache = (c.to(device) for c in caches)
        num_tokens = self.layout.num_tokens
        self.q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(device=device, dtype=dtype)
        self.layout = self.layout.to(device)

    def args(self):
        lay = self.layout
        return (self.q, self.k_cache, self.v_cache, lay.block_tables, lay.cu_seqlens_q, lay.context_lens,
                lay.max_seqlen_q, lay.max_seqlen_k)

    def kwargs(self, **features):
        return dict(scale=SCALE, k_scale=self.k_scale, v_scale=self.v_scale, **features)

    def twin(self, **features):
        return twin.paged_attention(*self.args(), **self.kwargs(**features))


def sinks_for(num_heads, seed=1):
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


# ---------------------------------------------------------------- twins: anchors, naive, SDPA


def _anchor_batch():
    # One row, context 2, one query at position 1. D = 2, scale 1: q = [1, 0], k0 = [2, 0], k1 = 0,
    # so the logits are [q.k0, q.k1] = [2, 0]; v0 = [1, 0], v1 = [0, 1].
    k_cache = torch.tensor([[[[2.0, 0.0]], [[0.0, 0.0]]]], device=DEVICE)  # [NB=1, BS=2, Hk=1, D=2]
    v_cache = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]], device=DEVICE)
    q = torch.tensor([[[1.0, 0.0]]], device=DEVICE)
    meta = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in ([[0]], [0, 1], [2])]
    return (q, k_cache, v_cache, *meta, 1, 2)


E2 = math.e ** 2
ANCHORS = [
    ({}, [E2 / (E2 + 1), 1 / (E2 + 1)]),  # softmax([2, 0])
    ({"sinks": [0.0]}, [E2 / (E2 + 2), 1 / (E2 + 2)]),  # a sink logit 0 adds e^0 = 1 to the denominator
    ({"logit_softcap": 1.0}, [math.e ** math.tanh(2) / (math.e ** math.tanh(2) + 1),
                              1 / (math.e ** math.tanh(2) + 1)]),  # logits [tanh(2), 0]
    ({"sliding_window": 1}, [0.0, 1.0]),  # W = 1: the query at position 1 sees only key 1 -> v1
    ({"sliding_window": 2}, [E2 / (E2 + 1), 1 / (E2 + 1)]),  # W = 2 covers keys 0 and 1
]


def _anchor_features(features):
    if "sinks" in features:
        return {**features, "sinks": torch.tensor(features["sinks"], device=DEVICE)}
    return features


@pytest.mark.parametrize("features, expected", ANCHORS)
def test_hand_computed_anchors(features, expected):
    features = _anchor_features(features)
    want = torch.tensor([[expected]], device=DEVICE)
    for fn in (twin.paged_attention, twin.naive_attention):
        torch.testing.assert_close(fn(*_anchor_batch(), scale=1.0, **features), want)
    if backend_available("triton"):
        got = paged_attention(*_anchor_batch(), scale=1.0, backend="triton", **features)
        torch.testing.assert_close(got, want, **tolerance(torch.float32, ATTENTION))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 9)), min_size=1, max_size=3),
    block_size=st.sampled_from([1, 3, 4]),
    num_kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    sliding_window=st.one_of(st.none(), st.integers(1, 6)),
    logit_softcap=st.sampled_from([0.0, 1.5]),
    with_sinks=st.booleans(),
    fp8=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gathered_twin_matches_naive_twin(rows, block_size, num_kv_heads, group, sliding_window, logit_softcap,
                                          with_sinks, fp8, seed):
    batch = PagedBatch([q for q, _ in rows], [c for _, c in rows], block_size=block_size,
                       num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=4, fp8=fp8, seed=seed)
    features = dict(sliding_window=sliding_window, logit_softcap=logit_softcap,
                    sinks=sinks_for(num_kv_heads * group, seed) if with_sinks else None)
    want = twin.naive_attention(*batch.args(), **batch.kwargs(**features))
    torch.testing.assert_close(batch.twin(**features), want, atol=1e-5, rtol=1e-5)


def test_twin_matches_sdpa_on_dense_causal_prefill():
    batch = PagedBatch([13, 6], [0, 0], num_heads=4, num_kv_heads=2, head_dim=16, seed=3)
    got = batch.twin()
    starts = batch.layout.cu_seqlens_q.tolist()
    for row in range(2):
        q = batch.q[starts[row]:starts[row + 1]]
        k = twin.gather_context(batch.k_cache, batch.layout.block_tables[row], q.shape[0])
        v = twin.gather_context(batch.v_cache, batch.layout.block_tables[row], q.shape[0])
        want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(2, 0),
                                              v.transpose(0, 1).repeat_interleave(2, 0), is_causal=True,
                                              scale=SCALE).transpose(0, 1)
        torch.testing.assert_close(got[starts[row]:starts[row + 1]], want, atol=1e-5, rtol=1e-5)


def test_fp8_cache_means_stored_value_times_scale():
    quantised = PagedBatch([3, 1], [5, 9], fp8=True, seed=5)
    dequantised = PagedBatch([3, 1], [5, 9], seed=5)
    dequantised.k_cache = quantised.k_cache.float() * 0.5  # k_scale
    dequantised.v_cache = quantised.v_cache.float() * 0.25  # v_scale
    torch.testing.assert_close(quantised.twin(), dequantised.twin(), **tolerance(torch.float32, ATTENTION))
    # ... and e4m3 rounding keeps it near the unquantised values (3 mantissa bits; loose bound).
    exact = PagedBatch([3, 1], [5, 9], seed=5)
    assert (quantised.twin() - exact.twin()).abs().max() < 0.5


# ---------------------------------------------------------------- Triton kernels vs the twin

# (query_lens, cached_lens, block_size); the public op picks split-K decode when max q_len <= 8.
SCENARIOS = {
    "prefill_from_scratch": ([7, 19], [0, 0], 4),
    "chunked_prefill_on_prefix": ([5, 11], [13, 20], 16),
    "decode": ([1, 1, 1], [6, 31, 16], 4),
    "multi_token_decode": ([3, 2], [10, 25], 16),
    "mixed": ([1, 12, 1, 4], [20, 0, 5, 9], 4),
    "mixed_block_size_3": ([3, 10, 1], [5, 0, 14], 3),
    "decode_block_size_1": ([1, 1], [5, 2], 1),
}


def check_triton(batch, **features):
    got = paged_attention(*batch.args(), backend="triton", **batch.kwargs(**features))
    torch.testing.assert_close(got, batch.twin(**features), **tolerance(batch.q.dtype, ATTENTION))


@needs_triton
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_triton_scenarios_match_twin(scenario):
    query_lens, cached_lens, block_size = SCENARIOS[scenario]
    check_triton(PagedBatch(query_lens, cached_lens, block_size=block_size, seed=len(scenario)))


FEATURES = {
    "gqa_4_to_1": dict(num_heads=8, num_kv_heads=2),
    "mqa": dict(num_heads=4, num_kv_heads=1),
    "sliding_window": dict(features=dict(sliding_window=5)),
    "softcap": dict(features=dict(logit_softcap=2.0)),
    "sinks": dict(features="sinks"),
    "fp8_cache": dict(fp8=True),
    "bf16_fp8_cache": dict(dtype=torch.bfloat16, fp8=True),  # fp16 dots (attention_unified.fp16_queries)
    "head_dim_80_padded": dict(head_dim=80),
    "bf16": dict(dtype=torch.bfloat16),
    "fp16_head_dim_64": dict(dtype=torch.float16, head_dim=64),
}


@needs_triton
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("scenario", ["mixed", "multi_token_decode"])
def test_triton_features_match_twin(scenario, feature):
    options = dict(FEATURES[feature])
    features = options.pop("features", {})
    query_lens, cached_lens, block_size = SCENARIOS[scenario]
    batch = PagedBatch(query_lens, cached_lens, block_size=block_size, seed=7, **options)
    if features == "sinks":
        features = dict(sinks=sinks_for(batch.q.shape[1]))
    check_triton(batch, **features)


@needs_triton
@pytest.mark.parametrize("num_splits, features", [(2, {}), (5, {"sliding_window": 9, "logit_softcap": 2.0}),
                                                  (3, {"sinks": True})])
def test_split_k_decode_with_several_splits(num_splits, features):
    from atom_core.ops.triton.attention_decode import paged_attention_decode

    # Row 1 is shorter than num_splits tiles (empty splits); row 2 is a padding row (context 0).
    batch = PagedBatch([2, 1], [40, 3], block_size=4, pad_rows_to=3, seed=num_splits)
    if features.get("sinks"):
        features = dict(sinks=sinks_for(batch.q.shape[1]))
    out = torch.full_like(batch.q, float("nan"))
    kw = batch.kwargs(**features)
    paged_attention_decode(*batch.args(), kw["scale"], kw.get("sliding_window"), kw.get("logit_softcap", 0.0),
                           kw.get("sinks"), None, None, out, num_splits=num_splits)
    torch.testing.assert_close(out, batch.twin(**features), **tolerance(torch.float32, ATTENTION))


def test_row_order_holding_a_row_twice_is_named():
    batch = PagedBatch([1, 1, 1], [4, 9, 2], seed=3)
    with pytest.raises(ValueError, match="row_order must hold each row once: row 1 appears 0 times"):
        paged_attention(*batch.args(), scale=SCALE, row_order=torch.tensor([0, 2, 2], dtype=torch.int32, device=DEVICE))


@needs_triton
@settings(max_examples=12, deadline=None)
@given(order=st.permutations(range(6)), num_splits=st.sampled_from([1, 3]))
def test_split_k_decode_output_is_bit_equal_in_any_row_order(order, num_splits):
    from atom_core.ops.triton.attention_decode import paged_attention_decode

    # Uneven contexts (one row spans several 16-key tiles, one is padding); each row's programs compute the
    # same values whichever order they are launched in.
    batch = PagedBatch([1] * 5, [40, 3, 17, 0, 9], block_size=4, pad_rows_to=6, seed=5)
    outs = []
    for row_order in (None, torch.tensor(order, dtype=torch.int32, device=DEVICE)):
        out = torch.full_like(batch.q, float("nan"))
        paged_attention_decode(*batch.args(), SCALE, None, 0.0, None, None, None, out, num_splits=num_splits,
                               row_order=row_order)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], batch.twin(), **tolerance(torch.float32, ATTENTION))


@needs_triton
@pytest.mark.parametrize("query_lens", [[1, 1], [6, 2]], ids=["decode", "prefill"])
def test_padding_rows_output_zeros(query_lens):
    batch = PagedBatch(query_lens, [9, 4], pad_rows_to=4, seed=11)
    got = paged_attention(*batch.args(), sinks=sinks_for(4), scale=SCALE, backend="triton")
    assert batch.layout.context_lens.tolist()[2:] == [0, 0]
    assert torch.all(got[-2:] == 0)
    torch.testing.assert_close(got, batch.twin(sinks=sinks_for(4)), **tolerance(torch.float32, ATTENTION))


@needs_triton
@pytest.mark.parametrize("scenario", ["mixed", "decode"])
def test_non_contiguous_q_and_out_given(scenario):
    query_lens, cached_lens, block_size = SCENARIOS[scenario]
    batch = PagedBatch(query_lens, cached_lens, block_size=block_size, seed=13)
    num_tokens, num_heads, head_dim = batch.q.shape
    # q as the first slice of a fused qkv projection [T, (Hq + 2 * Hk) * D].
    qkv = torch.randn(num_tokens, (num_heads + 4) * head_dim, device=DEVICE)
    qkv[:, : num_heads * head_dim] = batch.q.reshape(num_tokens, -1)
    q_view = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert not q_view.is_contiguous()
    out = torch.full((num_tokens, num_heads, head_dim + 3), float("nan"), device=DEVICE)[..., :head_dim]
    args = (q_view, *batch.args()[1:])
    got = paged_attention(*args, scale=SCALE, out=out, backend="triton")
    assert got is out
    torch.testing.assert_close(out, batch.twin(), **tolerance(torch.float32, ATTENTION))


def _strided(t):
    """The same values as ``t``, every other element of a wider buffer along its first dim."""
    return torch.stack([t, torch.zeros_like(t)], dim=1)[:, 0]


@needs_triton
@pytest.mark.parametrize("scenario", ["mixed", "decode"])
def test_strided_layout_tensors_and_sinks_give_the_contiguous_result(scenario):
    query_lens, cached_lens, block_size = SCENARIOS[scenario]
    batch = PagedBatch(query_lens, cached_lens, block_size=block_size, seed=17)
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_q, max_k = batch.args()
    sinks = sinks_for(q.shape[1])
    want = batch.twin(sinks=sinks)
    views = (_strided(cu_seqlens_q), _strided(context_lens))
    column_major = block_tables.t().contiguous().t()
    got = paged_attention(q, k_cache, v_cache, column_major, *views, max_q, max_k, backend="triton",
                          **batch.kwargs(sinks=_strided(sinks)))
    torch.testing.assert_close(got, want, **tolerance(q.dtype, ATTENTION))


@needs_triton
def test_an_expanded_context_lens_gives_the_contiguous_result():
    batch = PagedBatch([1, 1, 1], [8, 8, 8], block_size=4, seed=19)  # every row 9 tokens long
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_q, max_k = batch.args()
    expanded = context_lens[:1].clone().expand(context_lens.shape[0])  # storage of one element
    got = paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, expanded, max_q, max_k, backend="triton",
                          **batch.kwargs())
    torch.testing.assert_close(got, batch.twin(), **tolerance(q.dtype, ATTENTION))


@needs_triton
def test_from_layout_and_path_choice():
    decode = PagedBatch([1, 1], [8, 3], seed=17)
    prefill = PagedBatch([9, 1], [0, 3], seed=17)
    assert uses_split_k_decode(1, 4, 2) and uses_split_k_decode(8, 32, 2)
    assert not uses_split_k_decode(9, 4, 2) and not uses_split_k_decode(4, 64, 1)
    for batch in (decode, prefill):
        with trace_backends() as calls:
            got = paged_attention_from_layout(batch.q, batch.k_cache, batch.v_cache, batch.layout, scale=SCALE,
                                              backend="triton")
        assert calls == [("paged_attention", "triton")]
        torch.testing.assert_close(got, batch.twin(), **tolerance(torch.float32, ATTENTION))


def test_paged_attention_from_layout_refuses_a_layout_of_another_block_size():
    batch = PagedBatch([5, 1], [0, 6], block_size=4)
    tables = [row[row >= 0].tolist() for row in batch.layout.block_tables.cpu()]
    layout = build_step_layout([5, 1], [0, 6], tables, 8).to(DEVICE)  # the pool's blocks hold 4 tokens
    with pytest.raises(ValueError, match="built with block_size=8 but k_cache holds 4 tokens per block"):
        paged_attention_from_layout(batch.q, batch.k_cache, batch.v_cache, layout, scale=SCALE)


# ---------------------------------------------------------------- unified kernel: full and edge tiles

# Rows (query_len, cached_len): a prefill from scratch, a chunk on a cached prefix, one token late in a
# long context and a short prefill. With 16-key tiles and 8-token query blocks (BLOCK_M 16, GROUP 2)
# the later blocks see several full tiles before their diagonal tile.
TILE_ROWS = [(37, 0), (21, 45), (1, 50), (12, 0)]
TILE_WINDOW = 47  # no multiple of 16 or 32: windows start mid-tile, and span whole tiles


def unified(batch, config, **features):
    """The unified kernel on ``batch`` with an explicit tile config; out starts as NaN."""
    from atom_core.ops.triton.attention_unified import TileConfig, paged_attention_unified

    out = torch.full_like(batch.q, float("nan"))
    kw = batch.kwargs(**features)
    paged_attention_unified(*batch.args(), kw["scale"], kw.get("sliding_window"), kw.get("logit_softcap", 0.0),
                            kw.get("sinks"), kw["k_scale"], kw["v_scale"], out, config=TileConfig(*config))
    return out


def tile_kinds(query_len, cached_len, block_q, block_n, window=None):
    """(full, edge) tiles summed over one row's query blocks, by the split attend_key_range makes."""
    full = edge = 0
    for first in range(0, query_len, block_q):
        pos_lo, pos_hi = cached_len + first, cached_len + min(first + block_q, query_len) - 1
        kv_start = 0 if window is None else max(pos_lo - window + 1, 0) // block_n * block_n
        full_lo = kv_start if window is None else max(-(-max(pos_hi - window + 1, 0) // block_n) * block_n, kv_start)
        full_hi = min((pos_lo + 1) // block_n, (pos_hi + 1) // block_n) * block_n
        full += max(full_hi - full_lo, 0) // block_n
        edge += len(range(kv_start, min(full_lo, pos_hi + 1), block_n))
        edge += len(range(max(full_lo, full_hi), pos_hi + 1, block_n))
    return full, edge


def test_tile_rows_hold_full_tiles_and_edge_tiles():
    # Guards the shapes below: both tile kinds occur, and the window adds leading edge tiles.
    for window in (None, TILE_WINDOW):
        kinds = [tile_kinds(q, c, 8, 16, window) for q, c in TILE_ROWS]
        assert sum(f for f, _ in kinds) >= 4 and sum(e for _, e in kinds) >= 4
    assert tile_kinds(21, 45, 8, 16, TILE_WINDOW)[1] > tile_kinds(21, 45, 8, 16)[1]


@needs_triton
@pytest.mark.parametrize("config, block_size", [
    ((16, 16, 4, 1), 4),  # four pages per tile: one block id per page
    ((16, 16, 4, 1), 16),  # one page per tile
    ((16, 16, 4, 1), 32),  # the tile lies inside a page
    ((16, 16, 4, 1), 3),  # 3 does not divide 16: one block id per key
    ((32, 32, 4, 1), 16),  # 32-key tiles of two pages, 16-token query blocks
    ((32, 32, 4, 1), 6),
], ids=["page4", "page16", "page32", "page3", "tile32_page16", "tile32_page6"])
@pytest.mark.parametrize("features", ["causal", "window_softcap_sinks"])
def test_unified_full_and_edge_tiles_match_twin(config, block_size, features):
    batch = PagedBatch([q for q, _ in TILE_ROWS], [c for _, c in TILE_ROWS], block_size=block_size, seed=block_size)
    if features == "causal":
        features = {}
    else:
        features = dict(sliding_window=TILE_WINDOW, logit_softcap=2.0, sinks=sinks_for(batch.q.shape[1]))
    torch.testing.assert_close(unified(batch, config, **features), batch.twin(**features),
                               **tolerance(torch.float32, ATTENTION))


@needs_triton
@pytest.mark.parametrize("dtype, fp8", [(torch.bfloat16, False), (torch.float16, True)], ids=["bf16", "fp16_fp8_cache"])
def test_unified_full_and_edge_tiles_low_precision(dtype, fp8):
    batch = PagedBatch([q for q, _ in TILE_ROWS], [c for _, c in TILE_ROWS], block_size=4, dtype=dtype, fp8=fp8,
                       seed=3)
    # fp8 -> fp16 is exact and the twin dequantises exactly too: q's dtype sets the tolerance.
    torch.testing.assert_close(unified(batch, (16, 16, 4, 1), sliding_window=TILE_WINDOW),
                               batch.twin(sliding_window=TILE_WINDOW), **tolerance(dtype, ATTENTION))


@needs_triton
@pytest.mark.parametrize("magnitude", [2.0 ** -30, 1.0, 2.0 ** 17])
@pytest.mark.parametrize("scenario", ["decode", "chunked_prefill_on_prefix"])
def test_bf16_queries_over_an_fp8_pool_match_the_twin_at_any_magnitude(scenario, magnitude):
    # q times a power of two, the softmax scale over it: the same logits. The kernels' fp16 dots scale q into
    # fp16's range first; unscaled, q would overflow fp16 (65504) at 2**17, and flush to 0 at 2**-30.
    query_lens, cached_lens, block_size = SCENARIOS[scenario]
    batch = PagedBatch(query_lens, cached_lens, block_size=block_size, dtype=torch.bfloat16, fp8=True, seed=41)
    batch.q = batch.q * magnitude
    kwargs = dict(batch.kwargs(), scale=SCALE / magnitude)
    got = paged_attention(*batch.args(), backend="triton", **kwargs)
    torch.testing.assert_close(got, twin.paged_attention(*batch.args(), **kwargs),
                               **tolerance(torch.bfloat16, ATTENTION))


@needs_triton
@settings(max_examples=60, deadline=None)
# width=32: every mantissa is an fp32 value, so the maximum is too (below 2 * 2**127, not rounded up to inf)
@given(exponent=st.integers(-149, 127), mantissa=st.floats(1.0, 2.0, exclude_max=True, width=32))
@example(exponent=127, mantissa=2.0 - 2.0 ** -23)  # the largest finite fp32
def test_fp16_scales_put_a_tile_maximum_in_fp16_range_by_an_exact_power_of_two(exponent, mantissa):
    amax = torch.tensor([mantissa * 2.0 ** exponent], dtype=torch.float32, device=DEVICE)
    up, down = torch.zeros_like(amax), torch.zeros_like(amax)
    _fp16_scales_kernel[(1,)](amax, up, down)
    assert float(up) * float(down) == 1.0 and math.frexp(float(up))[0] == 0.5  # 2**e and 2**-e
    scaled = float(amax) * float(up)
    assert scaled < 2.0 ** 15  # fp16 holds it
    if float(amax) >= 2.0 ** -112:
        assert scaled >= 2.0 ** 14  # and keeps every bit bf16 had


# ---------------------------------------------------------------- dispatch, validation, custom op


def test_auto_dispatch_serves_every_backend_the_same():
    batch = PagedBatch([3, 1], [2, 6], seed=19)
    with trace_backends() as calls:
        got = paged_attention(*batch.args(), scale=SCALE)
    assert calls[0][1] in ("triton", "torch")
    torch.testing.assert_close(got, batch.twin(), **tolerance(torch.float32, ATTENTION))
    torch.testing.assert_close(paged_attention(*batch.args(), scale=SCALE, backend="torch"), batch.twin())


@pytest.mark.parametrize("quantize", [False, True])
def test_custom_op_passes_opcheck(quantize):
    batch = PagedBatch([2, 1], [1, 3], seed=23)
    out = torch.empty(batch.q.shape, dtype=torch.float8_e4m3fn if quantize else batch.q.dtype)
    out_scale = torch.empty(batch.q.shape[:2]) if quantize else None
    # (the schema test compares the mutated arguments with arithmetic CPU torch lacks for fp8: the fake
    # tensors only, for the quantized form; its schema is the same)
    torch.library.opcheck(torch.ops.atom_core.paged_attention.default,
                          (*batch.args(), SCALE, 3, 0.0, sinks_for(4), None, None, out, out_scale,
                           batch.layout.row_order, "torch"),
                          test_utils=("test_faketensor",) if quantize else ("test_schema", "test_faketensor"))


def test_traces_whole_under_torch_compile():
    batch = PagedBatch([2, 1], [3, 5], seed=1)

    def step(*args):
        return 2 * paged_attention(*args, scale=SCALE, sliding_window=4, backend="torch")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # graph break = error
    torch.testing.assert_close(compiled(*batch.args()), 2 * batch.twin(sliding_window=4))


def _bad(**changes):
    batch = PagedBatch([2], [1], seed=0)
    q, k, v, bt, cu, ctx, mq, mk = batch.args()
    args = dict(q=q, k_cache=k, v_cache=v, block_tables=bt, cu_seqlens_q=cu, context_lens=ctx, max_seqlen_q=mq,
                max_seqlen_k=mk, scale=SCALE)
    args.update(changes)
    return lambda: paged_attention(**args)


@pytest.mark.parametrize("call, match", [
    (_bad(q=torch.randn(3, 4)), "q must have 3 dims"),
    (_bad(q=torch.randn(3, 3, 32)), r"q heads \(3\) must be a multiple"),
    (_bad(k_cache=torch.randn(2, 4, 2, 16)), "k_cache head dim"),
    (_bad(k_cache=torch.randn(2, 4, 2, 32, dtype=torch.float16)), "k_cache dtype"),
    (_bad(v_cache=torch.randn(5, 4, 2, 32)), "v_cache must have shape"),
    (_bad(block_tables=torch.zeros(1, 1, dtype=torch.int64)), "block_tables dtype"),
    (_bad(cu_seqlens_q=torch.zeros(3, dtype=torch.int32)), "cu_seqlens_q must have shape"),
    (_bad(context_lens=torch.zeros(2, dtype=torch.int32)), "context_lens must have shape"),
    (_bad(max_seqlen_q=2.0), "max_seqlen_q must be an int"),
    (_bad(max_seqlen_k=-1), "max_seqlen_k must be >= 0"),
    (_bad(sliding_window=0), "sliding_window must be >= 1"),
    (_bad(logit_softcap=-1.0), "logit_softcap must be a float >= 0"),
    (_bad(sinks=torch.zeros(3)), "sinks must have shape"),
    (_bad(k_scale=torch.ones(2)), "k_scale must hold one value"),
    (_bad(out=torch.empty(2, 4, 16)), "out must have shape"),
    (_bad(row_order=torch.zeros(2, dtype=torch.int32, device=DEVICE)), "row_order must have shape"),
    (_bad(row_order=torch.zeros(1, dtype=torch.int64, device=DEVICE)), "row_order dtype"),
    (_bad(row_order=torch.ones(1, dtype=torch.int32, device=DEVICE)), r"row_order\[0\] = 1 is outside \[0, 1\)"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ---------------------------------------------------------------- AITER adapter (fake aiter)


def _fa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q, dropout_p,
               softmax_scale, logits_soft_cap, causal, window_size, bias, alibi_slopes, deterministic, return_lse,
               return_attn_probs, how_v3_bf16_cvt, block_table, out, cu_seqlens_q_padded, cu_seqlens_k_padded):
    # FlashAttention semantics: causal aligned bottom-right; window (left, right) keeps keys
    # p - left .. p + right; a query that sees no key is undefined here (NaN) for the adapter to fix.
    assert causal and window_size[1] in (0, -1)
    result = torch.full_like(q, float("nan"))
    qs, ks = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for r in range(len(qs) - 1):
        q_len, k_len = qs[r + 1] - qs[r], ks[r + 1] - ks[r]
        if k_len == 0:
            continue
        p = torch.arange(k_len - q_len, k_len).unsqueeze(1)
        j = torch.arange(k_len).unsqueeze(0)
        mask = (j <= p) & ((j >= p - window_size[0]) if window_size[0] >= 0 else True)
        result[qs[r]:qs[r + 1]] = twin.dense_attention(q[qs[r]:qs[r + 1]], k[ks[r]:ks[r + 1]], v[ks[r]:ks[r + 1]],
                                                       mask, scale=softmax_scale, logit_softcap=logits_soft_cap)
    if out is None:
        return result
    out.copy_(result)
    return out


def _pa_rocm(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
             context_lens, block_size, max_context_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
             fp8_out_scale, partition_size, mtp, q_scale):
    # AITER's layouts: K [blocks, Hk, D / x, BS, x], V [blocks, Hk, D, BS]; one query token per row.
    blocks, _, _, _, x = key_cache.shape
    assert key_cache.shape[3] == block_size and exp_sums.shape[2] * partition_size >= max_context_len
    k = key_cache.permute(0, 3, 1, 2, 4).reshape(blocks, block_size, num_kv_heads, -1)
    v = value_cache.permute(0, 3, 1, 2)
    cu = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    result = twin.paged_attention(query, k, v, block_tables, cu, context_lens, 1, max_context_len, scale=scale)
    result[context_lens == 0] = float("nan")  # undefined for an empty context
    out.copy_(result)
    return out


@pytest.mark.parametrize("query_lens, cached_lens, features", [
    ([1, 1, 1], [7, 30, 0], {}),  # decode: paged_attention_rocm
    ([5, 1, 9], [0, 12, 4], {"sliding_window": 4, "logit_softcap": 3.0}),  # varlen
], ids=["decode", "varlen"])
def test_aiter_adapter_argument_mapping(monkeypatch, query_lens, cached_lens, features):
    fake = fake_aiter.install(monkeypatch, {"flash_attn_varlen_func": _fa_varlen, "paged_attention_rocm": _pa_rocm})
    aiter_attention = importlib.import_module("atom_core.ops.aiter.attention")  # re-imported against the fake

    batch = PagedBatch(query_lens, cached_lens, block_size=16, head_dim=64, dtype=torch.bfloat16, pad_rows_to=4,
                       seed=29, device="cpu")
    out = torch.empty_like(batch.q)
    args = (*batch.args(), SCALE, features.get("sliding_window"), features.get("logit_softcap", 0.0), None, None, None,
            out, None, batch.layout.row_order)
    assert aiter_attention.supports(*args) is None
    aiter_attention.paged_attention(*args)
    torch.testing.assert_close(out, batch.twin(**features), **tolerance(torch.bfloat16, ATTENTION))
    name, call = fake.calls[-1]
    if name == "paged_attention_rocm":
        assert call["num_kv_heads"] == 2 and call["block_size"] == 16 and call["scale"] == SCALE
        assert call["max_context_len"] == batch.layout.max_seqlen_k and call["kv_cache_dtype"] == "auto"
    else:
        assert name == "flash_attn_varlen_func" and call["causal"] and call["softmax_scale"] == SCALE
        assert call["window_size"] == (3, 0) and call["logits_soft_cap"] == 3.0
        assert call["cu_seqlens_k"].tolist() == [0, 5, 18, 31, 31]  # prefix sums of context_lens


def test_aiter_supports_is_conservative(monkeypatch):
    fake_aiter.install(monkeypatch, {})
    aiter_attention = importlib.import_module("atom_core.ops.aiter.attention")  # re-imported against the fake

    def reason(batch, out_scale=None, **features):
        return aiter_attention.supports(*batch.args(), SCALE, features.get("sliding_window"),
                                        features.get("logit_softcap", 0.0), features.get("sinks"), batch.k_scale,
                                        batch.v_scale, torch.empty_like(batch.q), out_scale, None)

    decode = PagedBatch([1, 1], [5, 9], block_size=16, head_dim=64, dtype=torch.bfloat16, device="cpu")
    assert reason(decode) is None
    assert "quantize its output" in reason(decode, out_scale=torch.empty(2, 4))
    assert "bf16/fp16" in reason(PagedBatch([1], [5], block_size=16, head_dim=64, device="cpu"))
    assert "sinks" in reason(decode, sinks=torch.zeros(4))
    assert "softcap" in reason(decode, logit_softcap=5.0)
    assert "block sizes" in reason(PagedBatch([1], [5], block_size=4, head_dim=64, dtype=torch.bfloat16,
                                              device="cpu"))
    assert "fp8" in reason(PagedBatch([1], [5], block_size=16, head_dim=64, dtype=torch.bfloat16, fp8=True,
                                      device="cpu"))
    prefill = PagedBatch([4], [3], block_size=4, head_dim=40, dtype=torch.float16, device="cpu")
    assert reason(prefill, sliding_window=3, logit_softcap=5.0) is None


# ---------------------------------------------------------------- GPU grids (realistic sizes)

GPU_BATCHES = [1, 7, 64]
GPU_CONTEXTS = [1, 17, 512, 4099]
GPU_HEAD_DIMS = [64, 128, 256]
GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("head_dim", GPU_HEAD_DIMS)
@pytest.mark.parametrize("context", GPU_CONTEXTS)
@pytest.mark.parametrize("num_rows", GPU_BATCHES)
@pytest.mark.parametrize("query_len", [1, 4, 37], ids=["decode", "multi_token", "chunked_prefill"])
def test_gpu_grid_matches_twin(query_len, num_rows, context, head_dim, dtype):
    query_len = min(query_len, context)
    # Ragged contexts up to `context`, so rows end at different pages.
    cached = [max(context - query_len - 3 * r, 0) for r in range(num_rows)]
    batch = PagedBatch([query_len] * num_rows, cached, block_size=16, num_heads=8, num_kv_heads=2,
                       head_dim=head_dim, dtype=dtype, seed=num_rows * context)
    check_triton(batch)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("context", [512, 4099])
def test_gpu_full_prefill_and_features(context, dtype):
    batch = PagedBatch([context, 17], [0, 40], block_size=16, num_heads=16, num_kv_heads=2, head_dim=128, dtype=dtype,
                       seed=context)
    check_triton(batch)
    check_triton(batch, sliding_window=128, logit_softcap=30.0, sinks=sinks_for(16))
    decode = PagedBatch([1] * 9, [context] * 9, block_size=16, num_heads=16, num_kv_heads=2, head_dim=128,
                        dtype=dtype, fp8=True, seed=context)
    check_triton(decode, sliding_window=128, sinks=sinks_for(16))


@needs_gpu
@pytest.mark.parametrize("config", [(128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)])
@pytest.mark.parametrize("block_size", [16, 3])
def test_gpu_unified_tile_configs_match_twin(config, block_size):
    # Qwen3-0.6B heads; long rows give many full tiles, the window (no multiple of 64) starts mid-tile.
    batch = PagedBatch([700, 130, 1, 9], [0, 900, 1500, 260], block_size=block_size, num_heads=16, num_kv_heads=8,
                       head_dim=128, dtype=torch.bfloat16, seed=block_size)
    for features in ({}, dict(sliding_window=200, logit_softcap=30.0, sinks=sinks_for(16))):
        torch.testing.assert_close(unified(batch, config, **features), batch.twin(**features),
                                   **tolerance(torch.bfloat16, ATTENTION))


@needs_gpu
@pytest.mark.parametrize("query_len", [1, 16], ids=["split_k", "unified"])
def test_cuda_graph_replay_reads_lengths_from_the_device(query_len):
    # Capture with other context lengths and bucket bounds for max_seqlen_*, then replay with the
    # real lengths: the launch must not have baked in anything read from the tensors.
    batch = PagedBatch([query_len] * 6, [40, 700, 3, 1200, 90, 16], block_size=16, num_heads=8, num_kv_heads=2,
                       head_dim=128, dtype=torch.bfloat16, pad_rows_to=8, seed=31)
    context = batch.layout.context_lens.clone()
    batch.layout.context_lens.copy_(torch.where(context > 0, torch.clamp(context // 2, min=query_len), 0))
    out = torch.empty_like(batch.q)

    def step():
        paged_attention(*batch.args()[:6], query_len, 2048, scale=SCALE, out=out, backend="triton")

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    batch.layout.context_lens.copy_(context)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, batch.twin(), **tolerance(torch.bfloat16, ATTENTION))
