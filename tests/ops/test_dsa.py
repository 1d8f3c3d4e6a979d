"""DSA ops (DeepSeek-V3.2 / GLM-5 sparse attention): the indexer-key write, the indexer's top-k and MLA
over the selected positions.

The twins are checked by hand (the write, a tiny top-k), against independent per-token loops in float64
that compute every index score and every attention weight from the formulas (top-k as sets, attention
over the selected keys only), and against dense MLA when every visible position is selected, over
random layouts (ragged prefill, prefix hits, decode, padding rows, block sizes 1/4/16, shuffled blocks).
The Triton backend (strict ``backend="triton"``; the CPU interpreter here) is held to the same checks: its
top-k as a choice (the twin's set up to exact ties), its sparse attention against the twin with shuffled and
-1 entries, several splits, fp8 pools, and with every row it did not select poisoned (it reads only those).

Legend: T tokens, Hi indexer heads, Di indexer head dim, K top-k, H heads, L kv_lora_rank,
R qk_rope_head_dim, NB blocks, BS block size.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_core import ops
from atom_core.ops.dispatch import BackendUnavailable, backend_available, trace_backends
from atom_core.ops.reference import dsa as twin
from atom_core.ops.tolerances import ATTENTION, tolerance
from tests.ops.conftest import DEVICE, needs_triton
from tests.ops.test_mla import LAYOUTS, SENTINEL, MLABatch, on_device, strided_layout

FP32_TOL = tolerance(torch.float32, ATTENTION)


class DSABatch(MLABatch):
    """An ``MLABatch`` plus the indexer's queries [T, Hi, Di], head weights [T, Hi] and key cache [NB, BS, Di]
    (NaN in slots no row owns) over the same blocks."""

    def __init__(self, query_lens, cached_lens, *, index_heads=3, index_dim=8, topk=4, **kwargs):
        super().__init__(query_lens, cached_lens, **kwargs)
        g = torch.Generator().manual_seed(kwargs.get("seed", 0) + 100)
        num_blocks, block_size = self.cache.shape[:2]
        flat = torch.full((num_blocks * block_size, index_dim), float("nan"))
        slots = [t[j // block_size] * block_size + j % block_size for t, n in zip(self.tables, self.context)
                 for j in range(n)]
        flat[slots] = torch.randn(len(slots), index_dim, generator=g)
        self.index_cache = flat.view(num_blocks, block_size, index_dim)
        self.index_q = torch.randn(self.layout.num_tokens, index_heads, index_dim, generator=g)
        self.index_w = torch.randn(self.layout.num_tokens, index_heads, generator=g)
        self.topk = topk
        self.index_scale = index_dim ** -0.5

    def topk_args(self):
        lay = self.layout
        return (self.index_q, self.index_w, self.index_cache, lay.block_tables, lay.cu_seqlens_q, lay.context_lens,
                lay.max_seqlen_q, lay.max_seqlen_k)

    def queries(self):
        """(token, row, position) of every real query token."""
        starts = self.layout.cu_seqlens_q.tolist()
        for row, context_len in enumerate(self.context):
            q_len = starts[row + 1] - starts[row]
            for i in range(q_len):
                yield starts[row] + i, row, context_len - q_len + i


def naive_scores(batch: DSABatch) -> dict[int, list[float]]:
    """token -> the index score of each visible position, in float64, summed head by head from the formula."""
    scores = {}
    for t, row, pos in batch.queries():
        table = batch.tables[row]
        keys = [batch.index_cache[table[j // batch.block_size], j % batch.block_size].double() for j in range(pos + 1)]
        scores[t] = [sum(float(batch.index_w[t, h]) * max(0.0, batch.index_scale * float(batch.index_q[t, h].double() @ key))
                         for h in range(batch.index_q.shape[1])) for key in keys]
    return scores


def assert_keeps_the_top_scores(batch: DSABatch, got: torch.Tensor) -> None:
    """Each query keeps min(K, p + 1) distinct visible positions, none scoring below one it left out (exact ties
    may go either way), then -1."""
    for t, scores in naive_scores(batch).items():
        kept = [int(j) for j in got[t] if j >= 0]
        assert len(kept) == len(set(kept)) == min(batch.topk, len(scores)), f"token {t}: {got[t].tolist()}"
        assert (got[t, len(kept):] == -1).all()
        left_out = [s for j, s in enumerate(scores) if j not in kept]
        if left_out:
            assert min(scores[j] for j in kept) >= max(left_out) - 1e-9, f"token {t} kept {kept}, scores {scores}"


def naive_sparse_mla(batch: MLABatch, selected: dict[int, set[int]]) -> torch.Tensor:
    """Absorbed MLA token by token and head by head in float64, over the selected positions only."""
    latent = batch.w_uk.shape[-1]
    heads, v_dim = batch.w_uv.shape[:2]
    out = torch.zeros(batch.q_nope.shape[0], heads, v_dim, dtype=torch.float64)
    for t, row, _ in DSABatch.queries(batch):
        table = batch.tables[row]
        rows = [batch.cache[table[j // batch.block_size], j % batch.block_size].double() for j in sorted(selected[t])]
        if not rows:
            continue
        for h in range(heads):
            keys = [torch.cat([batch.w_uk[h].double() @ c[:latent], c[latent:]]) for c in rows]
            q = torch.cat([batch.q_nope[t, h], batch.q_pe[t, h]]).double()
            weights = torch.softmax(torch.stack([batch.scale * (q @ k) for k in keys]), dim=0)
            out[t, h] = sum(w * (batch.w_uv[h].double() @ c[:latent]) for w, c in zip(weights, rows))
    return out


# ---- the write ----------------------------------------------------------------------------------------------------

def test_store_indexer_k_writes_each_key_at_its_slot_and_skips_minus_one():
    k = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])   # [T=3, Di=3]
    cache = torch.full((2, 4, 3), SENTINEL)
    ops.store_indexer_k_(k, cache, torch.tensor([6, -1, 1]))
    want = torch.full((2, 4, 3), SENTINEL)
    want[1, 2], want[0, 1] = k[0], k[2]
    assert torch.equal(cache, want)


def test_store_indexer_k_refuses_a_slot_mapping_shorter_than_the_tokens():
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.store_indexer_k_(torch.zeros(3, 4), torch.zeros(2, 2, 4), torch.tensor([0, 1]))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_store_indexer_k_into_an_fp8_cache_writes_each_key_over_its_own_amax_scale(backend):
    g = torch.Generator().manual_seed(30)
    k = torch.randn(5, 128, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0])[:, None]   # a zero key too
    slots = torch.tensor([9, -1, 0, 5, 14])
    cache = torch.full((4, 4, 128), float("nan")).to(torch.float8_e4m3fn).to(DEVICE)
    scale = torch.full((4, 4), -1.0, device=DEVICE)
    ops.store_indexer_k_(k.to(DEVICE), cache, slots.to(DEVICE), indexer_scale=scale, backend=backend)
    cache, scale = cache.cpu(), scale.cpu()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, 4)
        want_scale = max(float(k[t].abs().max()), 1e-10) / 448.0
        assert scale[block, offset].item() == pytest.approx(want_scale, rel=1e-6)
        assert cache[block, offset].float().abs().max() <= 448.0
        # e4m3 keeps 3 mantissa bits: each value within half a step (2^-4 relative) of k / scale, or subnormal
        torch.testing.assert_close(cache[block, offset].float() * scale[block, offset], k[t],
                                   rtol=2 ** -4, atol=2 ** -10 * want_scale)
    unwritten = torch.ones(16, dtype=torch.bool)
    unwritten[slots[slots >= 0]] = False
    assert (scale.view(16)[unwritten] == -1.0).all() and cache.float().view(16, 128)[unwritten].isnan().all()


@needs_triton
def test_triton_store_indexer_k_writes_the_twins_fp8_keys_and_scales_bit_for_bit():
    g = torch.Generator().manual_seed(31)
    k = (torch.randn(37, 128, generator=g) * torch.rand(37, 1, generator=g) * 50).to(torch.bfloat16)
    slots = torch.randperm(4 * 40, generator=g)[:37]
    slots[::5] = -1
    caches = [torch.zeros(40, 4, 128, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
    scales = [torch.zeros(40, 4, device=DEVICE) for _ in range(2)]
    ops.store_indexer_k_(k.to(DEVICE), caches[0], slots.to(DEVICE), indexer_scale=scales[0], backend="triton")
    twin.store_indexer_k_(k.to(DEVICE), caches[1], slots.to(DEVICE), scales[1])
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert torch.equal(scales[0], scales[1]) and (scales[0] > 0).sum() == (slots >= 0).sum()


def test_an_fp8_indexer_cache_without_its_scales_is_refused_by_name():
    k, slots = torch.zeros(2, 8), torch.tensor([0, 1])
    cache = torch.zeros(2, 4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="indexer_scale .* is required"):
        ops.store_indexer_k_(k, cache, slots)
    with pytest.raises(ValueError, match=r"indexer_scale must have shape \(2, 4\)"):
        ops.store_indexer_k_(k, cache, slots, indexer_scale=torch.zeros(8))
    batch = DSABatch([1], [3], seed=32)
    fp8 = batch.index_cache.nan_to_num().to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="indexer_scale .* is required"):
        ops.indexer_topk(batch.index_q, batch.index_w, fp8, *batch.topk_args()[3:], topk=2, scale=1.0)


# ---- the indexer's top-k ------------------------------------------------------------------------------------------

def test_indexer_topk_by_hand_keeps_the_highest_weighted_relu_scores_and_pads_with_minus_one():
    # One row of 3 tokens, one head, Di = 1, BS = 4, K = 2: keys 1, -2, 3; q = 1 at every token, weight 1.
    # Token at position 0 sees key 0 only -> [0, -1]; position 1: scores relu(1), relu(-2) = 1, 0 -> {0, 1};
    # position 2: 1, 0, 3 -> {2, 0}.
    cache = torch.tensor([[[1.0], [-2.0], [3.0], [SENTINEL]]])
    q, weights = torch.ones(3, 1, 1), torch.ones(3, 1)
    got = ops.indexer_topk(q, weights, cache, torch.tensor([[0]], dtype=torch.int32),
                           torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 3, 3,
                           topk=2, scale=1.0)
    assert got.dtype == torch.int32 and got.tolist() == [[0, -1], [0, 1], [2, 0]]
    # A negative head weight turns the preference around: position 2 now keeps the two lowest relu scores.
    got = ops.indexer_topk(q, -weights, cache, torch.tensor([[0]], dtype=torch.int32),
                           torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 3, 3,
                           topk=2, scale=1.0)
    assert set(got[2].tolist()) == {1, 0}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_indexer_topk_keeps_the_positions_a_float64_score_loop_ranks_highest(layout):
    query_lens, cached_lens = LAYOUTS[layout]
    batch = DSABatch(query_lens, cached_lens, block_size=4, topk=4, seed=1)
    got = ops.indexer_topk(*batch.topk_args(), topk=batch.topk, scale=batch.index_scale)
    assert_keeps_the_top_scores(batch, got)
    assert any(pos + 1 > batch.topk for _, _, pos in batch.queries())  # some query drops positions


def topk_args_on_device(batch: DSABatch) -> tuple:
    """``batch.topk_args()`` on the test device (the interpreter's CPU, or the GPU)."""
    lay = batch.layout.to(DEVICE)
    return (batch.index_q.to(DEVICE), batch.index_w.to(DEVICE), batch.index_cache.to(DEVICE), lay.block_tables,
            lay.cu_seqlens_q, lay.context_lens, lay.max_seqlen_q, lay.max_seqlen_k)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@settings(max_examples=20, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 20)), min_size=1, max_size=4),
       block_size=st.sampled_from([1, 4, 16]), pad_rows=st.integers(0, 2), topk=st.integers(1, 12),
       seed=st.integers(0, 2**16))
