"""AITER adapters for paged attention (signatures in aiter/ops/attention.py and aiter/ops/mha.py).

Two paths, both fed without reading tensor contents on the host (CUDA-graph safe):

* decode (``max_seqlen_q == 1``, one token per row): ``paged_attention_rocm``. It reads K pages
  as ``[blocks, Hk, D / x, BS, x]`` (x = 16 bytes of elements) and V pages as
  ``[blocks, Hk, D, BS]``, not atom_core's ``[NB, BS, Hk, D]`` pool, so the adapter copies this
  batch's pages (``B * P`` of them) into those layouts first. The copy costs about twice the
  kernel's own K/V traffic; a pool kept in AITER's layout would remove it.
* everything else: ``flash_attn_varlen_func`` over each row's context gathered from the pool
  into packed ``[sum(context_lens), Hk, D]`` K/V; its causal mask is aligned bottom-right, which
  is the op's semantics, so chunked prefill on a cached prefix is served too.

``supports`` is conservative: bf16/fp16 only, no sinks, no fp8 caches, and per path the
features and shapes the kernel is known to take.

Legend: T = query tokens, B = rows, Hq / Hk = query / kv heads, D = head dim, BS = block size,
P = pages per row.
"""

from __future__ import annotations

import aiter
import torch

PARTITION_SIZE = 256  # keys per partition of paged_attention_rocm (its default)
DECODE_BLOCK_SIZES = (16, 32)
DECODE_HEAD_DIMS = (64, 128)
DECODE_MAX_GROUP = 16
VARLEN_MAX_HEAD_DIM = 256


def _is_decode(q, block_tables, max_seqlen_q) -> bool:
    return max_seqlen_q == 1 and q.shape[0] == block_tables.shape[0]


def supports(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale,
             sliding_window, logit_softcap, sinks, k_scale, v_scale, out, out_scale, row_order=None) -> str | None:
    """Why AITER cannot serve this call, or None."""
    if out_scale is not None:
        return "aiter attention does not quantize its output (the triton kernels do)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"aiter attention takes bf16/fp16 queries, got {q.dtype}"
    if k_cache.dtype != q.dtype:
        return "aiter attention adapters read 16-bit caches only (fp8 caches go to triton)"
    if k_scale is not None or v_scale is not None:
        return "k_scale / v_scale are only meaningful for fp8 caches"
    if sinks is not None:
        return "aiter attention kernels have no attention sinks"
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        return "aiter attention needs the head dim of q and out contiguous"
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    if _is_decode(q, block_tables, max_seqlen_q):
        if sliding_window is not None or logit_softcap > 0:
            return "paged_attention_rocm has no sliding window or logit softcap"
        if block_size not in DECODE_BLOCK_SIZES:
            return f"paged_attention_rocm takes block sizes {DECODE_BLOCK_SIZES}, got {block_size}"
        if head_dim not in DECODE_HEAD_DIMS:
            return f"paged_attention_rocm takes head dims {DECODE_HEAD_DIMS} here, got {head_dim}"
        if group > DECODE_MAX_GROUP:
            return f"paged_attention_rocm takes up to {DECODE_MAX_GROUP} q heads per kv head, got {group}"
        return None
    if head_dim % 8 or head_dim > VARLEN_MAX_HEAD_DIM:
        return f"flash_attn_varlen_func takes head dims that are multiples of 8 up to {VARLEN_MAX_HEAD_DIM}"
    return None


def supports_key(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale,
                 sliding_window, logit_softcap, sinks, k_scale, v_scale, out, out_scale,
                 row_order=None):
    """What :func:`supports` reads: the dispatcher's cache key for this backend."""
    return (out_scale is None, q.dtype, k_cache.dtype, k_scale is None, v_scale is None, sinks is None, q.stride()[-1] == 1,
            out.stride()[-1] == 1, q.shape[-1], k_cache.shape[1], q.shape[1] // k_cache.shape[2],
            _is_decode(q, block_tables, max_seqlen_q), sliding_window is None, logit_softcap > 0)


