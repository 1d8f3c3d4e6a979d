"""Triton split-K paged attention for decode batches (flash-decoding).

A decode step has few query tokens per row (1, or k for multi-token / speculative decode) over
long contexts, so one program per (row, kv head) would leave most of the GPU idle when the batch
is small. The context of each row is cut into ``NUM_SPLITS`` chunks of whole ``BLOCK_N``-key tiles:

1. ``_decode_split_kernel``, one program per (row, kv head, split), kv heads fastest: the q tile holds all query
   tokens of the row times the ``GROUP = Hq // Hk`` q heads of the kv head (row m = token
   ``m // GROUP``, head ``m % GROUP``), padded to at least 16 rows so ``tl.dot`` applies; each K/V
   page is read once per kv head. It writes the chunk's unnormalised output and its base-2
   running max and sum (fp32), or, with one split, the final output directly.
2. ``_decode_reduce_kernel``, one program per (token, q head): rescales the chunks to a common
   max, adds the sink to the denominator, normalises and writes the output.

Programs start in launch order, kv heads fastest, rows in ``row_order`` when one is given: rows by
descending context start the long programs first and let the short ones fill in behind them. Over
256 rows of 105-1,029 tokens (Qwen3-30B-A3B heads) on an H200 that took the fp8 pool from 67 to 55 us
and the bf16 pool from 86 to 75; in row order the last programs to start could be long ones
(benchmarks/results/h200_ops_attention_decode_row_order.json).

The number of splits depends only on B, Hk, ``max_seqlen_k`` and the SM count, never on tensor
contents, so a CUDA graph captured for a batch bucket replays with any lengths: each row divides
its own context among the splits, and a split past the row's end writes an empty chunk.

Legend: T = query tokens, B = rows, Hq / Hk = query / kv heads, D = head dim, S = splits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_core.ops.dispatch import triton_interpret
from atom_core.ops.triton.attention_unified import attend_key_range, dot_options, fp16_dots, fp16_queries
from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2, num_sms, unit_stride
from atom_core.ops.triton.quant import TL_AMAX_FLOOR, TL_FP8_MAX, per_head_quant, quantize_groups

# Programs wanted per SM; fewer programs than this leave HBM bandwidth unused.
PROGRAMS_PER_SM = 2
# A split shorter than this many keys costs more in partial writes than it gains.
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 64
# fp8 pools: from this many (row, kv head) programs, 2 warps a program instead of 4 (more of them resident).
# On an H200 (Hq 32, D 128): 2 warps 21-29% faster from 256 programs (64 rows x Hk 4 at 768 keys: 0.024
# against 0.031 ms; 32 x Hk 8 at 512: 0.016 against 0.023), 3-9% slower at 32-128
# (benchmarks/results/h200_ops_attention_decode_fp8_warps.json).
FP8_TWO_WARPS_FROM = 256
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}  # q's, for stores


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, row_order_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    num_heads, scale, softcap, sliding_window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, MAX_QLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    FP16_DOTS: tl.constexpr, HAS_ROW_ORDER: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    num_kv_heads = num_heads // GROUP
    kv_head = tl.program_id(0) % num_kv_heads
    row = tl.program_id(0) // num_kv_heads
    if HAS_ROW_ORDER:
        row = tl.load(row_order_ptr + row)
    split = tl.program_id(1)

    q_start = tl.load(cu_seqlens_q_ptr + row)
    q_len = tl.load(cu_seqlens_q_ptr + row + 1) - q_start
    context_len = tl.load(context_lens_ptr + row)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    token = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < MAX_QLEN * GROUP) & (token < q_len)
    d_ok = offs_d < HEAD_DIM
    pos = context_len - q_len + token
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # This split's share of the keys any query of the row can see, in whole tiles from a multiple of
    # BLOCK_N (tiles aligned to BLOCK_N look pages up per page; keys before the window are masked).
    kv_start = 0
    if HAS_WINDOW:
        kv_start = (tl.maximum(context_len - q_len - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N
    num_tiles = tl.maximum(tl.cdiv(context_len - kv_start, BLOCK_N), 0)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    split_start = kv_start + split * tiles_per_split * BLOCK_N
    split_end = tl.minimum(split_start + tiles_per_split * BLOCK_N, context_len)

    qk_scale = scale
    if HAS_K_SCALE:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if FP16_DOTS:
        q, q_unscale = fp16_queries(q)
        qk_scale = qk_scale * q_unscale
    if HAS_SINKS and NUM_SPLITS == 1:
        # One split: start the softmax state at the sink, the extra logit of the denominator.
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    acc, m_i, l_i = attend_key_range(
        acc, m_i, l_i, q, pos, context_len - q_len, context_len - 1, split_start, split_end,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + row.to(tl.int64) * stride_bt, kv_head,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, softcap, sliding_window,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, DOT_UPCAST,
    )

    t = (q_start + token).to(tl.int64)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if HAS_V_SCALE:
            out = out * tl.load(v_scale_ptr)
        out_rows = t * stride_ot + head * stride_oh
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Partials are [T, Hq, S] (max, sum) and [T, Hq, S, D] (output), contiguous.
        part = (t * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_reduce_kernel(
    out_ptr, out_scale_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, v_scale_ptr,
    stride_ot, stride_oh, stride_st, num_heads,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_V_SCALE: tl.constexpr, QUANT: tl.constexpr, OUT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    part = (t * num_heads + head) * NUM_SPLITS + offs_s
    m_s = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    m_all = tl.max(m_s, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    m_shift = tl.where(m_all == float("-inf"), 0.0, m_all)
    weight = tl.exp2(m_s - m_shift)  # chunk s rescaled from its own max to the common one; empty: 0
    total = tl.sum(l_s * weight, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_shift)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    if HAS_V_SCALE:
        out = out * tl.load(v_scale_ptr)
    out_ptrs = out_ptr + t * stride_ot + head * stride_oh + offs_d
    if QUANT:
        # Rounded to q's dtype first: per_group_quant (group = D) of the rounded output, bit for bit.
        y = tl.where(d_ok, out.to(OUT_DTYPE).to(tl.float32), 0.0)
        q, scale = quantize_groups(y[None, :], TL_AMAX_FLOOR, TL_FP8_MAX, False)  # one group: the head
        tl.store(out_ptrs, tl.reshape(q, [HEAD_DIM_PAD]).to(out_ptr.dtype.element_ty), mask=d_ok)
        tl.store(out_scale_ptr + t * stride_st + head, tl.max(scale, axis=0))
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def choose_num_splits(num_rows: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
    """Splits per row so that B * Hk * splits reaches ``PROGRAMS_PER_SM`` programs per SM.

    Depends on shapes, ``max_seqlen_k`` and the device only (fixed inside a CUDA-graph bucket);
    capped so that a split holds at least ``MIN_KEYS_PER_SPLIT`` keys of the longest context.
    """
    if device.type != "cuda":
        return 1
    programs = max(num_rows * num_kv_heads, 1)
    wanted = cdiv(PROGRAMS_PER_SM * num_sms(device.index or 0), programs)
    useful = cdiv(max(max_seqlen_k, 1), MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


def _decode_config(head_dim_pad: int, dtype: torch.dtype, block_m: int, interpret: bool,
                   cache_itemsize: int, many_programs: bool) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the split kernel (``cache_itemsize``: bytes a pool element;
    ``many_programs``: at least ``FP8_TWO_WARPS_FROM`` (row, kv head) programs).

    Chosen from sm90 builds: no register spills, several programs resident per SM; q tiles
    larger than 64 x 128 (many q heads per kv head, or multi-token decode) need 8 warps. An fp8 pool's
    tile holds half the bytes, so it keeps five tiles in flight instead of three: on an H200
    (Hq 32, D 128, 16-row q tiles) 0.093 against 0.115 ms at 256 rows x 1k context and Hk 4, 0.191 against
    0.262 at 64 x 4k and Hk 8, and as fast at one row (the bf16 pool is already at copy bandwidth with
    three, and slower with five; benchmarks/results/h200_ops_attention_decode_fp8_sweep.json).
    """
    if interpret:
        return 16, 4, 1
    if dtype == torch.float32:
        return (16, 4, 2) if head_dim_pad <= 128 and block_m <= 16 else (16, 8, 1)
    warps = 4 if block_m * head_dim_pad <= 64 * 128 else 8
    stages = 3
    if cache_itemsize == 1 and warps == 4:
        stages = 5
        if many_programs:
            warps = 2
    return (64 if head_dim_pad <= 128 else 32), warps, stages


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_params(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, max_seqlen_q: int,
                   dtype: torch.dtype, interpret: bool, cache_itemsize: int,
                   many_programs: bool) -> tuple[dict, dict]:
    """(constexprs, launch options) of the split kernel for one shape signature; cached, so a call
    does int math only."""
    group = num_heads // num_kv_heads
    head_dim_pad = max(next_power_of_2(head_dim), 16)
    block_m = max(16, next_power_of_2(max_seqlen_q * group))
    block_n, warps, stages = _decode_config(head_dim_pad, dtype, block_m, interpret, cache_itemsize, many_programs)
    constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group, MAX_QLEN=max_seqlen_q,
                      BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size, FP16_DOTS=fp16_dots(dtype, cache_itemsize),
                      **dot_options(dtype, interpret))
    return constexprs, dict(num_warps=warps, num_stages=stages)


