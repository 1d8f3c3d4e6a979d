"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5) over the paged pools: ``store_indexer_k_`` (the
lightning indexer's keys into their own paged cache), ``indexer_topk`` (index scores and the top-k context
positions of each query) and ``mla_sparse_attention`` (MLA, absorbed form, over the selected positions).

The math, what is cached and what top-k selects are stated in ``atom_core.ops.reference.dsa``, the
definition of correct. Every op serves any token layout (prefill, chunked prefill on a cached prefix,
decode, multi-token decode, mixed batches: bottom-right causal like ``paged_attention``).

The signatures are what a kernel implements: the selected positions travel as an int32 ``[T, K]`` tensor
(positions in the row's sequence, -1 padded), so a sparse kernel reads K latent rows per query through
the block table instead of the whole context; results go into ``out``; ``max_seqlen_q`` / ``max_seqlen_k``
and ``topk`` are ints that size a launch; nothing is read on the host outside debug mode, so a CUDA graph
can capture them.

The indexer cache is in the model's dtype, or float8_e4m3fn with one fp32 scale a key beside it
(``indexer_scale`` [NB, BS]: written by ``store_indexer_k_``, read by ``indexer_topk``).

Backends: ``torch`` (the reference twins: dense-masked); ``triton`` (``ops/triton/mla_cache.py``: the key write;
``dsa_indexer.py``: index scores by a Triton kernel into a ``[T, max_seqlen_k]`` buffer, then an exact top-k
by radix select over many programs a row, ``topk_select.py``;
``dsa_sparse.py``: absorbed MLA reading only the K selected latent rows per query, split-K, between two torch
``bmm`` calls). No ``aiter`` backend: the AITER version the adapters follow (tests/ops/aiter_signatures.txt)
has no indexer or sparse-MLA kernel.

Legend: T = query tokens, B = rows, Hi = indexer heads, Di = indexer head dim, K = top-k, H = MLA heads,
L = kv_lora_rank, R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim, NB = pool blocks,
BS = block size, P = pages per row.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.mla import _check_attention_args as _check_mla_attention_args
from atom_core.ops.mla import _no_native_fp8, triton_absorbed_key, triton_absorbed_refusal
from atom_core.ops.reference import dsa as reference_dsa
from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.validation import (FLOAT_DTYPES, check_out, check_out_shape, check_same_device, check_shape,
                                      check_tensor, debug_enabled)
from atom_core.ops.value_checks import check_attention_layout, check_slots, contents_readable

STORE_INDEXER_K = Op("store_indexer_k_")
INDEXER_TOPK = Op("indexer_topk")
MLA_SPARSE_ATTENTION = Op("mla_sparse_attention")


def _torch_store_indexer_k(k, indexer_cache, slot_mapping, indexer_scale):
    reference_dsa.store_indexer_k_(k, indexer_cache, slot_mapping, indexer_scale)


def _torch_indexer_topk(q, weights, indexer_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                        max_seqlen_k, topk, scale, indexer_scale, out):
    out.copy_(reference_dsa.indexer_topk(q, weights, indexer_cache, block_tables, cu_seqlens_q, context_lens,
                                         max_seqlen_q, max_seqlen_k, topk=topk, scale=scale,
                                         indexer_scale=indexer_scale))


def _torch_mla_sparse(q_nope, q_pe, mla_cache, w_uk, w_uv, topk_indices, block_tables, cu_seqlens_q, context_lens,
                      max_seqlen_q, max_seqlen_k, scale, kv_scale, out):
    out.copy_(reference_dsa.mla_sparse_attention(q_nope, q_pe, mla_cache, w_uk, w_uv, topk_indices, block_tables,
                                                 cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale=scale,
                                                 kv_scale=kv_scale))


# The score kernel keeps one token's indexer queries [Hi, Di] in registers (DeepSeek-V3.2: 64 x 128).
TRITON_MAX_INDEX_HEADS = 128
TRITON_MAX_INDEX_DIM = 256


def _triton_store_supports(k, indexer_cache, slot_mapping, indexer_scale) -> str | None:
    if k.stride(-1) != 1 or indexer_cache.stride(-1) != 1:
        return "triton store_indexer_k_ needs the last dim of k and indexer_cache contiguous"
    if indexer_cache.dtype == FP8_DTYPE and indexer_cache.shape[2] > TRITON_MAX_INDEX_DIM:
        return f"triton store_indexer_k_ quantizes a key in one tile: Di <= {TRITON_MAX_INDEX_DIM} for an fp8 cache"
    if _no_native_fp8(indexer_cache):
        return "triton store_indexer_k_ writes an fp8 cache natively: needs sm89 or newer"
    return None


def _triton_store_key(k, indexer_cache, slot_mapping, indexer_scale):
    """What :func:`_triton_store_supports` reads."""
    return (k.stride()[-1] == 1, indexer_cache.stride()[-1] == 1,
            indexer_cache.dtype == FP8_DTYPE and indexer_cache.shape[2] > TRITON_MAX_INDEX_DIM,
            _no_native_fp8(indexer_cache))


def _triton_topk_supports(q, weights, indexer_cache, *rest) -> str | None:
    if q.stride(-1) != 1 or indexer_cache.stride(-1) != 1:
        return "triton indexer_topk needs the last dim of q and indexer_cache contiguous"
    if _no_native_fp8(indexer_cache):
        return "triton indexer_topk reads an fp8 cache natively: needs sm89 or newer"
    if q.shape[1] > TRITON_MAX_INDEX_HEADS or q.shape[2] > TRITON_MAX_INDEX_DIM:
        return (f"triton indexer_topk keeps a token's [Hi, Di] queries in registers: Hi <= {TRITON_MAX_INDEX_HEADS}, "
                f"Di <= {TRITON_MAX_INDEX_DIM}, got {q.shape[1]} x {q.shape[2]}")
    return None


def _triton_topk_key(q, weights, indexer_cache, *rest):
    """What :func:`_triton_topk_supports` reads."""
    return (q.stride()[-1] == 1, indexer_cache.stride()[-1] == 1, q.shape[1] > TRITON_MAX_INDEX_HEADS,
            q.shape[2] > TRITON_MAX_INDEX_DIM, _no_native_fp8(indexer_cache))


def _triton_sparse_supports(q_nope, q_pe, mla_cache, w_uk, *rest) -> str | None:
    return triton_absorbed_refusal(q_pe, mla_cache, w_uk.shape[-1])


def _triton_sparse_key(q_nope, q_pe, mla_cache, w_uk, *rest):
    return triton_absorbed_key(q_pe, mla_cache, w_uk.shape[-1])


STORE_INDEXER_K.register("torch", _torch_store_indexer_k)
STORE_INDEXER_K.register("triton", "atom_core.ops.triton.mla_cache:store_indexer_k_", _triton_store_supports,
                         _triton_store_key)
INDEXER_TOPK.register("torch", _torch_indexer_topk)
INDEXER_TOPK.register("triton", "atom_core.ops.triton.dsa_indexer:indexer_topk", _triton_topk_supports,
                      _triton_topk_key)
MLA_SPARSE_ATTENTION.register("torch", _torch_mla_sparse)
MLA_SPARSE_ATTENTION.register("triton", "atom_core.ops.triton.dsa_sparse:mla_sparse_attention",
                              _triton_sparse_supports, _triton_sparse_key)


@custom_op("store_indexer_k_", mutates_args=("indexer_cache", "indexer_scale"))
def _store_indexer_k_op(k: Tensor, indexer_cache: Tensor, slot_mapping: Tensor, indexer_scale: Optional[Tensor],
                        backend: Optional[str]) -> None:
    STORE_INDEXER_K(k, indexer_cache, slot_mapping, indexer_scale, backend=backend)


@_store_indexer_k_op.register_fake
def _(k, indexer_cache, slot_mapping, indexer_scale, backend) -> None:
    return None


@custom_op("indexer_topk", mutates_args=("out",))
def _indexer_topk_op(q: Tensor, weights: Tensor, indexer_cache: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor,
                     context_lens: Tensor, max_seqlen_q: int, max_seqlen_k: int, topk: int, scale: float,
                     indexer_scale: Optional[Tensor], out: Tensor, backend: Optional[str]) -> None:
    INDEXER_TOPK(q, weights, indexer_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                 topk, scale, indexer_scale, out, backend=backend)


@_indexer_topk_op.register_fake
def _(q, weights, indexer_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, topk, scale,
      indexer_scale, out, backend) -> None:
    return None


@custom_op("mla_sparse_attention", mutates_args=("out",))
def _mla_sparse_op(q_nope: Tensor, q_pe: Tensor, mla_cache: Tensor, w_uk: Tensor, w_uv: Tensor, topk_indices: Tensor,
                   block_tables: Tensor, cu_seqlens_q: Tensor, context_lens: Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, scale: float, kv_scale: Optional[Tensor], out: Tensor,
                   backend: Optional[str]) -> None:
    MLA_SPARSE_ATTENTION(q_nope, q_pe, mla_cache, w_uk, w_uv, topk_indices, block_tables, cu_seqlens_q, context_lens,
                         max_seqlen_q, max_seqlen_k, scale, kv_scale, out, backend=backend)


@_mla_sparse_op.register_fake
def _(q_nope, q_pe, mla_cache, w_uk, w_uv, topk_indices, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
      max_seqlen_k, scale, kv_scale, out, backend) -> None:
    return None


# ---- argument checks (debug mode only, atom_core.ops.validation) -----------------------------------------------

def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_indexer_scale(indexer_cache, indexer_scale) -> None:
    if indexer_cache.dtype == FP8_DTYPE:
        _fp8_scale(indexer_cache, indexer_scale)  # present, [NB, BS]
        check_tensor("indexer_scale", indexer_scale, ndim=2, dtypes=(torch.float32,))
        check_same_device(indexer_cache=indexer_cache, indexer_scale=indexer_scale)


def _check_store_args(k, indexer_cache, slot_mapping, indexer_scale) -> None:
    check_tensor("k", k, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("indexer_cache", indexer_cache, ndim=3, dtypes=(*FLOAT_DTYPES, FP8_DTYPE))
    check_shape("indexer_cache", indexer_cache, (None, None, k.shape[1]))
    _check_indexer_scale(indexer_cache, indexer_scale)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,))
    check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    check_same_device(k=k, indexer_cache=indexer_cache, slot_mapping=slot_mapping)
    check_slots(slot_mapping, indexer_cache.shape[0] * indexer_cache.shape[1])


