"""Triton DSA sparse attention (``mla_sparse_attention``): absorbed-form MLA over only the positions the
indexer selected, reading only those K cached rows per query token (O(K), not O(context)).

Around the kernel, as in ``mla_decode``: ``q_lat = q_nope @ w_uk`` and ``out = o_lat @ w_uv^T`` are torch
``bmm`` calls. The kernel:

* one program per (query token x head block, split); the q tile is BLOCK_H heads of the token,
  ``[q_lat, q_pe]`` (every head reads the same cached rows: one load of a row serves the whole block);
* it walks the token's ``topk_indices[t]`` entries BLOCK_N at a time: entry j is a position in the row's
  sequence; its row lives in block ``block_tables[row, j // BS]``, slot ``j % BS`` (one table lookup per
  entry, a gather). Entries -1 (and, defensively, positions past the query's causal window, which the op
  forbids) are neither read nor counted;
* the fold is ``mla_decode.fold_latent_tile`` (masked), the output / partials ``write_latent_output``;
  with several splits (the K entries cut into chunks of whole tiles) ``attention_decode``'s reduce kernel
  combines them.

Launch sized from shapes (T, H, K) and the SM count only: CUDA-graph capturable. An fp8 pool is read as
``row * kv_scale`` (logits and output scaled).

Legend: T = query tokens, B = rows, H = heads, K = selected positions per token, L = kv_lora_rank,
R = qk_rope_head_dim, S = splits, BS = block size.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_core.ops.dispatch import triton_interpret
from atom_core.ops.triton.attention_unified import dot_options
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, unit_stride
from atom_core.ops.triton.mla_decode import (MLAConfig, absorb_queries, choose_splits, default_config,
                                             expand_outputs, fold_latent_tile, latent_pads, launch_reduce, partials,
                                             row_of_token, write_latent_output)


@triton.jit
def _mla_sparse_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, o_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, topk_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, kv_scale_ptr,
    num_rows, num_heads, num_head_blocks, num_entries,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh, stride_it, stride_ik,
    stride_cb, stride_cs, stride_bt,
    scale,
    LATENT: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_KV_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # Axis 0 is (token, head block), head block fastest (axes 1 and 2 are capped at 65535 on CUDA).
    head_block = tl.program_id(0) % num_head_blocks
    token = tl.program_id(0) // num_head_blocks
    split = tl.program_id(1)
    row = row_of_token(cu_seqlens_q_ptr, token, num_rows)
    q_start = tl.load(cu_seqlens_q_ptr + row)
    q_len = tl.load(cu_seqlens_q_ptr + row + 1) - q_start
    context_len = tl.load(context_lens_ptr + row)
    pos = context_len - q_len + (token - q_start)
    limit = tl.where(context_len > 0, pos + 1, 0)  # a selected position must lie in 0 .. p

    offs_m = tl.arange(0, BLOCK_M)
    offs_l = tl.arange(0, LATENT_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    head = head_block * BLOCK_H + offs_m
    row_ok = (offs_m < BLOCK_H) & (head < num_heads)
    t = token.to(tl.int64) + offs_m * 0
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

    entries_per_split = tl.cdiv(tl.cdiv(num_entries, BLOCK_N), NUM_SPLITS) * BLOCK_N
    split_start = split * entries_per_split
    split_end = tl.minimum(split_start + entries_per_split, num_entries)
    entry_row = topk_ptr + token.to(tl.int64) * stride_it
    block_table_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(split_start, split_end, BLOCK_N):
        entries = start + offs_n
        position = tl.load(entry_row + entries * stride_ik, mask=entries < split_end, other=-1)
        key_ok = (position >= 0) & (position < limit)
        position = tl.where(key_ok, position, 0)
        block = tl.load(block_table_ptr + position // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        rows = block * stride_cb + (position % PAGE_SIZE).to(tl.int64) * stride_cs
        visible = key_ok[None, :] & (offs_m >= 0)[:, None]
        acc, m_i, l_i = fold_latent_tile(acc, m_i, l_i, q_lat, q_pe, cache_ptr, rows, key_ok, visible,
                                         qk_scale_log2, True, LATENT, LATENT_PAD, ROPE, ROPE_PAD, DOT_PRECISION,
                                         DOT_UPCAST)
    write_latent_output(acc, m_i, l_i, t, head, row_ok, o_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
                        kv_scale_ptr, split, num_heads, stride_ot, stride_oh, LATENT, LATENT_PAD, NUM_SPLITS,
                        HAS_KV_SCALE)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_params(num_heads: int, latent_dim: int, rope_dim: int, page_size: int, dtype: torch.dtype,
                   interpret: bool, device_index: int | None, config: MLAConfig | None) -> tuple[dict, dict]:
    """(constexprs, launch options) for one shape signature; cached, so a call does int math only."""
    latent_pad, rope_pad = latent_pads(latent_dim, rope_dim)
    if config is None:
        config = default_config(num_heads, latent_pad, dtype, interpret, device_index)
    constexprs = dict(LATENT=latent_dim, LATENT_PAD=latent_pad, ROPE=rope_dim, ROPE_PAD=rope_pad,
                      BLOCK_H=config.block_h, BLOCK_M=max(16, config.block_h), BLOCK_N=config.block_n,
                      PAGE_SIZE=page_size, **dot_options(dtype, interpret))
    return constexprs, dict(num_warps=config.num_warps, num_stages=config.num_stages)


def mla_sparse_attention(q_nope, q_pe, mla_cache, w_uk, w_uv, topk_indices, block_tables, cu_seqlens_q, context_lens,
                         max_seqlen_q, max_seqlen_k, scale, kv_scale, out, num_splits=None,
                         config: MLAConfig | None = None):
    """Fill out [T, H, Dv] (arguments as ``atom_core.ops.mla_sparse_attention``). num_splits / config
    override the split heuristic and the tile config (tests, benchmark sweeps)."""
    num_tokens, num_heads, _ = q_nope.shape
    num_rows, num_entries = block_tables.shape[0], topk_indices.shape[1]
    if num_tokens == 0:
        return
    if num_rows == 0 or num_entries == 0:
        out.zero_()
        return
    block_tables, cu_seqlens_q, context_lens = unit_stride(block_tables, cu_seqlens_q, context_lens)
    latent_dim, rope_dim = w_uk.shape[2], q_pe.shape[2]
    device_index = q_nope.device.index if q_nope.is_cuda else None
    constexprs, options = _launch_params(num_heads, latent_dim, rope_dim, mla_cache.shape[1], q_nope.dtype,
                                         triton_interpret(), device_index, config)
    num_head_blocks = cdiv(num_heads, constexprs["BLOCK_H"])
    if num_splits is None:
        # mla_decode's rule over the K entries: at 64 x top-k 2048 on an H200, 0.232 ms in one split against
        # 0.295 in three (benchmarks/results/h200_ops_dsa_probe.json).
        num_splits = choose_splits(num_tokens, num_head_blocks, constexprs["BLOCK_M"], num_entries, q_nope.device)
    q_lat = absorb_queries(q_nope, w_uk)                                          # [H, T, L]
    o_lat = torch.empty_like(q_lat)
    part_out, part_max, part_sum = partials(num_tokens, num_heads, num_splits, latent_dim, q_nope.device)
    _mla_sparse_kernel[(num_head_blocks * num_tokens, num_splits)](
        q_lat, q_pe, mla_cache, o_lat, part_out, part_max, part_sum, topk_indices,
        block_tables, cu_seqlens_q, context_lens, kv_scale,
        num_rows, num_heads, num_head_blocks, num_entries,
        q_lat.stride(1), q_lat.stride(0), q_pe.stride(0), q_pe.stride(1), o_lat.stride(1), o_lat.stride(0),
        topk_indices.stride(0), topk_indices.stride(1), mla_cache.stride(0), mla_cache.stride(1),
        block_tables.stride(0),
        float(scale), NUM_SPLITS=num_splits, HAS_KV_SCALE=kv_scale is not None, **constexprs, **options,
    )
    if num_splits > 1:
        launch_reduce(o_lat, part_out, part_max, part_sum, kv_scale, num_splits)
    expand_outputs(o_lat, w_uv, out)