def _decode(q, k_cache, v_cache, block_tables, context_lens, max_seqlen_k, scale, out):
    num_rows, num_pages = block_tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    x = 16 // k_cache.element_size()
    pages = block_tables.clamp(min=0).long().flatten()  # [B * P]; -1 padding reads block 0, masked by length
    k_pages = (k_cache[pages].view(-1, block_size, num_kv_heads, head_dim // x, x)
               .permute(0, 2, 3, 1, 4).contiguous())  # [B * P, Hk, D / x, BS, x]
    v_pages = v_cache[pages].permute(0, 2, 3, 1).contiguous()  # [B * P, Hk, D, BS]
    local_tables = torch.arange(num_rows * num_pages, dtype=torch.int32, device=q.device).view(num_rows, num_pages)
    num_parts = -(-max(max_seqlen_k, 1) // PARTITION_SIZE)
    exp_sums = torch.empty(num_rows, q.shape[1], num_parts, dtype=torch.float32, device=q.device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(num_rows, q.shape[1], num_parts, head_dim, dtype=q.dtype, device=q.device)
    unit_scale = torch.ones(1, dtype=torch.float32, device=q.device)
    result = out if out.is_contiguous() else torch.empty_like(q, memory_format=torch.contiguous_format)
    aiter.paged_attention_rocm(result, exp_sums, max_logits, tmp_out, q.contiguous(), k_pages, v_pages, num_kv_heads,
                               scale, local_tables, context_lens, block_size, max_seqlen_k, None, "auto",
                               unit_scale, unit_scale)
    result.masked_fill_((context_lens == 0).view(-1, 1, 1), 0.0)  # padding rows: zeros by contract
    if result is not out:
        out.copy_(result)


def _packed_context(cache, block_tables, cu_seqlens_k, max_seqlen_k):
    """K or V of every row's context, row after row: [B * max_seqlen_k, Hk, D], the tail unused."""
    num_rows, num_pages = block_tables.shape
    block_size = cache.shape[1]
    u = torch.arange(num_rows * max_seqlen_k, device=cache.device)
    row = torch.searchsorted(cu_seqlens_k[1:], u, right=True).clamp(max=num_rows - 1)
    j = u - cu_seqlens_k[row]  # position within the row
    page = (j // block_size).clamp(max=num_pages - 1)
    block = block_tables[row, page].clamp(min=0).long()
    slot = block * block_size + j % block_size
    return cache.reshape(-1, *cache.shape[2:])[slot]


def _varlen(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale,
            sliding_window, logit_softcap, out):
    num_rows = block_tables.shape[0]
    if max_seqlen_k == 0:
        out.zero_()
        return
    cu_seqlens_k = torch.zeros(num_rows + 1, dtype=torch.int32, device=q.device)
    cu_seqlens_k[1:] = torch.cumsum(context_lens, 0)
    k = _packed_context(k_cache, block_tables, cu_seqlens_k, max_seqlen_k)
    v = _packed_context(v_cache, block_tables, cu_seqlens_k, max_seqlen_k)
    # FlashAttention's window (left, right): keys p - left .. p + right; ours is p - W + 1 .. p.
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    result = aiter.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          softmax_scale=scale, logits_soft_cap=logit_softcap, causal=True,
                                          window_size=window, out=out if out.is_contiguous() else None)
    if result is not out:
        out.copy_(result)
    token_row = torch.searchsorted(cu_seqlens_q[1:], torch.arange(q.shape[0], device=q.device), right=True)
    empty = (context_lens[token_row.clamp(max=num_rows - 1)] == 0).view(-1, 1, 1)
    out.masked_fill_(empty, 0.0)  # padding rows: zeros by contract


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale,
                    sliding_window, logit_softcap, sinks, k_scale, v_scale, out, out_scale, row_order=None):
    # row_order orders the launch of our split-K kernel; AITER's kernels schedule their own.
    if q.shape[0] == 0 or block_tables.shape[0] == 0:
        return
    if _is_decode(q, block_tables, max_seqlen_q):
        _decode(q, k_cache, v_cache, block_tables, context_lens, max_seqlen_k, scale, out)
    else:
        _varlen(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale,
                sliding_window, logit_softcap, out)
