"""Triton paged attention for prefill and mixed batches (flash-attention style), and the tile loop
shared with the split-K decode kernel.

One program per (query block, kv head). A query block is up to ``BLOCK_Q`` consecutive query
tokens of one row, taken together with all ``GROUP = Hq // Hk`` query heads that read the same kv
head: the q tile has ``BLOCK_Q * GROUP`` live rows (row m = token ``m // GROUP``, head
``m % GROUP``), padded to ``BLOCK_M``, so each K/V page is loaded once for the whole group. The
program walks the keys the block can see, ``BLOCK_N`` at a time, and keeps an online softmax
(running max ``m``, sum ``l``, output ``acc``) in fp32, in base 2 (logits carry a factor log2(e)
so ``exp2`` replaces ``exp``).

Key tiles are of two kinds (``attend_key_range``): *full* tiles, whose every key every live q row
sees, run with no mask at all; *edge* tiles (the causal diagonal, the start of a sliding window,
the end of the range) mask. A long causal prefill is almost all full tiles. Each tile finds its
keys' slots in the row's block table with one load per page when the page size divides
``BLOCK_N`` (one per tile when ``BLOCK_N`` divides the page size; one per key otherwise).

Query blocks are numbered across the batch without reading lengths on the host: row r's blocks
start at ``cu_seqlens_q[r] // BLOCK_Q + r``, so ``T // BLOCK_Q + B`` blocks cover any batch of T
tokens in B rows; a program finds its row by binary search over ``cu_seqlens_q`` and exits when
its block lies past the row's end. Programs run the highest-numbered blocks (a row's last tokens,
which see the most keys) first, so the long ones do not straggle at the end of the grid.

Legend: T = query tokens, B = rows, Hq / Hk = query / kv heads, D = head dim, BS = block size.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom_core.ops.dispatch import triton_interpret
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, next_power_of_2, unit_stride


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); saturates cleanly to +-1 when exp over/underflows.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def fp16_scales(amax):
    """(2**e, 2**-e) for the power of two 2**e that puts ``amax`` in [2**14, 2**15) (fp16's largest is 65504)."""
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax)); -127 for 0
    e = tl.minimum(tl.maximum(14 - exponent, -113), 126)
    return ((e + 127) << 23).to(tl.float32, bitcast=True), ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def tile_amax(x):
    """max |x| over a 2D tile, fp32."""
    return tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0)


@triton.jit
def fp16_queries(q):
    """q [M, D] (bf16) as fp16 times 2**e, and 2**-e (``fp16_scales`` of max |q|).

    Over an fp8 pool the dots run in fp16: e4m3 widens to fp16 in one instruction a pair (to bf16 it takes
    three). Nothing is rounded: a power of two scales exactly, and fp16 holds bf16's 8 significant bits over
    the 2**28 range below the tile's largest value; fp8 values are exact in fp16, and p in [0, 1] keeps 11
    bits instead of 8. The caller folds 2**-e into the logits' scale.
    """
    up, down = fp16_scales(tile_amax(q))
    return (q.to(tl.float32) * up).to(tl.float16), down


