"""Triton lightning indexer (``indexer_topk``, DSA): index scores over each row's paged key cache by a Triton
kernel, then the top-k positions by radix select over many programs a row (triton/topk_select.py).

1. ``_index_scores_kernel``, one program per (query token, chunk of ``keys_per_program`` positions:
   :func:`keys_per_program`, from the grid's size against the SM count):
   the token's indexer queries ``q[t]`` [Hi, Di] stay in registers; each tile of BLOCK_N keys of its row
   (page lookups by ``attention_unified._tile_rows``) gives ``s = q[t] @ k^T`` [Hi, N] by one ``tl.dot`` and
   ``I[t, j] = sum_h w[t, h] relu(scale s[h, j])`` [N] (an fp8 cache: q rounded to e4m3 a head at a time
   in the program, its scales folded into w, an e4m3 x e4m3 dot, the sum times the key's scale), written
   to an fp32 buffer ``scores [T, W]``,
   ``W = max_seqlen_k``. Positions the token may not see (``j > p``, or past the row's context) get -inf
   without their keys being read; every column of the buffer is written (no memset).
2. ``topk_select.topk_positions(scores, min(K, W))``: exact, -inf (not visible) never chosen; a row that
   sees fewer than K positions gets them in position order, then -1 (as also past W); a full row gets its
   K in a fixed spread order (that module's docstring). Which of exactly tied positions is kept and the
   order of the kept ones are unspecified by the op's contract (this backend keeps the earliest).

The buffer is ``T x W`` fp32 (32k context: 128 KiB per query token); tokens go through in chunks so that
it stays under ``SCORE_BUFFER_BYTES``. Everything is sized from shapes and ``max_seqlen_k`` (CUDA-graph
capturable).

Legend: T = query tokens, B = rows, Hi = indexer heads, Di = indexer head dim, K = top-k, W = score
columns, BS = block size.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_core.ops.dispatch import triton_interpret
from atom_core.ops.triton import topk_select
from atom_core.ops.triton.attention_unified import _tile_rows, dot_options
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2, num_sms, unit_stride
from atom_core.ops.triton.mla_decode import row_of_token
from atom_core.ops.triton.quant import TL_AMAX_FLOOR, TL_FP8_MAX, quantize_groups

SCORE_BUFFER_BYTES = 1 << 28  # the scores of one chunk of query tokens
MAX_KEYS_PER_PROGRAM = 2048
PROGRAMS_PER_SM = 4


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, cache_ptr, key_scale_ptr, scores_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    first_token, num_rows, num_heads, width, keys_per_program,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_cb, stride_cs, stride_ksb, stride_kss, stride_bt, stride_st,
    scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_KEY_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    t_local = tl.program_id(0)
    t = first_token + t_local
    chunk_start = tl.program_id(1) * keys_per_program
    row = row_of_token(cu_seqlens_q_ptr, t, num_rows)
    q_start = tl.load(cu_seqlens_q_ptr + row)
    q_len = tl.load(cu_seqlens_q_ptr + row + 1) - q_start
    context_len = tl.load(context_lens_ptr + row)
    pos = context_len - q_len + (t - q_start)
    kv_end = tl.where(context_len > 0, tl.maximum(pos + 1, 0), 0)  # positions 0 .. p are visible

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_ok = offs_h < num_heads
    d_ok = offs_d < HEAD_DIM
    t64 = t.to(tl.int64)
    q = tl.load(q_ptr + t64 * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)                       # [Hi, Di]
    w = tl.load(w_ptr + t64 * stride_wt + offs_h * stride_wh, mask=h_ok, other=0.0)  # [Hi] fp32 (0: padded heads)
    if HAS_KEY_SCALE:  # fp8 keys: q rounded to e4m3 a head at a time (the twin's indexer_queries), its scale
        q, q_scale = quantize_groups(q.to(tl.float32), TL_AMAX_FLOOR, TL_FP8_MAX, False)  # folded into w
        w = w * q_scale
        if not DOT_UPCAST:
            q = q.to(cache_ptr.dtype.element_ty)                                      # both dot operands e4m3
    block_table_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt
    score_row = scores_ptr + t_local.to(tl.int64) * stride_st
    offs_n = tl.arange(0, BLOCK_N)
    chunk_end = tl.minimum(chunk_start + keys_per_program, width)
    seen_end = tl.minimum(chunk_end, kv_end)
    for start in range(chunk_start, seen_end, BLOCK_N):
        keys = start + offs_n
        key_ok = keys < kv_end
        # The second set of offsets: the keys' slots in key_scale [NB, BS] (unread without HAS_KEY_SCALE).
        rows, scale_rows = _tile_rows(block_table_ptr, start, kv_end, 0, stride_cb, stride_cs, 0, stride_ksb,
                                      stride_kss, 0, BLOCK_N, PAGE_SIZE, True)
        k = tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        elif HAS_KEY_SCALE:
            s = tl.dot(q, tl.trans(k))                                                  # e4m3 x e4m3 -> fp32
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)      # [Hi, N]
        score = tl.sum(w[:, None] * tl.maximum(s * scale, 0.0), axis=0)                 # [N]
        if HAS_KEY_SCALE:  # key = cache * key_scale, key_scale > 0: it commutes with the relu and the head sum
            score = score * tl.load(key_scale_ptr + scale_rows, mask=key_ok, other=0.0)
        tl.store(score_row + keys, tl.where(key_ok, score, float("-inf")), mask=keys < chunk_end)
    for start in range(tl.maximum(seen_end, chunk_start), chunk_end, BLOCK_N):  # not visible: no key read
        keys = start + offs_n
        tl.store(score_row + keys, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=keys < chunk_end)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_params(num_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, interpret: bool,
                   fp8: bool = False) -> tuple[dict, dict]:
    """(constexprs, launch options) of the score kernel for one shape signature (fp8: e4m3 keys, whose dot
    needs K >= 32)."""
    head_dim_pad = max(next_power_of_2(head_dim), 32 if fp8 else 16)
    heads_pad = max(next_power_of_2(num_heads), 16)
    if interpret:
        block_n, warps = 16, 4
    else:
        # [64, 128] queries x [64, 128] keys per tile over 4 warps: at 64 x 32k with DeepSeek-V3.2's indexer on
        # an H200, 0.177-0.186 ms at 512-2048 keys a program, against 0.193-0.201 over 8 warps and
        # 0.195-0.222 for 128-key tiles (benchmarks/results/h200_ops_dsa_probe.json).
        block_n = 64
        warps = 4 if heads_pad * block_n <= 64 * 64 else 8
    constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HEADS_PAD=heads_pad, BLOCK_N=block_n,
                      PAGE_SIZE=page_size, **dot_options(dtype, interpret))
    return constexprs, dict(num_warps=warps, num_stages=1 if interpret else 2)


def keys_per_program(num_tokens: int, width: int, block_n: int, sms: int) -> int:
    """Positions one score program covers: ``MAX_KEYS_PER_PROGRAM``, halved while the grid
    (``num_tokens x cdiv(width, keys)``) has fewer than ``PROGRAMS_PER_SM`` programs a SM, never below one tile.
    On an H200 at 32k: 64 tokens took 0.177 ms at 2048 keys a program (1,024 programs) against 0.184 at 512;
    one token 0.0058 ms at 64 (512 programs) against 0.0207 at 1024 (32 programs)."""
    keys = MAX_KEYS_PER_PROGRAM
    while keys > block_n and num_tokens * cdiv(width, keys) < PROGRAMS_PER_SM * sms:
        keys //= 2
    return max(keys, block_n)


def index_scores(q, weights, indexer_cache, indexer_scale, block_tables, cu_seqlens_q, context_lens, width, scale,
                 first_token, num_tokens, scores):
    """Write ``scores[i, j]`` (fp32 [>= num_tokens, >= width]) = I[first_token + i, j], -inf where not visible.
    indexer_scale: fp32 [NB, BS] per-key scales of an fp8 cache, or None."""
    constexprs, options = _launch_params(q.shape[1], q.shape[2], indexer_cache.shape[1], q.dtype,
                                         triton_interpret(), indexer_scale is not None)
    sms = num_sms(q.device.index or 0) if q.is_cuda else 1  # the interpreter: a few programs, several chunks
    keys = keys_per_program(num_tokens, width, constexprs["BLOCK_N"], sms)
    has_key_scale = indexer_scale is not None
    key_scale = indexer_scale if has_key_scale else weights  # unread without HAS_KEY_SCALE
    _index_scores_kernel[(num_tokens, cdiv(width, keys))](
        q, weights, indexer_cache, key_scale, scores, block_tables, cu_seqlens_q, context_lens,
        first_token, block_tables.shape[0], q.shape[1], width, keys,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), indexer_cache.stride(0),
        indexer_cache.stride(1), key_scale.stride(0), key_scale.stride(1), block_tables.stride(0), scores.stride(0),
        float(scale), HAS_KEY_SCALE=has_key_scale, **constexprs, **options,
    )


def indexer_topk(q, weights, indexer_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                 topk, scale, indexer_scale, out):
    """Fill out int32 [T, K] (arguments as ``atom_core.ops.indexer_topk``)."""
    num_tokens = q.shape[0]
    width = max(int(max_seqlen_k), 1)
    keep = min(topk, width)
    if keep < topk:
        out[:, keep:] = -1
    if num_tokens == 0:
        return
    if block_tables.shape[0] == 0:
        out.fill_(-1)
        return
    block_tables, cu_seqlens_q, context_lens = unit_stride(block_tables, cu_seqlens_q, context_lens)
    chunk = max(1, min(num_tokens, SCORE_BUFFER_BYTES // (4 * width)))
    sms = num_sms(q.device.index or 0) if q.is_cuda else 1
    scores = torch.empty(chunk, width, dtype=torch.float32, device=q.device)
    select_chunk = topk_select.chunk_size(chunk, width, sms)
    state = torch.empty(chunk, topk_select.state_width(width, select_chunk), dtype=torch.int32, device=q.device)
    for first in range(0, num_tokens, chunk):
        count = min(chunk, num_tokens - first)
        index_scores(q, weights, indexer_cache, indexer_scale, block_tables, cu_seqlens_q, context_lens, width, scale,
                     first, count, scores)
        state[:count].zero_()
        topk_select.topk_positions(scores[:count], state[:count], out[first:first + count], keep, select_chunk)
