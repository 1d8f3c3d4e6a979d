"""AITER adapters for the MLA ops (signatures in aiter/ops/cache.py, aiter/mla.py, aiter/ops/mha.py).

* ``store_mla_``: ``concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)``, the
  same ``[NB, BS, L + R]`` pool with kv_c in the first L columns; "auto" copies in the input dtype (a unit
  scale is passed, it is read through a raw pointer), "fp8" stores ``x / scale``.
* ``mla_decode_attention``: ``aiter.mla.mla_decode_fwd``, AITER's absorbed MLA decode (asm), on
  ``q = [q_nope @ w_uk, q_pe]`` [T, H, L + R] with output ``o_lat`` [T, H, L], then ``@ w_uv^T`` (torch bmm,
  as on the Triton path). It reads the pool as pages of one token (``kv_buffer [NB BS, 1, 1, L + R]``,
  ``kv_last_page_lens`` = 1): each row's slots are scattered into ``kv_indices`` at ``kv_indptr[r]`` on the
  device (a fixed-size buffer, CUDA-graph safe). Served only where AITER's kernels are known to exist:
  bf16, 16-bit pool, DeepSeek's L = 512 and R = 64, 16 or 128 heads, one query token per row.
* ``mla_prefill_attention``: the Triton path's expansion (``triton.mla_prefill.expand_pages``: per-head
  K/V of every page of the table, by GEMMs) and then the AITER paged-attention adapter
  (``aiter.attention.paged_attention``: ``flash_attn_varlen_func`` over the gathered context, causal
  bottom-right), whose own rule decides what it serves on the expanded shapes.

AITER has no DSA (indexer / sparse) kernels in the version these adapters are written against.

Legend: T = query tokens, B = rows, P = pages per row, H = heads, L = kv_lora_rank, R = qk_rope_head_dim,
NB = blocks, BS = block size.
"""

from __future__ import annotations

import aiter
import aiter.mla
import torch

from atom_core.ops import kv_cache as kv_cache_op
from atom_core.ops.aiter import attention as aiter_attention
from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.triton.mla_decode import absorb_queries, expand_outputs
from atom_core.ops.triton.mla_prefill import expand_pages, expanded_head_dim

HALF_DTYPES = (torch.float16, torch.bfloat16)
DECODE_LATENT_DIM, DECODE_ROPE_DIM = 512, 64
DECODE_HEADS = (16, 128)
INT32_MAX = 2**31 - 1


# ---- store_mla_ ---------------------------------------------------------------------------------------------

def store_supports(kv_c, k_pe, mla_cache, slot_mapping, kv_scale) -> str | None:
    # concat_and_cache_mla takes a token stride for kv_c / k_pe and block / entry strides for the cache, int32.
    if not slot_mapping.is_contiguous():
        return "aiter store_mla_ reads slot_mapping as a packed array"
    if kv_c.dtype not in HALF_DTYPES:
        return f"aiter store_mla_ is used for fp16/bf16 rows only, got {kv_c.dtype}"
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1 or mla_cache.stride(-1) != 1:
        return "aiter store_mla_ needs the last dim of kv_c, k_pe and mla_cache contiguous"
    if max(kv_c.stride(0), k_pe.stride(0), mla_cache.stride(0), mla_cache.stride(1)) > INT32_MAX:
        return "aiter store_mla_ takes int32 strides"
    if mla_cache.dtype == FP8_DTYPE and not kv_cache_op._aiter_fp8_is_e4m3fn(mla_cache.device):
        return "aiter's fp8 KV cache on this GPU is e4m3fnuz, not torch.float8_e4m3fn"
    return None


def store_key(kv_c, k_pe, mla_cache, slot_mapping, kv_scale):
    """What :func:`store_supports` reads (the fp8 flavour follows from the cache's device, in the signature)."""
    return (slot_mapping.is_contiguous(), kv_c.dtype, mla_cache.dtype, kv_c.stride(), k_pe.stride(),
            mla_cache.stride())


def store_mla_(kv_c, k_pe, mla_cache, slot_mapping, kv_scale):
    if mla_cache.dtype == FP8_DTYPE:
        aiter.concat_and_cache_mla(kv_c, k_pe, mla_cache, slot_mapping, "fp8", kv_scale)
        return
    unit = torch.ones(1, dtype=torch.float32, device=kv_c.device)
    aiter.concat_and_cache_mla(kv_c, k_pe, mla_cache, slot_mapping, "auto", unit)


# ---- mla_decode_attention -----------------------------------------------------------------------------------

def _one_token_per_row(q_nope, block_tables, max_seqlen_q) -> bool:
    return max_seqlen_q == 1 and q_nope.shape[0] == block_tables.shape[0]


def decode_supports(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                    max_seqlen_k, scale, kv_scale, out) -> str | None:
    if q_nope.dtype != torch.bfloat16 or mla_cache.dtype != torch.bfloat16:
        return "aiter mla_decode_fwd is used for bf16 queries and a bf16 pool only"
    if w_uk.shape[-1] != DECODE_LATENT_DIM or q_pe.shape[-1] != DECODE_ROPE_DIM:
        return (f"aiter mla_decode_fwd kernels are built for L = {DECODE_LATENT_DIM}, R = {DECODE_ROPE_DIM}; "
                f"got L = {w_uk.shape[-1]}, R = {q_pe.shape[-1]}")
    if q_nope.shape[1] not in DECODE_HEADS:
        return f"aiter mla_decode_fwd is used for {DECODE_HEADS} heads, got {q_nope.shape[1]}"
    if not _one_token_per_row(q_nope, block_tables, max_seqlen_q):
        return "aiter mla_decode_fwd is used for decode batches (one query token per row) only"
    if not mla_cache.is_contiguous():
        return "aiter mla_decode_fwd reads the pool as packed rows of L + R"
    return None


