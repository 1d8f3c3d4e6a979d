"""MLA attention in the expanded form (``mla_prefill_attention``) on the Triton backend: the latent pages
expanded to per-head K/V by one GEMM each (torch), then the existing unified flash-attention kernel
(``attention_unified``) over them.

Why this shape: the expanded form is ordinary causal multi-head attention once each cached latent row
has become per-head keys ``[w_uk c_kv, k_pe]`` and values ``w_uv c_kv``; the unified kernel already serves
every layout the op must (prefill, chunked prefill over a cached prefix: bottom-right causal, decode rows
in mixed batches, padding rows) with full/edge tiles and per-page lookups, so the expansion is written as
a temporary *paged* pool and the kernel is reused unchanged, instead of a second flash-attention kernel.

* The row's pages are gathered in table order: temporary block ``r * P + i`` holds page i of row r, so the
  temporary block table is ``arange(B * P).view(B, P)`` and the query layout (cu_seqlens_q, context_lens)
  is the op's own. Pages past a row's end (-1 in the table) read block 0: expanded, never attended
  (keys past ``context_lens`` are masked out of the loads).
* Expansion: ``k_nope = c_kv @ w_uk^T`` and ``v = c_kv @ w_uv^T`` as two GEMMs of ``[B P BS, L] x [L, H D]``;
  an fp8 pool is dequantised (``row * kv_scale``) before them.
* The kernel takes one head dim for q, K and V: D = max(Dn + R, Dv), the others zero-padded
  (DeepSeek: q/K 192, V 128 -> 192; the kernel keeps a head padded to 256 in registers anyway), and out's
  first Dv columns are the result.

Cost: the GEMMs expand B * P * BS rows (the table's width, not the context): ~ 2 B P BS L H (Dn + Dv) flops
and a temporary of B P BS H 2D elements; sized from shapes only (no host read). A later version can
expand only the pages the step attends to, or fuse the expansion into the kernel's K/V loads.

Legend: T = query tokens, B = rows, P = pages per row, BS = block size, H = heads, L = kv_lora_rank,
R = qk_rope_head_dim, Dn / Dv = nope / value head dims.
"""

from __future__ import annotations

import torch

from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.triton.attention_unified import paged_attention_unified


def expanded_head_dim(nope_dim: int, rope_dim: int, v_dim: int) -> int:
    """The one head dim of the expanded attention: q/K are Dn + R wide, V is Dv wide; both padded to the larger."""
    return max(nope_dim + rope_dim, v_dim)


def _flat_heads_weight(w):
    """[H, D, L] -> [H * D, L] (a copy only when w is a strided view, e.g. a slice of kv_b_proj's weight)."""
    return w.reshape(w.shape[0] * w.shape[1], w.shape[2])


def expand_pages(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, kv_scale):
    """The expanded attention's inputs: (q [T, H, D], k_cache [B P, BS, H, D], v_cache [B P, BS, H, D],
    block_tables int32 [B, P]), D = ``expanded_head_dim``; q's dtype throughout."""
    num_tokens, num_heads, nope_dim = q_nope.shape
    rope_dim, latent_dim, v_dim = q_pe.shape[2], w_uk.shape[2], w_uv.shape[1]
    num_rows, num_pages = block_tables.shape
    block_size = mla_cache.shape[1]
    head_dim = expanded_head_dim(nope_dim, rope_dim, v_dim)
    dtype, device = q_nope.dtype, q_nope.device

    pages = block_tables.reshape(-1).clamp(min=0).long()                       # [B P]; -1 -> block 0 (unread)
    rows = mla_cache.index_select(0, pages).view(-1, mla_cache.shape[2])        # [B P BS, L + R]
    if mla_cache.dtype == FP8_DTYPE:
        rows = (rows.float() * kv_scale.float()).to(dtype)
    c_kv, k_pe = rows[:, :latent_dim], rows[:, latent_dim:]
    num_slots = rows.shape[0]
    k = torch.zeros(num_slots, num_heads, head_dim, dtype=dtype, device=device)
    v = torch.zeros(num_slots, num_heads, head_dim, dtype=dtype, device=device)
    k[:, :, :nope_dim] = (c_kv @ _flat_heads_weight(w_uk).t()).view(num_slots, num_heads, nope_dim)
    k[:, :, nope_dim:nope_dim + rope_dim] = k_pe[:, None, :]                  # one rope key for every head
    v[:, :, :v_dim] = (c_kv @ _flat_heads_weight(w_uv).t()).view(num_slots, num_heads, v_dim)
    q = torch.zeros(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    q[:, :, :nope_dim] = q_nope
    q[:, :, nope_dim:nope_dim + rope_dim] = q_pe
    tables = torch.arange(num_rows * num_pages, dtype=torch.int32, device=device).view(num_rows, num_pages)
    shape = (num_rows * num_pages, block_size, num_heads, head_dim)
    return q, k.view(shape), v.view(shape), tables


def mla_prefill_attention(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens,
                          max_seqlen_q, max_seqlen_k, scale, kv_scale, out):
    """Fill out [T, H, Dv] (arguments as ``atom_core.ops.mla_prefill_attention``)."""
    if q_nope.shape[0] == 0:
        return
    if block_tables.shape[0] == 0 or block_tables.shape[1] == 0:
        out.zero_()
        return
    q, k_cache, v_cache, tables = expand_pages(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, kv_scale)
    out_full = torch.empty_like(q)
    paged_attention_unified(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                            scale, None, 0.0, None, None, None, out_full)
    out.copy_(out_full[:, :, :w_uv.shape[1]])