def _check_layout_args(block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k) -> None:
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    num_rows = block_tables.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,))
    check_shape("cu_seqlens_q", cu_seqlens_q, (num_rows + 1,))
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,))
    check_shape("context_lens", context_lens, (num_rows,))
    _check_int("max_seqlen_q", max_seqlen_q, 0)
    _check_int("max_seqlen_k", max_seqlen_k, 0)


def _check_topk_args(q, weights, indexer_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                     topk, scale, indexer_scale, out) -> None:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    check_tensor("weights", weights, ndim=2, dtypes=(torch.float32,))
    check_shape("weights", weights, (num_tokens, num_heads))
    check_tensor("indexer_cache", indexer_cache, ndim=3, dtypes=(q.dtype, FP8_DTYPE))
    check_shape("indexer_cache", indexer_cache, (None, None, head_dim))
    _check_indexer_scale(indexer_cache, indexer_scale)
    _check_layout_args(block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k)
    _check_int("topk", topk, 1)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    check_out("out", out, (num_tokens, topk), torch.int32, q.device)
    check_same_device(q=q, weights=weights, indexer_cache=indexer_cache, block_tables=block_tables,
                      cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    check_attention_layout(num_tokens, indexer_cache.shape[0], indexer_cache.shape[1], block_tables, cu_seqlens_q,
                           context_lens, max_seqlen_q, max_seqlen_k)


def check_topk_indices(topk_indices: Tensor, cu_seqlens_q: Tensor, context_lens: Tensor) -> None:
    """Contents (debug mode): every entry is -1 or a position the query may see (0 .. p, p its position),
    and no position repeats within a query's entries. Padding rows (context 0) are not read."""
    if not contents_readable(topk_indices, cu_seqlens_q, context_lens):
        return
    indices, cu, context = topk_indices.cpu().long(), cu_seqlens_q.cpu().long(), context_lens.cpu().long()
    for row in range(context.numel()):
        if int(context[row]) == 0:  # padding: attention reads nothing and outputs zeros, whatever it selects
            continue
        first, last = int(cu[row]), int(cu[row + 1])
        position = int(context[row]) - (last - first) + torch.arange(last - first)        # p of each query
        block = indices[first:last]
        bad = (block < -1) | (block > position[:, None])
        if bad.any():
            t, j = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"topk_indices[{first + t}, {j}] = {int(block[t, j])}: the query at position "
                             f"{int(position[t])} may select -1 or a position in [0, {int(position[t])}]")
        ordered = block.sort(dim=1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if repeated.any():
            t = int(repeated.nonzero()[0, 0])
            raise ValueError(f"topk_indices[{first + t}] selects a position more than once")


def _check_sparse_args(q_nope, q_pe, mla_cache, w_uk, w_uv, topk_indices, block_tables, cu_seqlens_q, context_lens,
                       max_seqlen_q, max_seqlen_k, scale, kv_scale, out) -> None:
    _check_mla_attention_args(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens,
                              max_seqlen_q, max_seqlen_k, scale, kv_scale, out)
    check_tensor("topk_indices", topk_indices, ndim=2, dtypes=(torch.int32,))
    check_shape("topk_indices", topk_indices, (q_nope.shape[0], None))
    check_same_device(q_nope=q_nope, topk_indices=topk_indices)
    check_topk_indices(topk_indices, cu_seqlens_q, context_lens)


# ---- the public functions ----------------------------------------------------------------------------------------

def _fp8_scale(indexer_cache: Tensor, indexer_scale: Tensor | None) -> Tensor | None:
    """indexer_scale where the cache is fp8 (required there: always checked, a kernel reads it), else None."""
    if indexer_cache.dtype != FP8_DTYPE:
        return None
    if indexer_scale is None:
        raise ValueError(f"indexer_scale (fp32 [NB, BS], one scale per cached key) is required when indexer_cache "
                         f"is {FP8_DTYPE}")
    if tuple(indexer_scale.shape) != tuple(indexer_cache.shape[:2]):
        raise ValueError(f"indexer_scale must have shape {tuple(indexer_cache.shape[:2])} (the cache's [NB, BS]), "
                         f"got {tuple(indexer_scale.shape)}")
    return indexer_scale


def store_indexer_k_(k: Tensor, indexer_cache: Tensor, slot_mapping: Tensor, *, indexer_scale: Tensor | None = None,
                     backend: str | None = None) -> None:
    """Write each token's indexer key into its slot of the indexer cache, in place.

    k: [T, Di] fp32/fp16/bf16 (after ``k_norm`` and rope; may be a view with the last dim contiguous).
    indexer_cache: [NB, BS, Di], fp32/fp16/bf16 (the values are cast to it), or float8_e4m3fn: each key is
    quantized with its own scale (amax / 448), written at its slot of ``indexer_scale`` (fp32 [NB, BS],
    required then; ignored for a 16/32-bit cache). slot_mapping: int64 [T], the same slots as the step's
    latent writes; -1 writes nothing. Slots are assumed distinct and below NB * BS (checked in debug mode,
    except distinctness).
    """
    if debug_enabled():
        _check_store_args(k, indexer_cache, slot_mapping, indexer_scale)
    elif slot_mapping.shape[0] != k.shape[0]:
        # Always on: a short slot_mapping would make a kernel read slot ids past its end.
        raise ValueError(f"slot_mapping must have one slot per token ({k.shape[0]}), got {slot_mapping.shape[0]}")
    call_op("store_indexer_k_", k, indexer_cache, slot_mapping, _fp8_scale(indexer_cache, indexer_scale), backend)


def indexer_topk(q: Tensor, weights: Tensor, indexer_cache: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor,
                 context_lens: Tensor, max_seqlen_q: int, max_seqlen_k: int, *, topk: int, scale: float,
                 indexer_scale: Tensor | None = None, out: Tensor | None = None,
                 backend: str | None = None) -> Tensor:
    """The lightning indexer: each query token's ``min(topk, p + 1)`` context positions of highest score
    ``I[t, s] = sum_h weights[t, h] relu(scale q[t, h] . k[s])``.

    q: [T, Hi, Di] fp32/fp16/bf16 (first R dims rotated; a view with the last dim contiguous is fine).
    weights: fp32 [T, Hi] (``weights_proj(x) * Hi^-1/2``).
    indexer_cache: [NB, BS, Di] in q's dtype, keys written by :func:`store_indexer_k_` (this step's included),
    or float8_e4m3fn with its per-key scales ``indexer_scale`` fp32 [NB, BS] (key = cache * scale).
    block_tables: int32 [B, P]; cu_seqlens_q: int32 [B + 1]; context_lens: int32 [B] (0 = padding row).
    max_seqlen_q, max_seqlen_k: ints, bounds of the query lengths and of context_lens (launch sizes).
    topk: K, an int >= 1 (``index_topk``). scale: ``Di^-1/2``.
    out: int32 [T, K], written and returned; allocated when None.

    Query i of row r sits at position ``p = context_lens[r] - q_len + i`` and chooses among positions
    ``0 .. p`` (bottom-right causal). ``out[t]`` holds the chosen positions (in the row's sequence, not pool
    slots; order unspecified), then -1; all -1 for a padding row. Returns out.
    """
    if debug_enabled():
        _check_topk_args(q, weights, indexer_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                         max_seqlen_k, topk, scale, indexer_scale, out)
    shape = torch.Size((q.shape[0], int(topk)))
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=q.device)
    else:  # always on: a kernel writes out over these extents
        check_out_shape("out", out, shape)
    call_op("indexer_topk", q, weights, indexer_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
            max_seqlen_k, int(topk), float(scale), _fp8_scale(indexer_cache, indexer_scale), out, backend)
    return out


