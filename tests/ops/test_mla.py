"""MLA ops: the latent-pool write, the two attention forms (expanded = prefill, absorbed = decode) and
DeepSeek's YaRN rope (interleaved rotation, mscale in the cos/sin table, the softmax scale correction).

The twins are checked by hand (the write), against an independent per-token, per-head loop in float64
that builds every key and value from the formulas (attention), against each other over random
layouts (ragged prefill, prefix hits, decode, padding rows, block sizes 1/4/16, shuffled blocks), and
against transformers' own DeepSeek rotary code (rope). The Triton backend (strict ``backend="triton"``,
under the CPU interpreter here) is checked against the twins on the same kinds of layouts, plus fp8 and
16-bit pools, strided q views, several KV splits and long query blocks; its refusals name their reason.

Legend: T tokens, H heads, L kv_lora_rank, R qk_rope_head_dim, Dn qk_nope_head_dim, Dv v_head_dim,
NB blocks, BS block size.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_core import ops
from atom_core.cache import build_step_layout
from atom_core.ops.dispatch import BackendUnavailable, backend_available, trace_backends
from atom_core.ops.reference import mla as twin
from atom_core.ops.reference import rope as reference_rope
from atom_core.ops.reference.kv_cache import quantize_fp8
from atom_core.ops.tolerances import ATTENTION, tolerance
from tests.ops.conftest import DEVICE, needs_triton

FP8 = torch.float8_e4m3fn
SENTINEL = 1000.0
FP32_TOL = tolerance(torch.float32, ATTENTION)


class MLABatch:
    """A step's queries, kv_b_proj's split weight and a latent pool holding every row's context (NaN in slots
    no row owns, so reading one poisons the result), with its layout."""

    def __init__(self, query_lens, cached_lens, *, block_size=4, heads=3, latent=16, rope=8, nope=12, v_dim=10,
                 dtype=torch.float32, fp8=False, pad_rows_to=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        context = [q + c for q, c in zip(query_lens, cached_lens)]
        pages = [-(-n // block_size) for n in context]
        num_blocks = sum(pages) + 2
        order = torch.randperm(num_blocks, generator=g).tolist()
        tables, used = [], 0
        for n in pages:
            tables.append(order[used:used + n])
            used += n
        self.tables, self.context, self.block_size = tables, context, block_size
        self.layout = build_step_layout(query_lens, cached_lens, tables, block_size, pad_rows_to=pad_rows_to)
        slots = [t[j // block_size] * block_size + j % block_size for t, n in zip(tables, context) for j in range(n)]
        flat = torch.full((num_blocks * block_size, latent + rope), float("nan"))
        flat[slots] = torch.randn(len(slots), latent + rope, generator=g)
        self.kv_scale = None
        if fp8:
            self.kv_scale = torch.tensor([0.5])
            flat = quantize_fp8(flat.nan_to_num(0.0), self.kv_scale)
        self.cache = flat.to(FP8 if fp8 else dtype).view(num_blocks, block_size, latent + rope)
        num_tokens = self.layout.num_tokens
        self.q_nope = torch.randn(num_tokens, heads, nope, generator=g).to(dtype)
        self.q_pe = torch.randn(num_tokens, heads, rope, generator=g).to(dtype)
        w_kv_b = (torch.randn(heads * (nope + v_dim), latent, generator=g) / math.sqrt(latent)).to(dtype)
        self.w_kv_b = w_kv_b
        w = w_kv_b.view(heads, nope + v_dim, latent)
        self.w_uk, self.w_uv = w[:, :nope], w[:, nope:]   # views, as a model passes them
        self.scale = (nope + rope) ** -0.5

    def args(self):
        lay = self.layout
        return (self.q_nope, self.q_pe, self.cache, self.w_uk, self.w_uv, lay.block_tables, lay.cu_seqlens_q,
                lay.context_lens, lay.max_seqlen_q, lay.max_seqlen_k)


def naive_mla(batch: MLABatch) -> torch.Tensor:
    """Token by token and head by head in float64, every key and value built from the formulas:
    k[j, h] = [w_uk[h] @ c_kv[j], k_pe[j]], v[j, h] = w_uv[h] @ c_kv[j]; keys j <= position."""
    latent = batch.w_uk.shape[-1]
    heads, v_dim = batch.w_uv.shape[:2]
    out = torch.zeros(batch.q_nope.shape[0], heads, v_dim, dtype=torch.float64)
    scale = 1.0 if batch.kv_scale is None else float(batch.kv_scale)
    starts = batch.layout.cu_seqlens_q.tolist()
    for row, (table, context_len) in enumerate(zip(batch.tables, batch.context)):
        q_len = starts[row + 1] - starts[row]
        for i in range(q_len):
            t, pos = starts[row] + i, context_len - q_len + i
            cached = [batch.cache[table[j // batch.block_size], j % batch.block_size].double() * scale
                      for j in range(pos + 1)]
            for h in range(heads):
                q = torch.cat([batch.q_nope[t, h], batch.q_pe[t, h]]).double()
                keys = [torch.cat([batch.w_uk[h].double() @ c[:latent], c[latent:]]) for c in cached]
                values = [batch.w_uv[h].double() @ c[:latent] for c in cached]
                logits = torch.stack([batch.scale * (q @ k) for k in keys])
                weights = torch.softmax(logits, dim=0)
                out[t, h] = sum(w * v for w, v in zip(weights, values))
    return out


# ---- the write ----------------------------------------------------------------------------------------------------

def test_store_mla_writes_latent_then_rope_key_at_each_slot_and_skips_minus_one():
    # BS = 4: slot 5 is block 1, offset 1; slot 2 is block 0, offset 2; -1 writes nothing.
    kv_c = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])   # [T=3, L=3]
    k_pe = torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]])            # [T=3, R=2]
    cache = torch.full((2, 4, 5), SENTINEL)
    ops.store_mla_(kv_c, k_pe, cache, torch.tensor([5, -1, 2]))
    want = torch.full((2, 4, 5), SENTINEL)
    want[1, 1] = torch.tensor([1.0, 2.0, 3.0, -1.0, -2.0])
    want[0, 2] = torch.tensor([7.0, 8.0, 9.0, -5.0, -6.0])
    assert torch.equal(cache, want)


def test_store_mla_into_an_fp8_pool_holds_row_over_scale_rounded_to_e4m3():
    g = torch.Generator().manual_seed(0)
    kv_c, k_pe = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
    cache = torch.zeros(2, 2, 8, dtype=FP8)
    scale = torch.tensor([0.25])
    ops.store_mla_(kv_c, k_pe, cache, torch.tensor([3, 0, -1, 1]), kv_scale=scale)
    rows = torch.cat([kv_c, k_pe], dim=-1)
    assert torch.equal(cache.view(4, 8)[[3, 0, 1]].float(), quantize_fp8(rows[[0, 1, 3]], scale).float())
    assert torch.equal(cache.view(4, 8)[2].float(), torch.zeros(8))


def test_store_mla_refuses_a_slot_mapping_shorter_than_the_tokens():
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.store_mla_(torch.zeros(3, 4), torch.zeros(3, 2), torch.zeros(2, 2, 6), torch.tensor([0, 1]))


# ---- attention ----------------------------------------------------------------------------------------------------

LAYOUTS = {
    "ragged_prefill": ([1, 7, 5], [0, 0, 0]),
    "chunk_after_prefix": ([3, 6], [5, 9]),
    "decode": ([1, 1, 1, 1], [0, 4, 11, 16]),
    "multi_token_decode": ([3, 2], [7, 1]),
}


@pytest.mark.parametrize("form", ["prefill", "decode"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_form_equals_a_float64_per_head_loop_over_keys_built_from_the_formulas(form, layout):
    query_lens, cached_lens = LAYOUTS[layout]
    batch = MLABatch(query_lens, cached_lens, block_size=4, seed=1)
    fn = twin.mla_prefill_attention if form == "prefill" else twin.mla_decode_attention
    got = fn(*batch.args(), scale=batch.scale)
    torch.testing.assert_close(got.double(), naive_mla(batch), **FP32_TOL)


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 20)), min_size=1, max_size=4),
       block_size=st.sampled_from([1, 4, 16]), pad_rows=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_absorbed_decode_form_equals_expanded_prefill_form_on_any_layout(rows, block_size, pad_rows, seed):
    query_lens, cached_lens = zip(*rows)
    batch = MLABatch(list(query_lens), list(cached_lens), block_size=block_size, seed=seed,
                     pad_rows_to=len(rows) + pad_rows)
    expanded = ops.mla_prefill_attention(*batch.args(), scale=batch.scale, backend="torch")
    absorbed = ops.mla_decode_attention(*batch.args(), scale=batch.scale, backend="torch")
    assert torch.isfinite(expanded).all()  # no NaN slot was read
    torch.testing.assert_close(absorbed, expanded, **FP32_TOL)
    num_real = sum(query_lens)
    assert torch.equal(expanded[num_real:], torch.zeros_like(expanded[num_real:]))  # padding rows: zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forms_agree_in_16_bit_within_the_attention_tolerance(dtype):
    batch = MLABatch([1, 6, 1], [9, 3, 0], block_size=4, seed=3, dtype=dtype)
    expanded = ops.mla_prefill_attention(*batch.args(), scale=batch.scale, backend="torch")
    absorbed = ops.mla_decode_attention(*batch.args(), scale=batch.scale, backend="torch")
    assert expanded.dtype == absorbed.dtype == dtype
    torch.testing.assert_close(absorbed, expanded, **tolerance(dtype, ATTENTION))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("form", ["prefill", "decode"])
def test_fp8_pool_attends_over_row_times_kv_scale(form, backend):
    fp8 = MLABatch([2, 1], [5, 8], block_size=4, seed=4, fp8=True)
    dequantised = MLABatch([2, 1], [5, 8], block_size=4, seed=4)
    dequantised.cache = fp8.cache.float() * fp8.kv_scale
    if backend == "triton":  # the interpreter's CPU, or the GPU
        fp8 = on_device(fp8)
    fn = ops.mla_prefill_attention if form == "prefill" else ops.mla_decode_attention
    got = fn(*fp8.args(), scale=fp8.scale, kv_scale=fp8.kv_scale, backend=backend).cpu()
    want = fn(*dequantised.args(), scale=dequantised.scale, backend="torch")
    torch.testing.assert_close(got, want, **FP32_TOL)
    unscaled = fn(*fp8.args(), scale=fp8.scale, kv_scale=torch.ones_like(fp8.kv_scale), backend=backend).cpu()
    assert not torch.allclose(unscaled, want, atol=1e-2)


def test_public_ops_write_out_and_auto_serves_triton_wherever_it_runs():
    batch = on_device(MLABatch([2, 1], [3, 6], seed=5))   # auto picks triton for tensors it can serve
    out = torch.full((3, 3, 10), SENTINEL, device=DEVICE)
    with trace_backends() as calls:
        result = ops.mla_decode_attention(*batch.args(), scale=batch.scale, out=out)
        ops.mla_prefill_attention(*batch.args(), scale=batch.scale)
    assert result is out and not (out == SENTINEL).any()
    auto = "triton" if backend_available("triton") else "torch"   # no selftest record here: triton is not vetoed
    assert calls == [("mla_decode_attention", auto), ("mla_prefill_attention", auto)]
    with pytest.raises(BackendUnavailable, match="no aiter implementation|not available"):
        ops.mla_decode_attention(*batch.args(), scale=batch.scale, backend="aiter")
    with pytest.raises(ValueError, match="out must have shape"):
        ops.mla_prefill_attention(*batch.args(), scale=batch.scale, out=torch.empty(3, 3, 12))


def test_custom_ops_are_registered_under_torch_ops_atom_core():
    batch = MLABatch([2], [3], seed=6)
    lay = batch.layout
    out = torch.empty(2, 3, 10)
    torch.ops.atom_core.mla_decode_attention(batch.q_nope, batch.q_pe, batch.cache, batch.w_uk, batch.w_uv,
                                             lay.block_tables, lay.cu_seqlens_q, lay.context_lens, lay.max_seqlen_q,
                                             lay.max_seqlen_k, batch.scale, None, out, None)
    torch.testing.assert_close(out, twin.mla_prefill_attention(*batch.args(), scale=batch.scale), **FP32_TOL)
    assert hasattr(torch.ops.atom_core, "store_mla_") and hasattr(torch.ops.atom_core, "mla_prefill_attention")


def test_debug_checks_name_a_w_uk_of_the_wrong_head_count():
    batch = MLABatch([2], [3], seed=7)
    args = list(batch.args())
    args[3] = batch.w_uk[:2]
    with ops.debug_checks(), pytest.raises(ValueError, match="w_uk must have shape"):
        ops.mla_decode_attention(*args, scale=batch.scale)


def test_debug_checks_require_kv_scale_for_an_fp8_pool():
    batch = MLABatch([1], [4], seed=8, fp8=True)
    with ops.debug_checks(), pytest.raises(ValueError, match="kv_scale is required"):
        ops.mla_prefill_attention(*batch.args(), scale=batch.scale)


# ---- the Triton backend (strict: a fallback cannot pass) ----------------------------------------------------------

def on_device(batch: MLABatch) -> MLABatch:
    """The batch's tensors moved to the test device (the interpreter's CPU, or the GPU)."""
    for name in ("cache", "q_nope", "q_pe", "w_kv_b", "w_uk", "w_uv", "kv_scale"):
        value = getattr(batch, name)
        if value is not None:
            setattr(batch, name, value.to(DEVICE))
    batch.layout = batch.layout.to(DEVICE)
    return batch


def twin_of(form: str, batch: MLABatch) -> torch.Tensor:
    fn = twin.mla_prefill_attention if form == "prefill" else twin.mla_decode_attention
    return fn(*batch.args(), scale=batch.scale, kv_scale=batch.kv_scale)


@needs_triton
@pytest.mark.parametrize("tokens, latent, rope", [(7, 16, 8), (70, 64, 16)])   # 70 rows of 80: several programs
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_store_mla_writes_the_twins_pool_from_views_of_one_projection(fp8, tokens, latent, rope):
    g = torch.Generator().manual_seed(9)
    kv_a = torch.randn(tokens, latent + rope, generator=g).to(DEVICE)   # [T, L + R]: kv_c and k_pe are views
    slots = torch.randperm(4 * (tokens + 3), generator=g)[:tokens].to(DEVICE)
    slots[1::5] = -1                                                    # padding tokens write nothing
    pools = [torch.full((tokens + 3, 4, latent + rope), SENTINEL, device=DEVICE).to(FP8 if fp8 else torch.float32)
             for _ in range(2)]
    scale = torch.tensor([0.25], device=DEVICE) if fp8 else None
    def bits(pool):  # compared as bytes: the sentinel is out of e4m3's range (NaN on a GPU, where NaN != NaN)
        return pool.view(torch.uint8) if fp8 else pool

    before = bits(pools[0]).clone()
    ops.store_mla_(kv_a[:, :latent], kv_a[:, latent:], pools[0], slots, kv_scale=scale, backend="triton")
    twin.store_mla_(kv_a[:, :latent], kv_a[:, latent:], pools[1], slots, scale)
    assert torch.equal(bits(pools[0]), bits(pools[1]))                # fp8: the same e4m3 rounding, bit for bit
    written = (bits(pools[0]) != before).any(dim=-1).flatten()
    assert int(written.sum()) == int((slots >= 0).sum())             # every real token's row, nothing else


@needs_triton
@settings(max_examples=12, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 40)), min_size=1, max_size=4),
       block_size=st.sampled_from([1, 4, 6, 16]), pad_rows=st.integers(0, 2), num_splits=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_triton_forms_equal_the_twin_on_any_layout(rows, block_size, pad_rows, num_splits, seed):
    from atom_core.ops.triton import mla_decode

    query_lens, cached_lens = zip(*rows)
    batch = on_device(MLABatch(list(query_lens), list(cached_lens), block_size=block_size, seed=seed,
                               pad_rows_to=len(rows) + pad_rows))
    want = twin_of("prefill", batch)
    expanded = ops.mla_prefill_attention(*batch.args(), scale=batch.scale, backend="triton")
    absorbed = ops.mla_decode_attention(*batch.args(), scale=batch.scale, backend="triton")
    split = torch.full_like(absorbed, SENTINEL)
    mla_decode.mla_decode_attention(*batch.args(), batch.scale, None, split, num_splits=num_splits)
    for got in (expanded, absorbed, split):
        assert torch.isfinite(got).all()  # no NaN slot was read
        torch.testing.assert_close(got.cpu(), want.cpu(), **FP32_TOL)
    num_real = sum(query_lens)
    assert torch.equal(split[num_real:].cpu(), torch.zeros_like(split[num_real:].cpu()))  # padding rows: zeros


def strided_layout(args: tuple) -> tuple:
    """``MLABatch.args()`` with the same layout values in strided views: column-major block tables, and
    cu_seqlens_q and context_lens every other element of a wider buffer."""
    *head, block_tables, cu_seqlens_q, context_lens, max_q, max_k = args
    every_other = [torch.stack([t, torch.zeros_like(t)], dim=1)[:, 0] for t in (cu_seqlens_q, context_lens)]
    return (*head, block_tables.t().contiguous().t(), *every_other, max_q, max_k)


@needs_triton
@pytest.mark.parametrize("layout", ["chunk_after_prefix", "decode"])
def test_triton_forms_on_strided_layout_tensors_equal_the_twin(layout):
    batch = on_device(MLABatch(*LAYOUTS[layout], seed=5))
    want = twin_of("prefill", batch)
    for op in (ops.mla_prefill_attention, ops.mla_decode_attention):
        got = op(*strided_layout(batch.args()), scale=batch.scale, backend="triton")
        torch.testing.assert_close(got.cpu(), want.cpu(), **FP32_TOL)


@needs_triton
@pytest.mark.parametrize("num_splits, heads", [(2, 3), (3, 20), (7, 3)])   # 20 heads: blocks of 16 and of 4
def test_triton_decode_with_several_splits_equals_the_twin_including_empty_splits(num_splits, heads):
    from atom_core.ops.triton import mla_decode

    # Contexts of 1 to 70 keys in 16-key tiles: a split holds several tiles, none, or the row's last partial one.
    batch = on_device(MLABatch([1, 1, 2, 1], [69, 0, 37, 16], block_size=4, heads=heads, seed=10, pad_rows_to=5))
    out = torch.full((6, heads, 10), SENTINEL, device=DEVICE)
    mla_decode.mla_decode_attention(*batch.args(), batch.scale, None, out, num_splits=num_splits)
    torch.testing.assert_close(out.cpu(), twin_of("decode", batch).cpu(), **FP32_TOL)


@needs_triton
@pytest.mark.parametrize("magnitude", [2.0 ** -30, 1.0, 2.0 ** 17])
def test_triton_bf16_queries_over_an_fp8_pool_equal_the_twin_at_any_magnitude(magnitude):
    # q times a power of two, the softmax scale over it: the same logits, whatever range the kernel's dots take.
    batch = MLABatch([1, 1, 3], [30, 0, 9], block_size=4, heads=20, seed=13, dtype=torch.bfloat16, fp8=True,
                     pad_rows_to=4)
    batch.q_nope, batch.q_pe = batch.q_nope * magnitude, batch.q_pe * magnitude
    batch = on_device(batch)
    scale = batch.scale / magnitude
    got = ops.mla_decode_attention(*batch.args(), scale=scale, kv_scale=batch.kv_scale, backend="triton")
    want = twin.mla_decode_attention(*batch.args(), scale=scale, kv_scale=batch.kv_scale)
    torch.testing.assert_close(got.cpu(), want.cpu(), **tolerance(torch.bfloat16, ATTENTION))


@needs_triton
def test_triton_absorbed_form_serves_long_queries_in_query_blocks():
    from atom_core.ops.triton import mla_decode

    batch = on_device(MLABatch([40, 3, 17], [0, 30, 5], block_size=4, seed=11, pad_rows_to=4))
    constexprs, _ = mla_decode._launch_params(3, 16, 8, 4, batch.layout.max_seqlen_q, torch.float32, True, None,
                                              None)
    assert not constexprs["ROW_PER_BLOCK"]  # the blocks numbered from T and B, not one per row
    got = ops.mla_decode_attention(*batch.args(), scale=batch.scale, backend="triton")
    torch.testing.assert_close(got.cpu(), twin_of("decode", batch).cpu(), **FP32_TOL)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["prefill", "decode"])
def test_triton_16_bit_forms_on_strided_q_views_equal_the_twin_within_the_attention_tolerance(form, dtype):
    batch = on_device(MLABatch([1, 6, 1, 3], [9, 3, 0, 20], block_size=16, seed=12, dtype=dtype))
    q = torch.cat([batch.q_nope, batch.q_pe], dim=-1)                  # [T, H, Dn + R], as the q projection gives
    batch.q_nope, batch.q_pe = q[..., :12], q[..., 12:]
    fn = ops.mla_prefill_attention if form == "prefill" else ops.mla_decode_attention
    got = fn(*batch.args(), scale=batch.scale, backend="triton")
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu(), twin_of(form, batch).cpu(), **tolerance(dtype, ATTENTION))


@needs_triton
def test_triton_refuses_by_name_with_the_reason_and_auto_falls_back_to_the_twin():
    batch = on_device(MLABatch([2, 1], [3, 6], seed=13))
    wide = torch.zeros(*batch.q_pe.shape[:2], 2 * batch.q_pe.shape[2], device=DEVICE)
    wide[..., ::2] = batch.q_pe
    batch.q_pe = wide[..., ::2]                                        # the rope dims strided
    with pytest.raises(BackendUnavailable, match="last dim of q_pe"):
        ops.mla_decode_attention(*batch.args(), scale=batch.scale, backend="triton")
    with trace_backends() as calls:
        got = ops.mla_decode_attention(*batch.args(), scale=batch.scale)
    assert calls == [("mla_decode_attention", "torch")]
    torch.testing.assert_close(got, twin_of("decode", batch), **FP32_TOL)
    big = on_device(MLABatch([1], [2], seed=14, nope=240, rope=24, v_dim=8))   # max(Dn + R, Dv) = 264
    with pytest.raises(BackendUnavailable, match="264 > 256"):
        ops.mla_prefill_attention(*big.args(), scale=big.scale, backend="triton")


# ---- the AITER adapters, against the stand-in module (AITER's signatures; behaviour as AITER documents it) ----------

def _concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    assert kv_cache_dtype in ("auto", "fp8") and scale.numel() == 1
    twin.store_mla_(kv_c, k_pe, kv_cache, slot_mapping, scale if kv_cache_dtype == "fp8" else None)


def _mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, sm_scale,
                    logit_cap, num_kv_splits, num_kv_splits_indptr, work_meta_data, work_indptr, work_info_set,
                    reduce_indptr, reduce_final_map, reduce_partial_map, q_scale, kv_scale):
    # Pages of one token: row r's keys are kv_buffer[kv_indices[kv_indptr[r]:kv_indptr[r + 1]], 0, 0]; values are
    # their first o.shape[-1] columns (the latent); one query token per row here. No key: undefined (NaN).
    assert kv_buffer.shape[1:3] == (1, 1) and (kv_last_page_lens == 1).all() and max_seqlen_q == 1
    o.fill_(float("nan"))
    starts, ends = kv_indptr[:-1].tolist(), kv_indptr[1:].tolist()
    for r, (first, last) in enumerate(zip(starts, ends)):
        if last == first:
            continue
        rows = kv_buffer[kv_indices[first:last].long(), 0, 0].float()                          # [S, L + R]
        t = slice(int(qo_indptr[r]), int(qo_indptr[r + 1]))
        weights = torch.softmax(sm_scale * torch.einsum("thd,sd->ths", q[t].float(), rows), dim=-1)
        o[t] = torch.einsum("ths,sl->thl", weights, rows[:, :o.shape[-1]]).to(o.dtype)


@pytest.fixture
def aiter_mla(monkeypatch):
    from tests.ops import fake_aiter
    from tests.ops.test_attention import _fa_varlen

    fake = fake_aiter.install(monkeypatch, {"concat_and_cache_mla": _concat_and_cache_mla,
                                            "mla_decode_fwd": _mla_decode_fwd, "flash_attn_varlen_func": _fa_varlen})
    import importlib

    from atom_core.ops import kv_cache as kv_cache_op
    monkeypatch.setattr(kv_cache_op, "_aiter_fp8_is_e4m3fn", lambda device: True)
    return fake, importlib.import_module("atom_core.ops.aiter.mla")  # imported against the stand-in


def test_aiter_store_mla_passes_auto_with_a_unit_scale_or_fp8_with_kv_scale(aiter_mla):
    fake, adapter = aiter_mla
    kv_a = torch.randn(5, 40, generator=torch.Generator().manual_seed(30)).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 9, 0, 14])
    for cache_dtype, scale in ((torch.bfloat16, None), (FP8, torch.tensor([0.5]))):
        cache, want = torch.zeros(4, 4, 40, dtype=cache_dtype), torch.zeros(4, 4, 40, dtype=cache_dtype)
        assert adapter.store_supports(kv_a[:, :32], kv_a[:, 32:], cache, slots, scale) is None
        adapter.store_mla_(kv_a[:, :32], kv_a[:, 32:], cache, slots, scale)
        twin.store_mla_(kv_a[:, :32], kv_a[:, 32:], want, slots, scale)
        assert torch.equal(cache.float(), want.float())
        name, call = fake.calls[-1]
        assert name == "concat_and_cache_mla" and call["kv_cache_dtype"] == ("fp8" if scale is not None else "auto")
        assert float(call["scale"]) == (0.5 if scale is not None else 1.0)
    assert "fp16/bf16" in adapter.store_supports(kv_a.float()[:, :32], kv_a.float()[:, 32:], torch.zeros(4, 4, 40),
                                                 slots, None)


def test_aiter_decode_scatters_each_rows_slots_at_kv_indptr_and_zeroes_empty_rows(aiter_mla):
    fake, adapter = aiter_mla
    batch = MLABatch([1, 1, 1], [6, 0, 19], block_size=4, heads=16, latent=512, rope=64, nope=16, v_dim=8,
                     dtype=torch.bfloat16, seed=31, pad_rows_to=4)
    batch.cache = batch.cache.nan_to_num(0.0)   # unowned slots hold zeros here: the fake reads what it is told
    out = torch.empty(4, 16, 8, dtype=torch.bfloat16)
    args = (*batch.args(), batch.scale, None, out)
    assert adapter.decode_supports(*args) is None
    adapter.mla_decode_attention(*args)
    torch.testing.assert_close(out, twin_of("decode", batch), **tolerance(torch.bfloat16, ATTENTION))
    name, call = fake.calls[-1]
    assert name == "mla_decode_fwd" and call["sm_scale"] == batch.scale and call["kv_buffer"].shape[1:] == (1, 1, 576)
    assert call["kv_indptr"].tolist() == [0, 7, 8, 28, 28]                  # prefix sums of context_lens
    table = batch.layout.block_tables
    assert call["kv_indices"][7:8].tolist() == [int(table[1, 0]) * 4]      # row 1's single slot
    multi = MLABatch([2, 1], [3, 4], heads=16, latent=512, rope=64, dtype=torch.bfloat16, seed=32)
    assert "one query token per row" in adapter.decode_supports(*multi.args(), 1.0, None, None)
    small = MLABatch([1], [3], dtype=torch.bfloat16, seed=33)
    assert "L = 512" in adapter.decode_supports(*small.args(), 1.0, None, None)


def test_aiter_prefill_runs_the_expanded_attention_through_flash_attn_varlen(aiter_mla):
    fake, adapter = aiter_mla
    batch = MLABatch([3, 5], [4, 0], block_size=4, heads=2, nope=8, rope=8, v_dim=10, dtype=torch.bfloat16, seed=34)
    out = torch.empty(8, 2, 10, dtype=torch.bfloat16)
    args = (*batch.args(), batch.scale, None, out)
    assert adapter.prefill_supports(*args) is None
    adapter.mla_prefill_attention(*args)
    torch.testing.assert_close(out, twin_of("prefill", batch), **tolerance(torch.bfloat16, ATTENTION))
    name, call = fake.calls[-1]
    assert name == "flash_attn_varlen_func" and call["causal"] and call["q"].shape[-1] == 16   # max(8 + 8, 10)
    decode = MLABatch([1, 1], [4, 0], heads=2, nope=8, rope=8, v_dim=10, dtype=torch.bfloat16, seed=35)
    assert "head dim 16" in adapter.prefill_supports(*decode.args(), 1.0, None, None)


# ---- DeepSeek's YaRN rope -------------------------------------------------------------------------------------------

V3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
V2_LITE_YARN = {**V3_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}
UNEQUAL_MSCALES = {**V3_YARN, "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                   "mscale_all_dim": 0.8}


@pytest.mark.parametrize("scaling", [None, V3_YARN, V2_LITE_YARN, UNEQUAL_MSCALES,
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}],
                         ids=["default", "v3", "v2_lite", "unequal_mscales", "yarn_without_mscale_all_dim"])
def test_softmax_scale_equals_transformers_yarn_apply_mscale(scaling):
    hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    rope_parameters = {"rope_type": "default"} if scaling is None else scaling
    assert ops.yarn_softmax_scale(192, scaling) == pytest.approx(hf.yarn_apply_mscale(rope_parameters, 192 ** -0.5),
                                                                 rel=1e-12)


def test_softmax_scale_by_hand_for_deepseek_v3():
    # factor 40, mscale_all_dim 1: m = 0.1 ln 40 + 1 = 1.36889; scale = m^2 / sqrt(192)
    m = 0.1 * math.log(40) + 1
    assert ops.yarn_softmax_scale(192, V3_YARN) == pytest.approx(m * m / math.sqrt(192), rel=1e-12)
    assert ops.yarn_softmax_scale(192, None) == pytest.approx(192 ** -0.5, rel=1e-12)


def _hf_deepseek_v3_cos_sin(rope_dim: int, scaling: dict, positions: torch.Tensor):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    config = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=rope_dim,
                                           max_position_embeddings=128,
                                           rope_parameters={**scaling, "rope_theta": 10000.0})
    cos, sin = DeepseekV3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]                                                   # [T, R] each: cat(freqs, freqs)


def test_cos_sin_table_of_deepseek_yarn_equals_transformers_including_the_mscale_ratio():
    positions = torch.arange(0, 128, 7)
    cos, sin = _hf_deepseek_v3_cos_sin(8, UNEQUAL_MSCALES, positions)
    table, attention_scale = ops.rope_cos_sin_cache(8, 128, 10000.0, UNEQUAL_MSCALES)
    assert attention_scale == pytest.approx((0.1 * math.log(4) + 1) / (0.08 * math.log(4) + 1))
    ours_cos, ours_sin = table[positions].chunk(2, dim=-1)
    torch.testing.assert_close(ours_cos, cos[:, :4], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_sin, sin[:, :4], atol=1e-6, rtol=1e-6)


def test_interleaved_rope_gives_transformers_v3_q_dot_k_and_v2_rotation_exactly():
    """HF DeepSeek-V2 rotates interleaved pairs (complex multiply) and writes them back interleaved, as
    ``apply_rope_(is_neox=False)`` does; HF V3 (``rope_interleave``) rotates the same pairs but writes the
    evens then the odds. Both layouts give the same q . k, which is all attention reads."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 3, 17, 100])
    q, k = torch.randn(4, 2, 8, generator=g), torch.randn(4, 1, 8, generator=g)  # [T, H, R], [T, 1, R]
    table, _ = ops.rope_cos_sin_cache(8, 128, 10000.0, UNEQUAL_MSCALES)
    q_ours, k_ours = q.clone(), k.clone()
    ops.apply_rope_(q_ours, k_ours, positions, table, is_neox=False)

    cos, sin = _hf_deepseek_v3_cos_sin(8, UNEQUAL_MSCALES, positions)
    q_v3, k_v3 = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 cos[None], sin[None])          # [1, H, T, R]
    q_v3, k_v3 = q_v3[0].transpose(0, 1), k_v3[0].transpose(0, 1)               # [T, H, R]
    deinterleave = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
    torch.testing.assert_close(q_ours[..., deinterleave], q_v3, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.einsum("thr,tkr->th", q_ours, k_ours),
                               torch.einsum("thr,tkr->th", q_v3, k_v3), atol=1e-5, rtol=1e-5)

    half = table[positions, :4]                     # cos * a; the V2 frequencies as a complex rotation
    freqs_cis = torch.polar(torch.ones_like(half), torch.atan2(table[positions, 4:], half)) * half.hypot(
        table[positions, 4:])
    q_v2, k_v2 = apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis[None])
    torch.testing.assert_close(q_ours, q_v2[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_ours, k_v2[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_reference_yarn_softmax_scale_is_one_over_sqrt_dim_for_plain_rope():
    assert reference_rope.yarn_softmax_scale(64, {"rope_type": "linear", "factor": 2.0}) == 64 ** -0.5


# ---- nominal calls for tests/ops/test_dispatch_cache.py (``ARGS.update(MLA_DISPATCH_ARGS)``) -------------------------

def _store_mla_dispatch_args(c):
    """A ``store_mla_`` call built feature by feature by test_dispatch_cache's ``Call``."""
    tokens, dtype = c.vary(3, 1), c.vary(torch.bfloat16, torch.float16, torch.float32)
    kv_c, k_pe = c.tensor(tokens, 16, dtype=dtype), c.tensor(tokens, 8, dtype=dtype)
    cache = c.tensor(4, c.vary(8, 1), 24, dtype=c.vary(dtype, FP8))
    return kv_c, k_pe, cache, c.tensor(tokens, dtype=torch.int64), c.maybe(False, lambda: c.tensor(1))


def _mla_attention_dispatch_args(c, max_seqlen_q: int):
    """An ``mla_prefill_attention`` / ``mla_decode_attention`` call (same signature). Nominal: DeepSeek's
    L = 512, R = 64 and 16 heads in bf16 (AITER's decode kernels), decode (max_seqlen_q = 1) or a short
    prefill (4); the variations reach every rule (head counts, register limits, expanded head dims > 256)."""
    rows, max_seqlen_q = c.vary(3, 1), c.vary(max_seqlen_q, 4 if max_seqlen_q == 1 else 1)
    dtype, heads = c.vary(torch.bfloat16, torch.float16, torch.float32), c.vary(16, 4, 128)
    latent, rope, v_dim = c.vary(512, 64, 2048), c.vary(64, 16, 512), c.vary(24, 300)
    tokens = rows * max_seqlen_q + c.vary(0, 1)                  # + 1: a decode batch with one row of two tokens
    q_nope, q_pe = c.tensor(tokens, heads, 32, dtype=dtype), c.tensor(tokens, heads, rope, dtype=dtype)
    cache = c.tensor(6, c.vary(16, 1, 64), latent + rope, dtype=c.vary(dtype, FP8))
    w_uk, w_uv = c.tensor(heads, 32, latent, dtype=dtype), c.tensor(heads, v_dim, latent, dtype=dtype)
    block_tables, cu_seqlens_q = c.tensor(rows, 3, dtype=torch.int32), c.tensor(rows + 1, dtype=torch.int32)
    context_lens = c.tensor(rows, dtype=torch.int32)
    return (q_nope, q_pe, cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, c.vary(40, 8),
            0.1, c.maybe(False, lambda: c.tensor(1)), c.tensor(tokens, heads, v_dim, dtype=dtype))


MLA_DISPATCH_ARGS = {
    "store_mla_": _store_mla_dispatch_args,
    "mla_prefill_attention": lambda c: _mla_attention_dispatch_args(c, 4),
    "mla_decode_attention": lambda c: _mla_attention_dispatch_args(c, 1),
}


@needs_triton
@pytest.mark.parametrize("block_h, block_n, num_warps", [(64, 64, 8), (64, 32, 8), (32, 16, 4), (16, 32, 4)])
def test_triton_decode_tile_configs_all_equal_the_twin_at_128_heads(block_h, block_n, num_warps):
    # The tile shapes the H200 sweep times (benchmarks/ops_mla.py --sweep), the defaults among them (64 x 64
    # on sm90, 64 x 32 elsewhere), on DeepSeek-V3's head count with small latent widths: head blocks, masks
    # and splits by config; 150 keys make two full 64-row tiles and an edge one.
    from atom_core.ops.triton import mla_decode
    from benchmarks.ops_mla import make_problem

    s = {"heads": 128, "latent": 32, "rope": 16, "nope": 16, "v_dim": 16, "block_size": 4, "dtype": torch.float32}
    p = make_problem(3, 150, s, DEVICE)
    want = ops.mla_decode_attention(p.q_nope, p.q_pe, p.mla_cache, p.w_uk, p.w_uv, *p.layout(), scale=p.scale,
                                    backend="torch")
    got = torch.empty_like(want)
    mla_decode.mla_decode_attention(p.q_nope, p.q_pe, p.mla_cache, p.w_uk, p.w_uv, *p.layout(), p.scale, None, got,
                                    config=mla_decode.MLAConfig(block_h, block_n, num_warps, 2))
    torch.testing.assert_close(got, want, **tolerance(torch.float32, ATTENTION))


@given(rows=st.integers(1, 300), head_blocks=st.integers(1, 8), context=st.integers(0, 70000),
       sms=st.sampled_from([78, 108, 132, 304]))
@settings(max_examples=200, deadline=None)
def test_decode_splits_of_full_sm_tiles_fill_one_wave_at_most(rows, head_blocks, context, sms):
    # A 64-row q tile holds a whole SM (one program resident): its splits must keep every program of the
    # batch in one wave, or one split when even that is too many; a split always gets its share of keys.
    from atom_core.ops.triton import attention_decode, mla_decode

    with mock.patch.object(mla_decode, "num_sms", lambda index: sms):
        splits = mla_decode.choose_splits(rows, head_blocks, 64, context, torch.device("cuda", 0))
    programs = rows * head_blocks
    assert 1 <= splits <= attention_decode.MAX_SPLITS
    assert splits == 1 or programs * splits <= sms
    assert splits == 1 or (splits - 1) * attention_decode.MIN_KEYS_PER_SPLIT < context
    if programs * 2 <= sms and context >= 2 * attention_decode.MIN_KEYS_PER_SPLIT:
        assert splits >= 2  # room for a second wave's worth of splits is used