@triton.jit
def _tile_rows(block_table_ptr, start, kv_end, kv_head,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Element offsets (int64 [BLOCK_N]) of keys ``start .. start + BLOCK_N - 1`` in the K and V caches.

    ``start`` is a multiple of BLOCK_N. Key j lives in block ``block_table[j // BS]``, slot ``j % BS``.
    With MASKED, keys >= kv_end may lie past the row's last page: their page is not looked up
    (block 0 stands in; the caller masks those keys' loads).
    """
    offs_n = tl.arange(0, BLOCK_N)
    if PAGE_SIZE % BLOCK_N == 0:
        # The tile lies inside one page: one block id, consecutive slots.
        block = tl.load(block_table_ptr + start // PAGE_SIZE).to(tl.int64)
        slot = (start % PAGE_SIZE + offs_n).to(tl.int64)
        k_rows = block * stride_kb + slot * stride_ks
        v_rows = block * stride_vb + slot * stride_vs
    elif BLOCK_N % PAGE_SIZE == 0:
        # BLOCK_N // BS whole pages: one block id per page, broadcast over its BS slots.
        page = start // PAGE_SIZE + tl.arange(0, BLOCK_N // PAGE_SIZE)
        if MASKED:
            block = tl.load(block_table_ptr + page, mask=page * PAGE_SIZE < kv_end, other=0)
        else:
            block = tl.load(block_table_ptr + page)
        # Reshape the ids, not the offsets: the compiler's alignment analysis stops at a reshape, and
        # the strides multiplied in afterwards keep the rows provably 16-element aligned (vector loads).
        block = tl.reshape(tl.broadcast_to(block[:, None], [BLOCK_N // PAGE_SIZE, PAGE_SIZE]), [BLOCK_N])
        block = block.to(tl.int64)
        slot = (offs_n % PAGE_SIZE).to(tl.int64)
        k_rows = block * stride_kb + slot * stride_ks
        v_rows = block * stride_vb + slot * stride_vs
    else:
        keys = start + offs_n
        if MASKED:
            block = tl.load(block_table_ptr + keys // PAGE_SIZE, mask=keys < kv_end, other=0).to(tl.int64)
        else:
            block = tl.load(block_table_ptr + keys // PAGE_SIZE).to(tl.int64)
        slot = (keys % PAGE_SIZE).to(tl.int64)
        k_rows = block * stride_kb + slot * stride_ks
        v_rows = block * stride_vb + slot * stride_vs
    return k_rows + kv_head * stride_kh, v_rows + kv_head * stride_vh


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, pos, start, kv_end,
    k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    qk_scale_log2, softcap_log2, cap_scale, sliding_window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """Fold the tile of keys ``start .. start + BLOCK_N - 1`` into the online softmax state.

    MASKED = False: every key is < kv_end and visible to every q row (no mask, no -inf guard).
    MASKED = True: key j counts for row m when ``j < kv_end``, ``j <= pos[m]`` and, with a window,
    ``j > pos[m] - W``; keys >= kv_end are not loaded (K and V read as 0).
    """
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < kv_end
    k_rows, v_rows = _tile_rows(block_table_ptr, start, kv_end, kv_head,
                                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                BLOCK_N, PAGE_SIZE, MASKED)
    kt_ptrs = k_cache_ptr + k_rows[None, :] + offs_d[:, None]  # K^T [D_PAD, N]
    v_ptrs = v_cache_ptr + v_rows[:, None] + offs_d[None, :]  # [N, D_PAD]
    if MASKED:
        kt = tl.load(kt_ptrs, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        kt = tl.load(kt_ptrs)
    else:
        kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
    if DOT_UPCAST:
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32))  # [M, N] fp32
    else:
        s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION)

    if HAS_SOFTCAP:
        s = softcap_log2 * _tanh(s * cap_scale)  # log2(e) * c * tanh(scale * q.k / c)
    if MASKED:
        if not HAS_SOFTCAP:
            s = s * qk_scale_log2
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 then so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
    elif HAS_SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_shift = m_new
        p = tl.exp2(s - m_shift[:, None])
    else:
        # Scale folded into the exponent: max(c * s) = c * max(s) for c >= 0, and c * s - m is one FMA.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale_log2)
        m_shift = m_new
        p = tl.exp2(s * qk_scale_log2 - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]

    if MASKED:
        v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    if DOT_UPCAST:
        acc = tl.dot(p, v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def attend_key_range(
    acc, m_i, l_i, q, pos, pos_lo, pos_hi, kv_start, kv_end,
    k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    qk_scale, softcap, sliding_window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """Fold keys ``kv_start .. kv_end - 1`` of one row into the online softmax state.

    acc: fp32 [M, D_PAD]; m_i, l_i: fp32 [M] (base-2 running max and sum); q: [M, D_PAD];
    pos: int32 [M], position of each q row (a row sees keys j <= pos, and j > pos - W with a window);
    pos_lo, pos_hi: the least and greatest position of the live rows; kv_start: a multiple of
    BLOCK_N; block_table_ptr: the row's block table; qk_scale >= 0. Returns (acc, m_i, l_i).

    Every live row sees key j when ``pos_hi - W < j <= pos_lo``: the whole tiles inside that span
    (and inside the range) are full tiles; the tiles before them (window start) and after them
    (diagonal, range end) are edge tiles. Padded rows (past the row's tokens) may see other keys;
    their output is never stored.
    """
    qk_scale_log2 = qk_scale * 1.4426950408889634
    softcap_log2 = softcap * 1.4426950408889634
    cap_scale = qk_scale
    if HAS_SOFTCAP:
        cap_scale = qk_scale / softcap
    full_lo = kv_start
    full_hi = tl.minimum((pos_lo + 1) // BLOCK_N, kv_end // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        full_lo = tl.maximum(tl.cdiv(tl.maximum(pos_hi - sliding_window + 1, 0), BLOCK_N) * BLOCK_N, kv_start)
        for start in range(kv_start, tl.minimum(full_lo, kv_end), BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, pos, start, kv_end, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                qk_scale_log2, softcap_log2, cap_scale, sliding_window,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, True, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, DOT_UPCAST)
    for start in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, pos, start, kv_end, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            qk_scale_log2, softcap_log2, cap_scale, sliding_window,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, False, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, DOT_UPCAST)
    for start in range(tl.maximum(full_lo, full_hi), kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, pos, start, kv_end, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            qk_scale_log2, softcap_log2, cap_scale, sliding_window,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, True, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, DOT_UPCAST)
    return acc, m_i, l_i


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    sinks_ptr, k_scale_ptr, v_scale_ptr, num_rows, num_kv_heads, num_q_blocks,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    scale, softcap, sliding_window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    FP16_DOTS: tl.constexpr,
):
    # Program p: kv head p % Hk of query block (num_q_blocks - 1 - p // Hk), the last blocks first.
    pid = tl.program_id(0)
    kv_head = pid % num_kv_heads
    q_block = num_q_blocks - 1 - pid // num_kv_heads

    # Row of this block: the last r with cu_seqlens_q[r] // BLOCK_Q + r <= q_block.
    lo = q_block * 0
    hi = q_block * 0 + num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        go_right = first_block <= q_block
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    row = lo - 1

    q_start = tl.load(cu_seqlens_q_ptr + row)
    q_len = tl.load(cu_seqlens_q_ptr + row + 1) - q_start
    first_token = (q_block - (q_start // BLOCK_Q + row)) * BLOCK_Q
    if first_token >= q_len:
        return
    context_len = tl.load(context_lens_ptr + row)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    token = first_token + offs_m // GROUP  # index within the row's query tokens
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (token < q_len)
    d_ok = offs_d < HEAD_DIM
    pos = context_len - q_len + token

    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    qk_scale = scale
    if HAS_K_SCALE:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if FP16_DOTS:
        q, q_unscale = fp16_queries(q)
        qk_scale = qk_scale * q_unscale
    if HAS_SINKS:
        # The sink is one more logit in the denominator: start the softmax state at it.
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # Keys this block can see: up to the last token's position; from the first token's window start.
    last_token = tl.minimum(first_token + BLOCK_Q, q_len) - 1
    pos_lo = context_len - q_len + first_token
    pos_hi = context_len - q_len + last_token
    kv_start = 0
    if HAS_WINDOW:
        kv_start = (tl.maximum(pos_lo - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = attend_key_range(
        acc, m_i, l_i, q, pos, pos_lo, pos_hi, kv_start, pos_hi + 1,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + row.to(tl.int64) * stride_bt, kv_head,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, softcap, sliding_window,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, DOT_UPCAST,
    )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l = 0: no key and no sink, acc is 0
    if HAS_V_SCALE:
        out = out * tl.load(v_scale_ptr)
    out_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def dot_options(dtype: torch.dtype, interpret: bool) -> dict:
    """Constexprs for the kernels' tl.dot calls on inputs of ``dtype``.

    DOT_PRECISION: fp32 inputs keep full precision ("ieee"; TF32 would miss the fp32 tolerance).
    DOT_UPCAST: the CPU interpreter multiplies bf16 tiles wrongly, so there the tiles go to fp32.
    """
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                DOT_UPCAST=interpret and dtype == torch.bfloat16)


def fp16_dots(q_dtype: torch.dtype, cache_itemsize: int) -> bool:
    """Whether bf16 queries over a pool of ``cache_itemsize``-byte elements take fp16 dots (``fp16_queries``):
    fp8 pools.

    The GQA kernels only. On an H200 the split-K decode over an fp8 pool took 0.114 against 0.130 ms at
    256 rows x 1k context (Qwen3-30B-A3B heads), 0.262 against 0.299 at 64 x 4k (Llama-3-8B heads), the
    unified kernel 0.262 against 0.318 at 4 rows x 512 tokens over 2k cached; the MLA
    kernels, whose [64, 512] q tile already takes every register, were slower with it (64 x 4k with DeepSeek-V3
    heads 0.491 against 0.438 ms) and keep bf16 dots."""
    return q_dtype == torch.bfloat16 and cache_itemsize == 1


class TileConfig(NamedTuple):
    """Tile shape and launch options of the unified kernel. BLOCK_M grows to hold a whole kv group."""

    block_m: int  # q tile rows (query tokens x q heads of one kv head)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


# Hopper (sm90), fp16/bf16, D <= 128: chosen by benchmarks/attention_prefill_sweep.py on an H200
# (causal bf16 prefill of 4k-16k tokens, Qwen3-0.6B and Llama-3-8B heads: ~400 TFLOP/s at 16k,
# 1.2-1.3x SDPA's flash backend; 128x64 tiles reached ~340).
SM90_HALF_CONFIG = TileConfig(128, 128, 8, 3)
# Other GPUs: the config that compiled without spills on sm90 before the sweep, within 100 KB of shared memory.
GENERIC_HALF_CONFIG = TileConfig(128, 64, 8, 2)


@functools.lru_cache(maxsize=None)
def _is_sm90(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] == 9


def default_config(head_dim_pad: int, dtype: torch.dtype, group: int, interpret: bool,
                   device_index: int | None) -> TileConfig:
    """The tile config the unified kernel launches with (before BLOCK_M grows to fit ``group``)."""
    if interpret:
        return TileConfig(16, 16, 4, 1)
    if dtype == torch.float32:  # no tensor-core path for full-precision fp32 dots
        block_m = max(32, next_power_of_2(group))
        return TileConfig(32, 32 if head_dim_pad <= 128 and block_m == 32 else 16, 8, 1)
    if head_dim_pad > 128:
        return TileConfig(64, 64 if group <= 64 else 32, 8, 2)
    if group > 128:
        return TileConfig(128, 32, 8, 2)
    return SM90_HALF_CONFIG if device_index is not None and _is_sm90(device_index) else GENERIC_HALF_CONFIG


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_params(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                   cache_itemsize: int, interpret: bool, device_index: int | None,
                   config: TileConfig | None) -> tuple[dict, dict, int]:
    """(constexprs, launch options, BLOCK_Q) for one shape signature; cached, so a call does int math only."""
    group = num_heads // num_kv_heads
    head_dim_pad = max(next_power_of_2(head_dim), 16)
    if config is None:
        config = default_config(head_dim_pad, dtype, group, interpret, device_index)
    block_m = max(config.block_m, next_power_of_2(group))
    block_q = block_m // group
    constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
                      BLOCK_N=config.block_n, PAGE_SIZE=page_size, FP16_DOTS=fp16_dots(dtype, cache_itemsize),
                      **dot_options(dtype, interpret))
    return constexprs, dict(num_warps=config.num_warps, num_stages=config.num_stages), block_q


def paged_attention_unified(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                            scale, sliding_window, logit_softcap, sinks, k_scale, v_scale, out,
                            config: TileConfig | None = None):
    """Fill out [T, Hq, D] (arguments as ``atom_core.ops.paged_attention``); launch depends on shapes only.

    config: a TileConfig to launch with instead of the default (benchmark sweeps, tests).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_rows = block_tables.shape[0]
    if num_tokens == 0 or num_rows == 0:
        return
    block_tables, cu_seqlens_q, context_lens, sinks = unit_stride(block_tables, cu_seqlens_q, context_lens, sinks)
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    constexprs, options, block_q = _launch_params(num_heads, num_kv_heads, head_dim, page_size, q.dtype,
                                                  k_cache.element_size(), triton_interpret(),
                                                  q.device.index if q.is_cuda else None, config)
    num_q_blocks = num_tokens // block_q + num_rows
    _unified_attention_kernel[(num_q_blocks * num_kv_heads,)](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
        sinks, k_scale, v_scale, num_rows, num_kv_heads, num_q_blocks,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        float(scale), float(logit_softcap), int(sliding_window or 0),
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logit_softcap > 0, HAS_SINKS=sinks is not None,
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None, **constexprs, **options,
    )
