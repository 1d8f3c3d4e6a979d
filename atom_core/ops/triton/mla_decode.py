"""Triton MLA attention in the absorbed form (``mla_decode_attention``): multi-query attention of the latent
queries over the rows of the paged latent pool, split-K over the context (flash-decoding), and the tile
fold shared with DSA's sparse kernel (``dsa_sparse``).

The two small GEMMs around the kernel are torch ``bmm`` calls (cuBLAS / hipBLASLt are as good as it gets
for them): ``q_lat = q_nope @ w_uk`` per head ([H, T, Dn] x [H, Dn, L]) before, ``out = o_lat @ w_uv^T``
per head after. The kernel is the attention over the pool, which is where the bytes are:

* one program per (query block x head block, split). Its q tile holds BLOCK_H heads times the query
  tokens of the block (row m = token ``m // BLOCK_H``, head ``m % BLOCK_H``), ``[q_lat, q_pe]`` of
  L + R dims. Every head reads the same cached row (multi-query attention), so each latent tile
  ``[BLOCK_N, L + R]`` is loaded once per program and used twice: as keys (``q_lat . c_kv + q_pe . k_pe``)
  and, its first L columns, as values (``p @ c_kv``). The head blocks of one (row, split) are the
  fastest-varying grid axis, so they run side by side and share each row through L2.
* decode batches (every row's queries fit one block): one query block per row, its context cut into
  ``NUM_SPLITS`` chunks of whole tiles; the chunks' unnormalised outputs and base-2 max / sum go to fp32
  partials combined by ``attention_decode``'s reduce kernel. Longer queries (the op serves any layout):
  query blocks numbered from T and B as in ``attention_unified`` (row r's blocks start at
  ``cu_seqlens_q[r] // BLOCK_Q + r``), one split.
* key tiles as in ``attention_unified.attend_key_range``: *full* tiles (every live query sees every key)
  unmasked, *edge* tiles (causal diagonal, range end) masked; page lookups by ``_tile_rows``.

An fp8 pool holds ``row / kv_scale``: the logits are scaled by ``kv_scale`` (q . (row * s) = s q . row),
and so is the output. The launch depends only on shapes, ``max_seqlen_q`` / ``max_seqlen_k`` and the SM
count (CUDA-graph capturable); nothing is read on the host.

Legend: T = query tokens, B = rows, H = heads, L = kv_lora_rank, R = qk_rope_head_dim, Dn / Dv = nope /
value head dims, S = splits, BS = block size.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom_core.ops.dispatch import triton_interpret
from atom_core.ops.triton.attention_decode import (MAX_SPLITS, MIN_KEYS_PER_SPLIT, TL_DTYPES, _decode_reduce_kernel,
                                                  choose_num_splits)
from atom_core.ops.triton.attention_unified import _is_sm90, _tile_rows, dot_options
from atom_core.ops.triton.dependent_launch import launch_kwargs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2, num_sms, unit_stride

LOG2E = 1.4426950408889634


@triton.jit
def fold_latent_tile(
    acc, m_i, l_i, q_lat, q_pe, cache_ptr, rows, key_ok, visible, qk_scale_log2,
    MASKED: tl.constexpr, LATENT: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """Fold one tile of cached rows into the online softmax state (base 2) of every q row.

    acc: fp32 [M, L_PAD]; m_i, l_i: fp32 [M]; q_lat: [M, L_PAD]; q_pe: [M, R_PAD];
    rows: int64 [N], element offset of each key's row ``[c_kv | k_pe]`` in the pool;
    key_ok: bool [N], keys that may be loaded (the others read as 0);
    visible: bool [M, N] with MASKED (which q row counts which key; implies key_ok), unused otherwise:
    MASKED = False means every key is loadable and visible to every q row (no mask, no -inf guard).
    """
    offs_l = tl.arange(0, LATENT_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    c_ptrs = cache_ptr + rows[:, None] + offs_l[None, :]              # [N, L_PAD]: keys' latent = values
    pe_ptrs = cache_ptr + LATENT + rows[:, None] + offs_r[None, :]    # [N, R_PAD]: keys' rope part
    if MASKED:
        c = tl.load(c_ptrs, mask=key_ok[:, None] & (offs_l < LATENT)[None, :], other=0.0)
        pe = tl.load(pe_ptrs, mask=key_ok[:, None] & (offs_r < ROPE)[None, :], other=0.0)
    else:
        if LATENT == LATENT_PAD:
            c = tl.load(c_ptrs)
        else:
            c = tl.load(c_ptrs, mask=(offs_l < LATENT)[None, :], other=0.0)
        if ROPE == ROPE_PAD:
            pe = tl.load(pe_ptrs)
        else:
            pe = tl.load(pe_ptrs, mask=(offs_r < ROPE)[None, :], other=0.0)
    if DOT_UPCAST:
        c = c.to(tl.float32)
        s = tl.dot(q_lat.to(tl.float32), tl.trans(c))
        s = tl.dot(q_pe.to(tl.float32), tl.trans(pe.to(tl.float32)), s)
    else:
        c = c.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe.to(q_pe.dtype)), s, input_precision=DOT_PRECISION)  # [M, N]
    if MASKED:
        s = tl.where(visible, s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A q row that has seen no key yet keeps m = -inf; shift by 0 then so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
    else:
        # Scale folded into the exponent: max(c * s) = c * max(s) for c >= 0, and c * s - m is one FMA.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale_log2)
        m_shift = m_new
        p = tl.exp2(s * qk_scale_log2 - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if DOT_UPCAST:
        acc = tl.dot(p, c, acc)
    else:
        acc = tl.dot(p.to(c.dtype), c, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def write_latent_output(acc, m_i, l_i, t, head, row_ok, o_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
                        kv_scale_ptr, split, num_heads, stride_ot, stride_oh,
                        LATENT: tl.constexpr, LATENT_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        HAS_KV_SCALE: tl.constexpr):
    """One split: the normalised output o_lat[t, head] (times kv_scale). Several: the split's partials,
    [T, H, S] (max, sum) and [T, H, S, L] (unnormalised output), fp32 and contiguous."""
    offs_l = tl.arange(0, LATENT_PAD)
    store_ok = row_ok[:, None] & (offs_l < LATENT)[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l = 0: the row saw no key, acc is 0
        if HAS_KV_SCALE:
            out = out * tl.load(kv_scale_ptr)
        out_rows = t * stride_ot + head * stride_oh
        tl.store(o_ptr + out_rows[:, None] + offs_l[None, :], out.to(o_ptr.dtype.element_ty), mask=store_ok)
    else:
        part = (t * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * LATENT + offs_l[None, :], acc, mask=store_ok)


@triton.jit
def row_of_token(cu_seqlens_q_ptr, t, num_rows):
    """The row of token t: the last r with cu_seqlens_q[r] <= t (empty rows share their start with the next)."""
    lo = t * 0
    hi = t * 0 + num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        go_right = tl.load(cu_seqlens_q_ptr + mid) <= t
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


@triton.jit
def _mla_attention_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, o_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, kv_scale_ptr,
    num_rows, num_heads, num_head_blocks, num_q_blocks,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
    scale,
    LATENT: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, ROW_PER_BLOCK: tl.constexpr,
    HAS_KV_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # Axis 0 is (query block, head block), head block fastest (axes 1 and 2 are capped at 65535 on CUDA).
    head_block = tl.program_id(0) % num_head_blocks
    q_block = tl.program_id(0) // num_head_blocks
    split = tl.program_id(1)
    if ROW_PER_BLOCK:  # every row's queries fit one block: block r is row r
        row = q_block
        first_token = 0
    else:  # highest-numbered blocks (a row's last tokens, the longest) first
        q_block = num_q_blocks - 1 - q_block
        lo = q_block * 0
        hi = q_block * 0 + num_rows
        while lo < hi:  # the last r with cu_seqlens_q[r] // BLOCK_Q + r <= q_block
            mid = (lo + hi) // 2
            go_right = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= q_block
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(go_right, hi, mid)
        row = lo - 1
        first_token = (q_block - (tl.load(cu_seqlens_q_ptr + row) // BLOCK_Q + row)) * BLOCK_Q
    q_start = tl.load(cu_seqlens_q_ptr + row)
    q_len = tl.load(cu_seqlens_q_ptr + row + 1) - q_start
    if first_token >= q_len:
        return
    context_len = tl.load(context_lens_ptr + row)

    offs_m = tl.arange(0, BLOCK_M)
    offs_l = tl.arange(0, LATENT_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    token = first_token + offs_m // BLOCK_H  # index within the row's query tokens
    head = head_block * BLOCK_H + offs_m % BLOCK_H
    row_ok = (offs_m < BLOCK_Q * BLOCK_H) & (token < q_len) & (head < num_heads)
    pos = context_len - q_len + token
    t = (q_start + token).to(tl.int64)
    q_lat = tl.load(q_lat_ptr + (t * stride_qlt + head * stride_qlh)[:, None] + offs_l[None, :],
                    mask=row_ok[:, None] & (offs_l < LATENT)[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + (t * stride_qpt + head * stride_qph)[:, None] + offs_r[None, :],
                   mask=row_ok[:, None] & (offs_r < ROPE)[None, :], other=0.0)

    qk_scale_log2 = scale * 1.4426950408889634
    if HAS_KV_SCALE:
        qk_scale_log2 = qk_scale_log2 * tl.load(kv_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_PAD], tl.float32)

    # Keys the block's queries can see: 0 .. pos_hi; all of them see 0 .. pos_lo. An empty context
    # (padding row) sees none.
    last_token = tl.minimum(first_token + BLOCK_Q, q_len) - 1
    pos_lo = context_len - q_len + first_token
    kv_end = tl.where(context_len > 0, tl.maximum(context_len - q_len + last_token + 1, 0), 0)
    # This split's share, in whole BLOCK_N tiles (a split past the end gets an empty range).
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS)
    split_start = split * tiles_per_split * BLOCK_N
    split_end = tl.minimum(split_start + tiles_per_split * BLOCK_N, kv_end)
    full_end = tl.minimum(tl.minimum(tl.maximum(pos_lo + 1, 0) // BLOCK_N, kv_end // BLOCK_N) * BLOCK_N, split_end)
    block_table_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(split_start, full_end, BLOCK_N):
        rows, _ = _tile_rows(block_table_ptr, start, kv_end, 0, stride_cb, stride_cs, 0, stride_cb, stride_cs, 0,
                             BLOCK_N, PAGE_SIZE, False)
        acc, m_i, l_i = fold_latent_tile(acc, m_i, l_i, q_lat, q_pe, cache_ptr, rows, offs_n >= 0, None,
                                         qk_scale_log2, False, LATENT, LATENT_PAD, ROPE, ROPE_PAD, DOT_PRECISION,
                                         DOT_UPCAST)
    for start in range(tl.maximum(full_end, split_start), split_end, BLOCK_N):
        keys = start + offs_n
        key_ok = keys < kv_end
        rows, _ = _tile_rows(block_table_ptr, start, kv_end, 0, stride_cb, stride_cs, 0, stride_cb, stride_cs, 0,
                             BLOCK_N, PAGE_SIZE, True)
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        acc, m_i, l_i = fold_latent_tile(acc, m_i, l_i, q_lat, q_pe, cache_ptr, rows, key_ok, visible,
                                         qk_scale_log2, True, LATENT, LATENT_PAD, ROPE, ROPE_PAD, DOT_PRECISION,
                                         DOT_UPCAST)
    write_latent_output(acc, m_i, l_i, t, head, row_ok, o_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
                        kv_scale_ptr, split, num_heads, stride_ot, stride_oh, LATENT, LATENT_PAD, NUM_SPLITS,
                        HAS_KV_SCALE)


class MLAConfig(NamedTuple):
    """Tile shape and launch options of the absorbed kernels."""

    block_h: int  # heads per program (all of them read each cached row once)
    block_n: int  # cached rows per tile
    num_warps: int
    num_stages: int


# The q tile and the fp32 accumulator are [rows, L] each (L = 512 for DeepSeek): rows of the q tile
# (query tokens x heads of a program) stay at or below this on a GPU.
MAX_TILE_ROWS = 64


def default_config(num_heads: int, latent_pad: int, dtype: torch.dtype, interpret: bool,
                   device_index: int | None = None) -> MLAConfig:
    """The config the absorbed kernels launch with (bf16/fp16 on a GPU: from the H200 sweeps below)."""
    if interpret or dtype == torch.float32:
        return MLAConfig(min(next_power_of_2(num_heads), 16), 16, 4, 1)
    # bf16/fp16: [64, 512] q and fp32 accumulator over 8 warps, latent tiles double-buffered. On Hopper,
    # [64, 576] tiles: the q tile and two of them are 221 KB of shared memory (of sm90's 227), and wgmma
    # runs both dots; bs 64 x 4k with DeepSeek-V3 heads took 0.299 ms against 0.421 for [32, 576] tiles,
    # and DSA's sparse kernel at 32k / top-k 2048 0.297 against 0.384 (benchmarks/results/h200_ops_mla_probe.json;
    # 16 warps, 128 heads a program and 3 stages were slower or did not compile). Elsewhere [32, 576]
    # tiles, 147 KB (the fastest of the first `python -m benchmarks.ops_mla --sweep`, 24 configs of 16- and
    # 32-row tiles).
    wide = num_heads >= 64
    block_n = 32 if latent_pad <= 512 else 16
    if wide and latent_pad <= 512 and device_index is not None and _is_sm90(device_index):
        block_n = 64
    return MLAConfig(min(next_power_of_2(num_heads), MAX_TILE_ROWS), block_n, 8 if wide else 4, 2)


def choose_splits(num_rows: int, num_head_blocks: int, block_m: int, max_seqlen_k: int, device: torch.device) -> int:
    """Splits per row of a decode batch.

    A q tile of 64 rows or more (its [64, 512] fp32 accumulator over 8 warps takes the whole register file:
    one program per SM) gets as many splits as fill one wave of programs, never more. At 4k with DeepSeek-V3
    heads on an H200, bs 64 (128 programs) took 0.297 ms in one split against 0.334 in three, bs 8 0.071 in
    8 against 0.088 in 17 (benchmarks/results/h200_ops_mla_splits.json). Smaller tiles:
    ``attention_decode.choose_num_splits``."""
    if block_m < MAX_TILE_ROWS or device.type != "cuda":
        return choose_num_splits(num_rows, num_head_blocks, max_seqlen_k, device)
    fit = num_sms(device.index or 0) // max(num_rows * num_head_blocks, 1)
    return max(1, min(fit, cdiv(max(max_seqlen_k, 1), MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def latent_pads(latent_dim: int, rope_dim: int) -> tuple[int, int]:
    """Register widths of the latent and rope parts (tl.dot needs K >= 16)."""
    return max(next_power_of_2(latent_dim), 16), max(next_power_of_2(rope_dim), 16)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_params(num_heads: int, latent_dim: int, rope_dim: int, page_size: int, max_seqlen_q: int,
                   dtype: torch.dtype, interpret: bool, device_index: int | None,
                   config: MLAConfig | None) -> tuple[dict, dict]:
    """(constexprs, launch options) for one shape signature; cached, so a call does int math only."""
    latent_pad, rope_pad = latent_pads(latent_dim, rope_dim)
    if config is None:
        config = default_config(num_heads, latent_pad, dtype, interpret, device_index)
    block_h = config.block_h
    row_per_block = next_power_of_2(max(max_seqlen_q, 1)) * block_h <= max(MAX_TILE_ROWS, block_h)
    block_q = next_power_of_2(max(max_seqlen_q, 1)) if row_per_block else max(1, MAX_TILE_ROWS // block_h)
    block_m = max(16, next_power_of_2(block_q * block_h))
    constexprs = dict(LATENT=latent_dim, LATENT_PAD=latent_pad, ROPE=rope_dim, ROPE_PAD=rope_pad, BLOCK_H=block_h,
                      BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=config.block_n, PAGE_SIZE=page_size,
                      ROW_PER_BLOCK=row_per_block, **dot_options(dtype, interpret))
    return constexprs, dict(num_warps=config.num_warps, num_stages=config.num_stages)


def launch_reduce(o_lat, part_out, part_max, part_sum, kv_scale, num_splits):
    """Combine the splits' partials into o_lat (``attention_decode``'s reduce: one program per token and head)."""
    num_heads, num_tokens, latent_dim = o_lat.shape  # o_lat is [H, T, L]
    latent_pad = max(next_power_of_2(latent_dim), 16)
    _decode_reduce_kernel[(num_tokens, num_heads)](
        o_lat, None, part_out, part_max, part_sum, None, kv_scale,
        o_lat.stride(1), o_lat.stride(0), 0, num_heads,
        HEAD_DIM=latent_dim, HEAD_DIM_PAD=latent_pad, NUM_SPLITS=num_splits, SPLITS_PAD=next_power_of_2(num_splits),
        HAS_SINKS=False, HAS_V_SCALE=kv_scale is not None, QUANT=False, OUT_DTYPE=TL_DTYPES[o_lat.dtype],
        num_warps=4 if latent_pad >= 128 else 2, **launch_kwargs(o_lat, num_tokens),
    )


def absorb_queries(q_nope, w_uk):
    """q_lat [H, T, L] = q_nope[:, h] @ w_uk[h] per head (one batched GEMM, fp32 accumulation, q's dtype)."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk)


def expand_outputs(o_lat, w_uv, out):
    """out[t, h] = w_uv[h] @ o_lat[h, t] (one batched GEMM: [H, T, L] x [H, L, Dv]), written into out [T, H, Dv]."""
    out.copy_(torch.bmm(o_lat, w_uv.transpose(1, 2)).transpose(0, 1))


def partials(num_tokens, num_heads, num_splits, latent_dim, device):
    """fp32 (output [T, H, S, L], max [T, H, S], sum [T, H, S]) of the splits, or Nones for one split."""
    if num_splits == 1:
        return None, None, None
    part_out = torch.empty(num_tokens, num_heads, num_splits, latent_dim, dtype=torch.float32, device=device)
    part_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device)
    return part_out, part_max, torch.empty_like(part_max)