def paged_attention_decode(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                           scale, sliding_window, logit_softcap, sinks, k_scale, v_scale, out, out_scale=None,
                           num_splits=None, row_order=None):
    """Fill out [T, Hq, D] (arguments as ``atom_core.ops.paged_attention``; with ``out_scale`` [T, Hq], out is
    fp8 e4m3fn, one scale a head) for batches whose query lengths are all <= ``max_seqlen_q`` (small).
    ``num_splits`` overrides the heuristic (tests); ``row_order``: int32 [B], a permutation of the rows, the
    order their programs are launched in (None: 0 .. B-1).

    Quantized output: several splits quantize in the reduce kernel's epilogue. One split writes q's dtype and
    ``per_group_quant`` follows: the same epilogue in the split kernel made it slower than that extra launch
    (Llama-3-8B bs 64 on an H200: 55.8 against 48.8 us a layer, the quantization launch 3.2)."""
    num_tokens, num_heads, head_dim = q.shape
    num_rows = block_tables.shape[0]
    if num_tokens == 0 or num_rows == 0:
        return
    block_tables, cu_seqlens_q, context_lens, sinks, row_order = unit_stride(block_tables, cu_seqlens_q, context_lens,
                                                                             sinks, row_order)
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    itemsize = k_cache.element_size()
    constexprs, options = _launch_params(num_heads, num_kv_heads, head_dim, page_size, max_seqlen_q, q.dtype,
                                         triton_interpret(), itemsize,
                                         itemsize == 1 and num_rows * num_kv_heads >= FP8_TWO_WARPS_FROM)
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, num_kv_heads, max_seqlen_k, q.device)
    if num_splits > 1:
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = None
    # One split writes the output itself: in q's dtype when it is to be quantized after.
    split_out = out if out_scale is None or num_splits > 1 else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _decode_split_kernel[(num_rows * num_kv_heads, num_splits)](
        q, k_cache, v_cache, split_out, part_out, part_max, part_sum,
        block_tables, cu_seqlens_q, context_lens, sinks, k_scale, v_scale, row_order,
        q.stride(0), q.stride(1), split_out.stride(0), split_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        num_heads, float(scale), float(logit_softcap), int(sliding_window or 0), NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logit_softcap > 0, HAS_SINKS=sinks is not None,
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None, HAS_ROW_ORDER=row_order is not None,
        **constexprs, **options, **launch_kwargs(q, num_tokens),
    )
    if num_splits == 1:
        if out_scale is not None:
            per_head_quant(split_out, out, out_scale)
        return
    head_dim_pad = constexprs["HEAD_DIM_PAD"]
    quant = out_scale is not None
    _decode_reduce_kernel[(num_tokens, num_heads)](
        out, out_scale, part_out, part_max, part_sum, sinks, v_scale,
        out.stride(0), out.stride(1), out_scale.stride(0) if quant else 0, num_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
        SPLITS_PAD=next_power_of_2(num_splits), HAS_SINKS=sinks is not None,
        HAS_V_SCALE=v_scale is not None, QUANT=quant, OUT_DTYPE=TL_DTYPES[q.dtype],
        num_warps=4 if head_dim_pad >= 128 else 2, **launch_kwargs(q, num_tokens),
    )