def test_indexer_topk_matches_the_loop_on_any_layout_and_pads_padding_rows(backend, rows, block_size, pad_rows, topk,
                                                                           seed):
    query_lens, cached_lens = zip(*rows)
    batch = DSABatch(list(query_lens), list(cached_lens), block_size=block_size, topk=topk, seed=seed,
                     pad_rows_to=len(rows) + pad_rows)
    got = ops.indexer_topk(*topk_args_on_device(batch), topk=topk, scale=batch.index_scale, backend=backend).cpu()
    assert_keeps_the_top_scores(batch, got)
    num_real = sum(query_lens)
    assert (got[num_real:] == -1).all()


def fp8_index_cache(batch: DSABatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 cache [NB, BS, Di], fp32 scales [NB, BS]): every slot of ``batch.index_cache`` (NaN slots as 0)
    written by the twin's ``store_indexer_k_``."""
    num_blocks, block_size, dim = batch.index_cache.shape
    fp8 = torch.zeros(num_blocks, block_size, dim, dtype=torch.float8_e4m3fn)
    key_scale = torch.zeros(num_blocks, block_size)
    ops.store_indexer_k_(batch.index_cache.view(-1, dim).nan_to_num(), fp8, torch.arange(num_blocks * block_size),
                         indexer_scale=key_scale, backend="torch")
    return fp8, key_scale


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("layout", ["ragged_prefill", "chunk_after_prefix", "decode"])
def test_indexer_topk_over_fp8_keys_ranks_by_the_dequantized_keys(backend, layout):
    # The fp8 cache and its per-key scales come from the write (fp8_index_cache); the float64 loop scores
    # cache * scale against q rounded to e4m3 a head at a time (twin.indexer_queries); the op gets q as it is.
    query_lens, cached_lens = LAYOUTS[layout]
    batch = DSABatch(query_lens, cached_lens, block_size=4, topk=4, seed=33)
    fp8, key_scale = fp8_index_cache(batch)
    batch.index_cache = fp8.float() * key_scale[..., None]            # what the loop scores
    q, batch.index_q = batch.index_q, twin.indexer_queries(batch.index_q, fp8)
    assert not torch.equal(q, batch.index_q)
    lay = batch.layout.to(DEVICE)
    got = ops.indexer_topk(q.to(DEVICE), batch.index_w.to(DEVICE), fp8.to(DEVICE), lay.block_tables,
                           lay.cu_seqlens_q, lay.context_lens, lay.max_seqlen_q, lay.max_seqlen_k, topk=batch.topk,
                           scale=batch.index_scale, indexer_scale=key_scale.to(DEVICE), backend=backend).cpu()
    assert_keeps_the_top_scores(batch, got)