def decode_key(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
               max_seqlen_k, scale, kv_scale, out):
    """What :func:`decode_supports` reads."""
    return (q_nope.dtype, mla_cache.dtype, w_uk.shape[-1], q_pe.shape[-1], q_nope.shape[1],
            _one_token_per_row(q_nope, block_tables, max_seqlen_q), mla_cache.is_contiguous())


def token_pages(block_tables, context_lens, block_size: int):
    """(kv_indptr int32 [B + 1], kv_indices int32 [B P BS + 1]) of the pool seen as pages of one token: row r's
    slots (position order) at ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]``. Device ops of fixed shapes only:
    positions past a row's context are scattered into the spare last entry."""
    num_rows, num_pages = block_tables.shape
    device = block_tables.device
    width = num_pages * block_size
    positions = torch.arange(width, device=device)
    slots = block_tables.long()[:, positions // block_size] * block_size + positions % block_size     # [B, P BS]
    kv_indptr = torch.zeros(num_rows + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(context_lens, 0)
    inside = positions[None, :] < context_lens.long()[:, None]
    dest = torch.where(inside, kv_indptr[:-1, None].long() + positions[None, :], num_rows * width)
    kv_indices = torch.zeros(num_rows * width + 1, dtype=torch.int32, device=device)
    kv_indices.scatter_(0, dest.reshape(-1), slots.reshape(-1).to(torch.int32))
    return kv_indptr, kv_indices


def mla_decode_attention(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                         max_seqlen_k, scale, kv_scale, out):
    num_tokens, num_heads, _ = q_nope.shape
    latent_dim = w_uk.shape[-1]
    q = torch.cat([absorb_queries(q_nope, w_uk).transpose(0, 1), q_pe], dim=-1).contiguous()   # [T, H, L + R]
    o_lat = torch.empty(num_tokens, num_heads, latent_dim, dtype=q.dtype, device=q.device)
    kv_indptr, kv_indices = token_pages(block_tables, context_lens, mla_cache.shape[1])
    kv_last_page_lens = torch.ones(block_tables.shape[0], dtype=torch.int32, device=q.device)
    aiter.mla.mla_decode_fwd(q, mla_cache.view(-1, 1, 1, mla_cache.shape[-1]), o_lat, cu_seqlens_q, kv_indptr,
                             kv_indices, kv_last_page_lens, max_seqlen_q, sm_scale=scale)
    # One token per row: token t is row t. A row with an empty context outputs zeros (op contract).
    o_lat = torch.where((context_lens > 0)[:, None, None], o_lat, 0)
    expand_outputs(o_lat.transpose(0, 1), w_uv, out)


# ---- mla_prefill_attention ----------------------------------------------------------------------------------

def _expanded_meta(q_nope, q_pe, mla_cache, w_uv, block_tables):
    """Meta tensors shaped like the expanded attention's q, K/V pools and block table (no memory behind them)."""
    num_tokens, num_heads, nope_dim = q_nope.shape
    head_dim = expanded_head_dim(nope_dim, q_pe.shape[-1], w_uv.shape[1])
    num_rows, num_pages = block_tables.shape
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=q_nope.dtype, device="meta")
    pool = torch.empty(num_rows * num_pages, mla_cache.shape[1], num_heads, head_dim, dtype=q_nope.dtype,
                       device="meta")
    return q, pool, torch.empty(num_rows, num_pages, dtype=torch.int32, device="meta")


def prefill_supports(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                     max_seqlen_k, scale, kv_scale, out) -> str | None:
    if q_nope.dtype not in HALF_DTYPES:
        return f"aiter mla_prefill_attention takes bf16/fp16 queries, got {q_nope.dtype}"
    q, pool, tables = _expanded_meta(q_nope, q_pe, mla_cache, w_uv, block_tables)
    why = aiter_attention.supports(q, pool, pool, tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                                   scale, None, 0.0, None, None, None, q, None)
    return None if why is None else f"the expanded attention (head dim {q.shape[-1]}): {why}"


def prefill_key(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                max_seqlen_k, scale, kv_scale, out):
    """What :func:`prefill_supports` reads: the dtype and the expanded call's key."""
    if q_nope.dtype not in HALF_DTYPES:
        return (q_nope.dtype,)
    q, pool, tables = _expanded_meta(q_nope, q_pe, mla_cache, w_uv, block_tables)
    return q_nope.dtype, aiter_attention.supports_key(q, pool, pool, tables, cu_seqlens_q, context_lens, max_seqlen_q,
                                                      max_seqlen_k, scale, None, 0.0, None, None, None, q, None)


def mla_prefill_attention(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens,
                          max_seqlen_q, max_seqlen_k, scale, kv_scale, out):
    if q_nope.shape[0] == 0:
        return
    q, k_cache, v_cache, tables = expand_pages(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, kv_scale)
    out_full = torch.empty_like(q)
    aiter_attention.paged_attention(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, max_seqlen_q,
                                    max_seqlen_k, scale, None, 0.0, None, None, None, out_full, None)
    out.copy_(out_full[:, :, :w_uv.shape[1]])
