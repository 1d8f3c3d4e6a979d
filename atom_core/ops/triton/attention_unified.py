"""Triton paged attention for prefill and mixed batches (flash-attention style), and the tile loop
shared with the split-K decode kernel.

One program per (query block, kv head). A query block is up to ``BLOCK_Q`` consecutive query
tokens of one row, taken together with all ``GROUP = Hq // Hk`` query heads that read the same kv
head: the q tile has ``BLOCK_Q * GROUP`` live rows (row m = token ``m // GROUP``, head
``m % GROUP``), padded to ``BLOCK_M``, so each K/V page is loaded once for the whole group. The
program walks the keys the block can see, ``BLOCK_N`` at a time, looking each key's page up in
the row's block table, and keeps an online softmax (running max ``m``, sum ``l``, output ``acc``)
in fp32, in base 2 (logits are multiplied by log2(e) so ``exp2`` replaces ``exp``).

Query blocks are numbered across the batch without reading lengths on the host: row r's blocks
start at ``cu_seqlens_q[r] // BLOCK_Q + r``, so ``T // BLOCK_Q + B`` programs cover any batch of T
tokens in B rows; a program finds its row by binary search over ``cu_seqlens_q`` and exits when
its block lies past the row's end.

Legend: T = query tokens, B = rows, Hq / Hk = query / kv heads, D = head dim, BS = block size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.ops.dispatch import triton_interpret


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); saturates cleanly to +-1 when exp over/underflows.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def attend_key_range(
    acc, m_i, l_i, q, pos, kv_start, kv_end,
    k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    qk_scale, softcap, sliding_window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """Fold keys ``kv_start .. kv_end - 1`` of one row into the online softmax state.

    acc: fp32 [M, D_PAD]; m_i, l_i: fp32 [M] (base-2 running max and sum); q: [M, D_PAD];
    pos: int32 [M], position of each q row (a row sees keys j <= pos, and j > pos - W with a window);
    block_table_ptr: the row's block table. Returns the updated (acc, m_i, l_i).
    """
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    for start in range(kv_start, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        block = tl.load(block_table_ptr + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = (keys % PAGE_SIZE).to(tl.int64)
        k_rows = block * stride_kb + slot * stride_ks + kv_head * stride_kh  # [N]
        kt = tl.load(k_cache_ptr + k_rows[None, :] + offs_d[:, None], mask=d_ok[:, None] & key_ok[None, :],
                     other=0.0)  # K^T [D_PAD, N]
        if DOT_UPCAST:
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32))  # [M, N] fp32
        else:
            s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            s = softcap * _tanh(s * qk_scale / softcap) * 1.4426950408889634
        else:
            s = s * (qk_scale * 1.4426950408889634)
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 then so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = block * stride_vb + slot * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [N, D_PAD]
        if DOT_UPCAST:
            pv = tl.dot(p, v.to(tl.float32))
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    sinks_ptr, k_scale_ptr, v_scale_ptr, num_rows,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    scale, softcap, sliding_window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

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
    kv_end = context_len - q_len + last_token + 1
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(context_len - q_len + first_token - sliding_window + 1, 0)
        kv_start = (kv_start // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = attend_key_range(
        acc, m_i, l_i, q, pos, kv_start, kv_end,
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


def dot_options(dtype: torch.dtype) -> dict:
    """Constexprs for the kernels' tl.dot calls on inputs of ``dtype``.

    DOT_PRECISION: fp32 inputs keep full precision ("ieee"; TF32 would miss the fp32 tolerance).
    DOT_UPCAST: the CPU interpreter multiplies bf16 tiles wrongly, so there the tiles go to fp32.
    """
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                DOT_UPCAST=triton_interpret() and dtype == torch.bfloat16)


def _unified_config(head_dim_pad: int, dtype: torch.dtype, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the unified kernel.

    Chosen from sm90 builds: the largest tiles that compile without register spills. BLOCK_M
    grows to hold all q heads of a kv group when the group is larger.
    """
    if triton_interpret():
        return max(16, triton.next_power_of_2(group)), 16, 4, 1
    if dtype == torch.float32:  # no tensor-core path for full-precision fp32 dots
        block_m = max(32, triton.next_power_of_2(group))
        return block_m, 32 if head_dim_pad <= 128 and block_m == 32 else 16, 8, 1
    if head_dim_pad > 128:
        return max(64, triton.next_power_of_2(group)), 64 if group <= 64 else 32, 8, 2
    return max(128, triton.next_power_of_2(group)), 64 if group <= 128 else 32, 8, 2


def paged_attention_unified(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                            scale, sliding_window, logit_softcap, sinks, k_scale, v_scale, out):
    """Fill out [T, Hq, D] (arguments as ``atom_core.ops.paged_attention``); launch depends on shapes only."""
    num_tokens, num_heads, head_dim = q.shape
    num_rows = block_tables.shape[0]
    if num_tokens == 0 or num_rows == 0:
        return
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    head_dim_pad = max(triton.next_power_of_2(head_dim), 16)
    block_m, block_n, warps, stages = _unified_config(head_dim_pad, q.dtype, group)
    block_q = block_m // group
    grid = (num_tokens // block_q + num_rows, num_kv_heads)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
        sinks, k_scale, v_scale, num_rows,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        float(scale), float(logit_softcap), int(sliding_window or 0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, PAGE_SIZE=page_size,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logit_softcap > 0, HAS_SINKS=sinks is not None,
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None, **dot_options(q.dtype),
        num_warps=warps, num_stages=stages,
    )
