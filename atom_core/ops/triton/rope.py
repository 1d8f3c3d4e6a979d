"""Triton rotary embedding, in place on q and k.

One program takes BLOCK_T tokens: it gathers their cos/sin rows once, then walks the query heads
and the key heads in chunks of [BLOCK_T, BLOCK_H, R/2] pairs, fp32 math. Token and head strides
are arguments, so q and k can be views into a fused qkv buffer; the head dim must be contiguous.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2

# Pairs (a, b) per program and per tile half: big enough to keep loads wide, small enough for registers.
_PAIRS_PER_TILE = 2048


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, num_heads, tokens, t_mask, cos, sin,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr):
    """Rotate the pairs of heads [0, num_heads) of the tokens ``tokens`` (int64 [BLOCK_T])."""
    cols = tl.arange(0, BLOCK_HALF)
    c_mask = cols < HALF
    token_base = tokens[:, None, None] * stride_t  # int64: token * stride can exceed 2**31
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        base = token_base + heads[None, :, None].to(tl.int64) * stride_h
        mask = t_mask[:, None, None] & (heads < num_heads)[None, :, None] & c_mask[None, None, :]
        if IS_NEOX:
            a_ptr = x_ptr + base + cols[None, None, :]  # dim i pairs with dim i + R/2
            b_ptr = a_ptr + HALF
        else:
            a_ptr = x_ptr + base + 2 * cols[None, None, :]  # dim 2i pairs with dim 2i + 1
            b_ptr = a_ptr + 1
        a = tl.load(a_ptr, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(a_ptr, (a * cos - b * sin).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(b_ptr, (b * cos + a * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_tokens(q_ptr, k_ptr, pos_ptr, cache_ptr, tokens, t_mask, num_q_heads, num_k_heads, num_positions,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_pos, stride_cache,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 IS_NEOX: tl.constexpr):
    """Rotate every q and k head of the tokens ``tokens`` (int64 [BLOCK_T]) by their positions, in place."""
    pos = tl.load(pos_ptr + tokens * stride_pos, mask=t_mask, other=0).to(tl.int64)
    # A position outside the table is not read (its rows rotate by cos = sin = 0) rather than
    # faulting; the public function documents positions in [0, P).
    row_ok = t_mask & (pos >= 0) & (pos < num_positions)
    cols = tl.arange(0, BLOCK_HALF)
    cs_mask = row_ok[:, None] & (cols < HALF)[None, :]
    cs_ptr = cache_ptr + pos[:, None] * stride_cache + cols[None, :]
    cos = tl.load(cs_ptr, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]  # [BLOCK_T, 1, BLOCK_HALF]
    sin = tl.load(cs_ptr + HALF, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, num_q_heads, tokens, t_mask, cos, sin,
                  HALF, BLOCK_HALF, BLOCK_HQ, IS_NEOX)
    _rotate_heads(k_ptr, stride_kt, stride_kh, num_k_heads, tokens, t_mask, cos, sin,
                  HALF, BLOCK_HALF, BLOCK_HK, IS_NEOX)


@triton.jit
def _apply_rope_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    num_tokens, num_q_heads, num_k_heads, num_positions,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_pos, stride_cache,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, IS_NEOX: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    _rope_tokens(q_ptr, k_ptr, pos_ptr, cache_ptr, tokens, tokens < num_tokens, num_q_heads, num_k_heads,
                 num_positions, stride_qt, stride_qh, stride_kt, stride_kh, stride_pos, stride_cache,
                 HALF, BLOCK_HALF, BLOCK_HQ, BLOCK_HK, IS_NEOX)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_config(num_tokens: int, num_q_heads: int, num_k_heads: int, half: int):
    """(grid, BLOCK_HALF, BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps) for T tokens, Hq/Hk heads, R/2 pairs."""
    block_half = next_power_of_2(half)
    heads_cap = max(1, _PAIRS_PER_TILE // block_half)
    block_hq = min(next_power_of_2(max(num_q_heads, 1)), heads_cap)
    block_hk = min(next_power_of_2(max(num_k_heads, 1)), heads_cap)
    # Several tokens per program when heads are few or small, so each program still moves a full tile.
    block_t = max(1, min(_PAIRS_PER_TILE // (block_hq * block_half), next_power_of_2(num_tokens)))
    tile = block_t * block_hq * block_half
    return (cdiv(num_tokens, block_t),), block_half, block_t, block_hq, block_hk, 4 if tile <= 1024 else 8


def apply_rope_(q, k, positions, cos_sin_cache, is_neox):
    num_tokens, num_q_heads, _ = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    grid, block_half, block_t, block_hq, block_hk, num_warps = _launch_config(num_tokens, num_q_heads, num_k_heads,
                                                                              half)
    _apply_rope_kernel[grid](
        q, k, positions, cos_sin_cache,
        num_tokens, num_q_heads, num_k_heads, cos_sin_cache.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), positions.stride(0), cos_sin_cache.stride(0),
        HALF=half, BLOCK_HALF=block_half, BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        IS_NEOX=bool(is_neox), num_warps=num_warps, **launch_kwargs(q, num_tokens),
    )