@needs_triton
def test_triton_scores_over_fp8_keys_are_the_twins_formula_with_e4m3_queries():
    # Scores, not a choice: q left unrounded would be off by e4m3's 2^-4 relative steps, far past fp32's.
    from atom_core.ops.triton.dsa_indexer import index_scores

    batch = DSABatch([1, 3], [6, 2], block_size=4, index_dim=32, seed=34)
    fp8, key_scale = fp8_index_cache(batch)
    lay = batch.layout.to(DEVICE)
    width = lay.max_seqlen_k
    got = torch.full((lay.num_tokens, width), float("nan"), device=DEVICE)
    index_scores(batch.index_q.to(DEVICE), batch.index_w.to(DEVICE), fp8.to(DEVICE), key_scale.to(DEVICE),
                 lay.block_tables, lay.cu_seqlens_q, lay.context_lens, width, batch.index_scale, 0, lay.num_tokens, got)
    keys = twin.indexer_keys(fp8, key_scale)
    q = twin.indexer_queries(batch.index_q, fp8)
    for t, row, pos in batch.queries():
        table = batch.tables[row]
        row_keys = torch.stack([keys[table[j // batch.block_size], j % batch.block_size] for j in range(pos + 1)])
        want = twin.index_scores(q[t:t + 1], batch.index_w[t:t + 1], row_keys, scale=batch.index_scale)[0]
        torch.testing.assert_close(got[t, :pos + 1].cpu(), want, rtol=1e-5, atol=1e-5)
        assert (got[t, pos + 1:] == float("-inf")).all()


def test_indexer_topk_writes_out_and_auto_serves_triton_wherever_it_runs():
    batch = DSABatch([2, 1], [3, 6], seed=5)
    out = torch.full((3, batch.topk), 99, dtype=torch.int32, device=DEVICE)
    with trace_backends() as calls:   # on the test device: auto picks triton for tensors it can serve
        result = ops.indexer_topk(*topk_args_on_device(batch), topk=batch.topk, scale=batch.index_scale, out=out)
    auto = "triton" if backend_available("triton") else "torch"   # no selftest record here: triton is not vetoed
    assert result is out and not (out == 99).any() and calls == [("indexer_topk", auto)]
    with pytest.raises(BackendUnavailable, match="no aiter implementation"):
        ops.indexer_topk(*batch.topk_args(), topk=batch.topk, scale=batch.index_scale, backend="aiter")
    with pytest.raises(ValueError, match="out must have shape"):
        ops.indexer_topk(*batch.topk_args(), topk=batch.topk, scale=batch.index_scale,
                         out=torch.empty(3, batch.topk + 1, dtype=torch.int32))


# ---- sparse attention ---------------------------------------------------------------------------------------------

def random_selection(batch: DSABatch, topk: int, seed: int) -> tuple[torch.Tensor, dict[int, set[int]]]:
    """int32 [T, topk]: each query's random subset of its visible positions (shuffled, -1 padded)."""
    g = torch.Generator().manual_seed(seed)
    indices = torch.full((batch.layout.num_tokens, topk), -1, dtype=torch.int32)
    chosen = {}
    for t, _, pos in batch.queries():
        picks = torch.randperm(pos + 1, generator=g)[:topk]
        indices[t, :picks.numel()] = picks.to(torch.int32)
        chosen[t] = set(picks.tolist())
    return indices, chosen


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sparse_attention_equals_a_float64_loop_over_the_selected_keys_only(layout):
    query_lens, cached_lens = LAYOUTS[layout]
    batch = DSABatch(query_lens, cached_lens, block_size=4, seed=2)
    indices, chosen = random_selection(batch, 3, seed=2)
    got = ops.mla_sparse_attention(*batch.args()[:5], indices, *batch.args()[5:], scale=batch.scale)
    torch.testing.assert_close(got.double(), naive_sparse_mla(batch, chosen), **FP32_TOL)
    dense = ops.mla_decode_attention(*batch.args(), scale=batch.scale)
    assert not torch.allclose(got, dense, atol=1e-3)  # the selection matters


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@settings(max_examples=20, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 20)), min_size=1, max_size=4),
       block_size=st.sampled_from([1, 4, 16]), pad_rows=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_sparse_attention_with_every_visible_position_selected_equals_dense_mla(backend, rows, block_size, pad_rows,
                                                                                seed):
    query_lens, cached_lens = zip(*rows)
    batch = on_device(DSABatch(list(query_lens), list(cached_lens), block_size=block_size, seed=seed,
                               pad_rows_to=len(rows) + pad_rows))
    topk = max(batch.context) + 3   # >= every context: the indexer keeps everything
    indices = ops.indexer_topk(*topk_args_on_device(batch), topk=topk, scale=batch.index_scale, backend=backend)
    sparse = ops.mla_sparse_attention(*batch.args()[:5], indices, *batch.args()[5:], scale=batch.scale,
                                      backend=backend).cpu()
    dense = ops.mla_decode_attention(*batch.args(), scale=batch.scale, backend="torch").cpu()
    assert torch.isfinite(sparse).all()  # no NaN slot was read
    torch.testing.assert_close(sparse, dense, **FP32_TOL)
    num_real = sum(query_lens)
    assert torch.equal(sparse[num_real:], torch.zeros_like(sparse[num_real:]))  # padding rows: zeros


@needs_triton
def test_triton_indexer_and_sparse_attention_on_strided_layout_tensors_equal_the_contiguous_layout():
    batch = on_device(DSABatch([2, 1, 3], [5, 8, 0], block_size=4, seed=8))
    topk = max(batch.context) + 3
    args = topk_args_on_device(batch)
    want = ops.indexer_topk(*args, topk=topk, scale=batch.index_scale, backend="triton")
    got = ops.indexer_topk(*strided_layout(args), topk=topk, scale=batch.index_scale, backend="triton")
    assert torch.equal(got, want)
    want = ops.mla_sparse_attention(*batch.args()[:5], want, *batch.args()[5:], scale=batch.scale, backend="triton")
    got = ops.mla_sparse_attention(*batch.args()[:5], got, *strided_layout(batch.args())[5:], scale=batch.scale,
                                   backend="triton")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sparse_attention_reads_an_fp8_pool_as_row_times_kv_scale():
    fp8 = DSABatch([2, 1], [5, 8], block_size=4, seed=4, fp8=True)
    dequantised = DSABatch([2, 1], [5, 8], block_size=4, seed=4)
    dequantised.cache = fp8.cache.float() * fp8.kv_scale
    indices, _ = random_selection(fp8, 3, seed=4)
    got = ops.mla_sparse_attention(*fp8.args()[:5], indices, *fp8.args()[5:], scale=fp8.scale,
                                   kv_scale=fp8.kv_scale)
    want = ops.mla_sparse_attention(*dequantised.args()[:5], indices, *dequantised.args()[5:], scale=fp8.scale)
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_custom_ops_are_registered_under_torch_ops_atom_core():
    batch = DSABatch([2], [3], seed=6)
    lay = batch.layout
    out = torch.empty(2, batch.topk, dtype=torch.int32)
    torch.ops.atom_core.indexer_topk(*batch.topk_args(), batch.topk, batch.index_scale, None, out, None)
    want = twin.indexer_topk(*batch.topk_args(), topk=batch.topk, scale=batch.index_scale)
    assert torch.equal(out.sort(dim=1).values, want.sort(dim=1).values)  # the same positions (order unspecified)
    attn = torch.empty(2, 3, 10)
    torch.ops.atom_core.mla_sparse_attention(batch.q_nope, batch.q_pe, batch.cache, batch.w_uk, batch.w_uv, out,
                                             lay.block_tables, lay.cu_seqlens_q, lay.context_lens, lay.max_seqlen_q,
                                             lay.max_seqlen_k, batch.scale, None, attn, None)
    torch.testing.assert_close(attn, twin.mla_sparse_attention(*batch.args()[:5], out, *batch.args()[5:],
                                                               scale=batch.scale), **FP32_TOL)
    assert hasattr(torch.ops.atom_core, "store_indexer_k_")


@pytest.mark.parametrize("bad, message", [(5, "may select -1 or a position in \\[0, 4\\]"),
                                          (-2, "may select -1"), ("repeat", "more than once")])
def test_debug_checks_refuse_a_selected_position_outside_the_causal_window_or_repeated(bad, message):
    batch = DSABatch([1], [4], seed=7)   # one decode query at position 4
    indices = torch.tensor([[0, 1, 2, -1]], dtype=torch.int32)
    indices[0, 3] = 1 if bad == "repeat" else bad
    with ops.debug_checks(), pytest.raises(ValueError, match=message):
        ops.mla_sparse_attention(*batch.args()[:5], indices, *batch.args()[5:], scale=batch.scale)


def test_debug_checks_name_indexer_weights_of_the_wrong_shape():
    batch = DSABatch([2], [3], seed=8)
    args = list(batch.topk_args())
    args[1] = args[1][:, :2]
    with ops.debug_checks(), pytest.raises(ValueError, match="weights must have shape"):
        ops.indexer_topk(*args, topk=batch.topk, scale=batch.index_scale)


# ---- the Triton backend (strict: a fallback cannot pass) ----------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("tokens, dim", [(6, 16), (37, 128)])   # 37 rows of 128: several programs
def test_triton_store_indexer_k_writes_the_twins_cache_cast_to_its_dtype(tokens, dim):
    g = torch.Generator().manual_seed(20)
    wide = torch.randn(tokens, dim + 8, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    k = wide[:, 4:dim + 4]                                               # a strided view, last dim contiguous
    slots = torch.randperm(4 * (tokens + 2), generator=g)[:tokens].to(DEVICE)
    slots[1::4] = -1                                                     # padding tokens write nothing
    caches = [torch.full((tokens + 2, 4, dim), SENTINEL, device=DEVICE) for _ in range(2)]   # fp32 cache, bf16 keys
    ops.store_indexer_k_(k, caches[0], slots, backend="triton")
    twin.store_indexer_k_(k, caches[1], slots)
    assert torch.equal(caches[0], caches[1])
    assert (caches[0] == SENTINEL).any() and not (caches[0] == SENTINEL).all()


def scores_of(batch: DSABatch, t: int, kept) -> list[float]:
    """The float64 scores of the positions ``kept`` by token t, sorted (naive_scores' formula)."""
    table_scores = naive_scores(batch)[t]
    return sorted(table_scores[j] for j in kept)


@needs_triton
@pytest.mark.parametrize("layout, block_size, topk", [("ragged_prefill", 4, 3), ("chunk_after_prefix", 6, 5),
                                                      ("decode", 1, 4), ("multi_token_decode", 16, 40)])
def test_triton_indexer_topk_keeps_the_twins_set_up_to_exact_ties(layout, block_size, topk):
    query_lens, cached_lens = LAYOUTS[layout]
    batch = DSABatch(query_lens, cached_lens, block_size=block_size, topk=topk, seed=21,
                     pad_rows_to=len(query_lens) + 1)
    got = ops.indexer_topk(*topk_args_on_device(batch), topk=topk, scale=batch.index_scale, backend="triton").cpu()
    want = twin.indexer_topk(*batch.topk_args(), topk=topk, scale=batch.index_scale)
    assert got.shape == want.shape and (got[batch.layout.num_tokens - 1] == -1).all()   # the padding row
    for t, _, _ in batch.queries():
        kept, wanted = [int(j) for j in got[t] if j >= 0], [int(j) for j in want[t] if j >= 0]
        assert len(kept) == len(set(kept)) == len(wanted)
        # The same set, except where positions score exactly alike (relu zeros tie often): same scores then.
        assert scores_of(batch, t, kept) == pytest.approx(scores_of(batch, t, wanted), abs=1e-9), f"token {t}"
    # Every case but the last drops positions; the last keeps every position of contexts shorter than K.
    assert any(pos + 1 > topk for _, _, pos in batch.queries()) == (topk < max(batch.context))


def shuffled_selection(batch: DSABatch, topk: int, seed: int) -> tuple[torch.Tensor, dict[int, set[int]]]:
    """Like ``random_selection`` but with the -1 entries scattered among the chosen ones."""
    indices, chosen = random_selection(batch, topk, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for t in range(indices.shape[0]):
        indices[t] = indices[t, torch.randperm(topk, generator=g)]
    return indices, chosen


@needs_triton
@pytest.mark.parametrize("num_splits, heads", [(1, 3), (2, 20), (3, 3)])   # 20 heads: blocks of 16 and of 4
@pytest.mark.parametrize("fp8, dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)],
                         ids=["fp32", "fp32_fp8_pool", "bf16_fp8_pool"])
def test_triton_sparse_attention_equals_the_twin_with_shuffled_entries_and_several_splits(num_splits, heads, fp8,
                                                                                         dtype):
    from atom_core.ops.triton import dsa_sparse

    batch = on_device(DSABatch([1, 3, 1, 2], [30, 6, 0, 11], block_size=4, heads=heads, seed=22, fp8=fp8,
                               dtype=dtype, pad_rows_to=5))
    indices, _ = shuffled_selection(batch, 9, seed=22)
    indices = indices.to(DEVICE)
    want = twin.mla_sparse_attention(*batch.args()[:5], indices, *batch.args()[5:], scale=batch.scale,
                                     kv_scale=batch.kv_scale)
    got = torch.full_like(want, SENTINEL)
    dsa_sparse.mla_sparse_attention(*batch.args()[:5], indices, *batch.args()[5:], batch.scale, batch.kv_scale, got,
                                    num_splits=num_splits)
    tol = tolerance(dtype, ATTENTION)
    torch.testing.assert_close(got.cpu(), want.cpu(), **tol)
    strict = ops.mla_sparse_attention(*batch.args()[:5], indices, *batch.args()[5:], scale=batch.scale,
                                      kv_scale=batch.kv_scale, backend="triton")
    torch.testing.assert_close(strict.cpu(), want.cpu(), **tol)


@needs_triton
def test_triton_sparse_attention_reads_only_the_selected_rows():
    batch = DSABatch([1, 2, 1], [40, 9, 25], block_size=4, seed=23)
    indices, chosen = random_selection(batch, 5, seed=23)
    want = twin.mla_sparse_attention(*batch.args()[:5], indices, *batch.args()[5:], scale=batch.scale)
    selected = {batch.tables[row][j // 4] * 4 + j % 4 for t, row, _ in batch.queries() for j in chosen[t]}
    flat = batch.cache.view(-1, batch.cache.shape[-1])
    poisoned = torch.ones(flat.shape[0], dtype=torch.bool)
    poisoned[sorted(selected)] = False
    flat[poisoned] = float("nan")                      # every row no query selected: reading one gives NaN
    on_device(batch)
    got = ops.mla_sparse_attention(*batch.args()[:5], indices.to(DEVICE), *batch.args()[5:], scale=batch.scale,
                                   backend="triton").cpu()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **FP32_TOL)
    dense = ops.mla_sparse_attention(*batch.args()[:5], indices.to(DEVICE), *batch.args()[5:], scale=batch.scale,
                                     backend="torch")   # the dense-masked twin reads the poisoned rows
    assert torch.isnan(dense).any()


@needs_triton
def test_triton_indexer_refuses_more_heads_than_its_register_tile_by_name():
    batch = DSABatch([2], [3], seed=24, index_heads=130)
    with pytest.raises(BackendUnavailable, match="Hi <= 128"):
        ops.indexer_topk(*topk_args_on_device(batch), topk=4, scale=batch.index_scale, backend="triton")


# ---- nominal calls for tests/ops/test_dispatch_cache.py (``ARGS.update(DSA_DISPATCH_ARGS)``) -------------------------

def _store_indexer_k_dispatch_args(c):
    """A ``store_indexer_k_`` call built feature by feature by test_dispatch_cache's ``Call``."""
    tokens, dtype = c.vary(3, 1), c.vary(torch.bfloat16, torch.float16, torch.float32)
    dim, block_size = c.vary(16, 512), c.vary(8, 1, 64)           # 512: past triton's one-tile fp8 quantization
    cache = c.tensor(4, block_size, dim, dtype=c.vary(dtype, torch.float8_e4m3fn))
    return (c.tensor(tokens, dim, dtype=dtype), cache, c.tensor(tokens, dtype=torch.int64),
            c.tensor(4, block_size) if cache.dtype == torch.float8_e4m3fn else None)


def _layout_dispatch_args(c, rows):
    return (c.tensor(rows, 3, dtype=torch.int32), c.tensor(rows + 1, dtype=torch.int32),
            c.tensor(rows, dtype=torch.int32))


def _indexer_topk_dispatch_args(c):
    rows, max_seqlen_q = c.vary(3, 1), c.vary(1, 4)
    dtype, heads, topk = c.vary(torch.bfloat16, torch.float16, torch.float32), c.vary(4, 64, 256), c.vary(8, 2048)
    tokens, dim = rows * max_seqlen_q, c.vary(32, 512)           # 256 heads, 512 dims: past triton's register tile
    q, weights = c.tensor(tokens, heads, dim, dtype=dtype), c.tensor(tokens, heads)
    block_size = c.vary(16, 1, 64)
    cache = c.tensor(6, block_size, dim, dtype=c.vary(dtype, torch.float8_e4m3fn))
    key_scale = c.tensor(6, block_size) if cache.dtype == torch.float8_e4m3fn else None
    return (q, weights, cache, *_layout_dispatch_args(c, rows), max_seqlen_q, c.vary(40, 8), topk, 32 ** -0.5,
            key_scale, c.tensor(tokens, topk, dtype=torch.int32))


def _mla_sparse_dispatch_args(c):
    rows, max_seqlen_q = c.vary(3, 1), c.vary(1, 4)
    dtype, heads = c.vary(torch.bfloat16, torch.float16, torch.float32), c.vary(4, 16)
    tokens = rows * max_seqlen_q
    latent, rope = c.vary(64, 2048), c.vary(16, 512)             # past triton's register tile
    q_nope, q_pe = c.tensor(tokens, heads, 32, dtype=dtype), c.tensor(tokens, heads, rope, dtype=dtype)
    cache = c.tensor(6, c.vary(16, 1, 64), latent + rope, dtype=c.vary(dtype, torch.float8_e4m3fn))
    w_uk, w_uv = c.tensor(heads, 32, latent, dtype=dtype), c.tensor(heads, 24, latent, dtype=dtype)
    topk_indices = c.tensor(tokens, c.vary(8, 2048), dtype=torch.int32)
    return (q_nope, q_pe, cache, w_uk, w_uv, topk_indices, *_layout_dispatch_args(c, rows), max_seqlen_q,
            c.vary(40, 8), 0.1, c.maybe(False, lambda: c.tensor(1)), c.tensor(tokens, heads, 24, dtype=dtype))


DSA_DISPATCH_ARGS = {
    "store_indexer_k_": _store_indexer_k_dispatch_args,
    "indexer_topk": _indexer_topk_dispatch_args,
    "mla_sparse_attention": _mla_sparse_dispatch_args,
}


# ---- the selftest's cases (atom_core.ops.selftest_cases_dsa) ---------------------------------------------------------

def test_selftest_cases_pass_on_the_twins_and_the_top_k_check_refuses_a_wrong_choice():
    from atom_core.ops.selftest_cases_dsa import dsa_cases

    cases = dsa_cases("quick", "cpu")
    assert {c.op for c in cases} == {"store_indexer_k_", "indexer_topk", "mla_sparse_attention"}
    for case in cases:
        want = case.run("torch")
        assert case.check(case.run("torch"), want) is None, f"{case.op} {case.label}"
    topk_case = next(c for c in cases if c.op == "indexer_topk")
    (want,) = topk_case.run("torch")
    lowest = want.clone()
    lowest[:, 0] = torch.where(want[:, -1] >= 0, want[:, -1], want[:, 0])  # a repeat where the row is full
    assert "keeps" in topk_case.check((lowest,), (want,))
    shifted = torch.where(want > 0, want - 1, want)  # plausible positions, wrong choice
    assert topk_case.check((shifted,), (want,)) is not None


@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(1, 4096), width=st.integers(1, 1 << 17), block_n=st.sampled_from([16, 64]),
       sms=st.integers(1, 304))
def test_indexer_chunks_are_the_largest_that_give_the_grid_enough_programs(num_tokens, width, block_n, sms):
    from atom_core.ops.triton.dsa_indexer import MAX_KEYS_PER_PROGRAM, PROGRAMS_PER_SM, keys_per_program

    keys = keys_per_program(num_tokens, width, block_n, sms)
    assert keys % block_n == 0 and block_n <= keys <= MAX_KEYS_PER_PROGRAM

    def programs(k):
        return num_tokens * -(-width // k)

    enough = PROGRAMS_PER_SM * sms
    assert programs(keys) >= enough or keys == block_n  # fills the GPU, or no smaller chunk is allowed
    assert keys == MAX_KEYS_PER_PROGRAM or programs(2 * keys) < enough  # a chunk twice as long would not


def test_topk_index_check_skips_padding_rows_and_still_refuses_a_real_rows_future_position():
    from atom_core.ops.dsa import check_topk_indices

    # Row 0: two queries at positions 3 and 4 (context 5); row 1: padding (context 0) holding three queries,
    # as a CUDA graph's padding row does; its entries are never read.
    cu, context = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([5, 0], dtype=torch.int32)
    indices = torch.tensor([[3, 0], [4, 1], [7, 9], [-1, -1], [2, 2]], dtype=torch.int32)
    check_topk_indices(indices, cu, context)
    indices[0, 0] = 4  # position 4 is after the query at 3
    with pytest.raises(ValueError, match=r"topk_indices\[0, 0\] = 4: the query at position 3"):
        check_topk_indices(indices, cu, context)