def mla_decode_attention(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                         max_seqlen_k, scale, kv_scale, out, num_splits=None, config: MLAConfig | None = None):
    """Fill out [T, H, Dv] (arguments as ``atom_core.ops.mla_decode_attention``).

    num_splits / config override the split heuristic and the tile config (tests, benchmark sweeps);
    several splits are used only when every row's queries fit one block (decode batches).
    """
    num_tokens, num_heads, _ = q_nope.shape
    num_rows = block_tables.shape[0]
    if num_tokens == 0:
        return
    if num_rows == 0:
        out.zero_()
        return
    block_tables, cu_seqlens_q, context_lens = unit_stride(block_tables, cu_seqlens_q, context_lens)
    latent_dim, rope_dim = w_uk.shape[2], q_pe.shape[2]
    device_index = q_nope.device.index if q_nope.is_cuda else None
    constexprs, options = _launch_params(num_heads, latent_dim, rope_dim, mla_cache.shape[1], max_seqlen_q,
                                         q_nope.dtype, triton_interpret(), device_index, config)
    num_head_blocks = cdiv(num_heads, constexprs["BLOCK_H"])
    if constexprs["ROW_PER_BLOCK"]:
        num_q_blocks = num_rows
        if num_splits is None:
            num_splits = choose_splits(num_rows, num_head_blocks, constexprs["BLOCK_M"], max_seqlen_k, q_nope.device)
    else:
        num_q_blocks = num_tokens // constexprs["BLOCK_Q"] + num_rows
        num_splits = 1
    q_lat = absorb_queries(q_nope, w_uk)                                          # [H, T, L]
    o_lat = torch.empty_like(q_lat)                                               # [H, T, L]
    part_out, part_max, part_sum = partials(num_tokens, num_heads, num_splits, latent_dim, q_nope.device)
    _mla_attention_kernel[(num_head_blocks * num_q_blocks, num_splits)](
        q_lat, q_pe, mla_cache, o_lat, part_out, part_max, part_sum,
        block_tables, cu_seqlens_q, context_lens, kv_scale,
        num_rows, num_heads, num_head_blocks, num_q_blocks,
        q_lat.stride(1), q_lat.stride(0), q_pe.stride(0), q_pe.stride(1), o_lat.stride(1), o_lat.stride(0),
        mla_cache.stride(0), mla_cache.stride(1), block_tables.stride(0),
        float(scale), NUM_SPLITS=num_splits, HAS_KV_SCALE=kv_scale is not None, **constexprs, **options,
    )
    if num_splits > 1:
        launch_reduce(o_lat, part_out, part_max, part_sum, kv_scale, num_splits)
    expand_outputs(o_lat, w_uv, out)