def mla_sparse_attention(q_nope: Tensor, q_pe: Tensor, mla_cache: Tensor, w_uk: Tensor, w_uv: Tensor,
                         topk_indices: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor, context_lens: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, *, scale: float, kv_scale: Tensor | None = None,
                         out: Tensor | None = None, backend: str | None = None) -> Tensor:
    """MLA restricted to each query's selected positions (DSA), absorbed form: ``q_lat = q_nope @ w_uk``,
    multi-query attention of ``[q_lat, q_pe]`` over the cached rows ``[c_kv, k_pe]`` at the positions in
    ``topk_indices[t]`` (values ``c_kv``), then ``@ w_uv^T``.

    Arguments as :func:`ops.mla_decode_attention` (q_nope [T, H, Dn], q_pe [T, H, R], mla_cache
    [NB, BS, L + R] in q's dtype or float8_e4m3fn with kv_scale, w_uk [H, Dn, L], w_uv [H, Dv, L], the layout
    tensors, scale), plus topk_indices: int32 [T, K] from :func:`indexer_topk` (positions in the row's
    sequence, each within the query's causal window, distinct; -1 = none). A query with no selected
    position outputs zeros. With every visible position selected this is ``mla_decode_attention``.
    out: [T, H, Dv] in q's dtype, written and returned; allocated when None.
    """
    if debug_enabled():
        _check_sparse_args(q_nope, q_pe, mla_cache, w_uk, w_uv, topk_indices, block_tables, cu_seqlens_q,
                           context_lens, max_seqlen_q, max_seqlen_k, scale, kv_scale, out)
    elif topk_indices.shape[0] != q_nope.shape[0]:  # always on: a kernel reads K entries per query token
        raise ValueError(f"topk_indices must have one row per query token ({q_nope.shape[0]}), "
                         f"got shape {tuple(topk_indices.shape)}")
    shape = (q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=q_nope.dtype, device=q_nope.device)
    else:  # always on: a kernel writes out over these extents
        check_out_shape("out", out, torch.Size(shape))
    if mla_cache.dtype != FP8_DTYPE:
        kv_scale = None
    call_op("mla_sparse_attention", q_nope, q_pe, mla_cache, w_uk, w_uv, topk_indices, block_tables, cu_seqlens_q,
            context_lens, max_seqlen_q, max_seqlen_k, float(scale), kv_scale, out, backend)
    return out
