"""Triton RoPE and KV-cache write in one launch: ``apply_rope_`` on q and k, then ``store_kv_`` of k and v.

Each program takes BLOCK_T tokens: it rotates their q and k heads in place with ``rope._rope_tokens`` (the
arithmetic of the RoPE kernel), waits for its own threads at a barrier, and writes their K rows (read back
rotated, dims past the rotary ones included) and V rows to their slots with ``kv_cache._store_tokens`` (that
of the KV-store kernel). So the result is the bits of the two launches, one kernel's fixed cost less.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.triton import kv_cache as triton_kv_cache
from atom_core.ops.triton import rope as triton_rope
from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.kv_cache import _store_tokens
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv
from atom_core.ops.triton.rope import _rope_tokens


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_tokens, num_q_heads, num_k_heads, head_size, num_positions, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pos, stride_cos_sin, stride_slot,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr, FP8: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tokens < num_tokens
    _rope_tokens(q_ptr, k_ptr, pos_ptr, cos_sin_ptr, tokens, in_range, num_q_heads, num_k_heads, num_positions,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_pos, stride_cos_sin,
                 HALF, BLOCK_HALF, BLOCK_HQ, BLOCK_HK, IS_NEOX)
    tl.debug_barrier()  # the rotated k, stored by other threads of this program, is read back below
    _store_tokens(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, tokens, in_range,
                  num_k_heads, head_size, block_size, stride_slot, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, FP8, BLOCK_H, BLOCK_D)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_config(num_tokens: int, num_q_heads: int, num_k_heads: int, head_size: int, half: int):
    """(grid, BLOCK_T, num_warps, RoPE constexprs, store constexprs): the tiles of the two kernels, with the
    tokens per program and the warps that fit both."""
    _, block_half, rope_t, block_hq, block_hk, rope_warps = triton_rope._launch_config(
        num_tokens, num_q_heads, num_k_heads, half)
    _, store_t, block_h, block_d, store_warps = triton_kv_cache._launch_config(num_tokens, num_k_heads, head_size)
    block_t = min(rope_t, store_t)
    return ((cdiv(num_tokens, block_t),), block_t, max(rope_warps, store_warps),
            dict(HALF=half, BLOCK_HALF=block_half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk),
            dict(BLOCK_H=block_h, BLOCK_D=block_d))


def rope_store_kv_(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale):
    num_tokens, num_q_heads, _ = q.shape
    _, num_k_heads, head_size = k.shape
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype == FP8_DTYPE
    grid, block_t, num_warps, rope_tiles, store_tiles = _launch_config(
        num_tokens, num_q_heads, num_k_heads, head_size, cos_sin_cache.shape[1] // 2)
    _rope_store_kv_kernel[grid](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,  # unread unless FP8
        num_tokens, num_q_heads, num_k_heads, head_size, cos_sin_cache.shape[0], k_cache.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), positions.stride(0),
        cos_sin_cache.stride(0), slot_mapping.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        IS_NEOX=bool(is_neox), FP8=fp8, BLOCK_T=block_t, num_warps=num_warps, **rope_tiles, **store_tiles,
        **launch_kwargs(q, num_tokens),
    )
