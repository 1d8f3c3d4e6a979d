"""Triton per-head RMSNorm of q and k, then RoPE: one launch, in place.

Grid (T, 2): program (t, 0) takes token t's query heads, (t, 1) its key heads, so a decode step
is one launch where the unfused path made five (a reshape copy and an RMSNorm each for q and k,
then the rotation). A program loads its token's cos/sin row once, then walks its heads in chunks
of [BLOCK_H, BLOCK_D]:

1. load the whole heads, ``inv_rms = rsqrt(sum(x**2) / D + eps)`` per head in fp32;
2. dims R..D: store ``x * inv_rms * w`` (normalised, not rotated);
3. dims 0..R: load the rotary pairs (a, b) again, normalise them with their weights and round them
   to q's dtype exactly as the RMSNorm kernel stores its output, so the rotation sees what
   ``rms_norm`` would have written, then rotate them in fp32 as the rope kernel does and store.

Steps 2 and 3 write disjoint dims, and each head's stores depend on its own ``inv_rms``, so no
program reads a value it (or another) has already overwritten. Within a program, a tile smaller than
its threads is replicated across them (e.g. 2 key heads x 32 pairs on 128 threads), so step 3 waits at
a barrier until every thread has loaded its pairs before any stores: without it an H200 showed
replicas reading pairs already rotated (0.1% of the key values wrong at Hk = 2, R = 64). Token and head strides are
arguments (q and k may be views of a fused qkv buffer); the head dim must be contiguous.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, next_power_of_2

# Most elements of one [BLOCK_H, BLOCK_D] tile: 32 heads of 128, 16 fp32 values a thread at 8 warps.
TILE_ELEMENTS = 4096


@triton.jit
def _norm_rope_heads(x_ptr, w_ptr, stride_t, stride_h, num_heads, token, cos, sin, eps,
                     HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr):
    """Normalise and rotate heads [0, num_heads) of token ``token`` (int64 [1]); cos, sin: fp32 [1, BLOCK_HALF]."""
    cols = tl.arange(0, BLOCK_D)
    d_mask = cols < HEAD_DIM
    tail = d_mask & (cols >= 2 * HALF)  # dims R..D: normalised only
    pairs = tl.arange(0, BLOCK_HALF)
    p_mask = pairs < HALF
    if IS_NEOX:
        a_cols = pairs  # dim i pairs with dim i + R/2
        b_cols = pairs + HALF
    else:
        a_cols = 2 * pairs  # dim 2i pairs with dim 2i + 1
        b_cols = a_cols + 1
    w = tl.load(w_ptr + cols, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w_a = tl.load(w_ptr + a_cols, mask=p_mask, other=0.0).to(tl.float32)[None, :]
    w_b = tl.load(w_ptr + b_cols, mask=p_mask, other=0.0).to(tl.float32)[None, :]
    dtype = x_ptr.dtype.element_ty
    token_base = token[:, None] * stride_t  # [1, 1], int64: token * stride can exceed 2**31
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        h_mask = (heads < num_heads)[:, None]
        head_ptr = x_ptr + token_base + heads[:, None].to(tl.int64) * stride_h  # [BLOCK_H, 1]
        x = tl.load(head_ptr + cols[None, :], mask=h_mask & d_mask[None, :], other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]  # [BLOCK_H, 1]
        tl.store(head_ptr + cols[None, :], (x * inv_rms * w).to(dtype), mask=h_mask & tail[None, :])
        mask = h_mask & p_mask[None, :]
        a_ptr = head_ptr + a_cols[None, :]
        b_ptr = head_ptr + b_cols[None, :]
        # Rounded to the dtype as rms_norm's output is, then rotated in fp32 as apply_rope_ rotates it.
        a = (tl.load(a_ptr, mask=mask, other=0.0).to(tl.float32) * inv_rms * w_a).to(dtype).to(tl.float32)
        b = (tl.load(b_ptr, mask=mask, other=0.0).to(tl.float32) * inv_rms * w_b).to(dtype).to(tl.float32)
        # A [BLOCK_H, BLOCK_HALF] tile smaller than the program's threads is held by several threads at
        # once: every copy must have loaded its pair before any writes the rotated one back.
        tl.debug_barrier()
        tl.store(a_ptr, (a * cos - b * sin).to(dtype), mask=mask)
        tl.store(b_ptr, (b * cos + a * sin).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, pos_ptr, cache_ptr,
    num_q_heads, num_k_heads, num_positions,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_pos, stride_cache, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, IS_NEOX: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    # Token t as a [1] vector, not a scalar: the masks below broadcast against it (Triton's CPU
    # interpreter cannot AND a scalar mask into a vector one).
    token = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    pos = tl.load(pos_ptr + token * stride_pos).to(tl.int64)
    # As in the rope kernel: a position outside the table is not read (its rotary dims rotate by
    # cos = sin = 0, i.e. become 0) rather than faulting; the public function documents [0, P).
    row_ok = (pos >= 0) & (pos < num_positions)
    pairs = tl.arange(0, BLOCK_HALF)
    cs_mask = row_ok[:, None] & (pairs < HALF)[None, :]
    cs_ptr = cache_ptr + pos[:, None] * stride_cache + pairs[None, :]
    cos = tl.load(cs_ptr, mask=cs_mask, other=0.0).to(tl.float32)  # [1, BLOCK_HALF]
    sin = tl.load(cs_ptr + HALF, mask=cs_mask, other=0.0).to(tl.float32)
    if tl.program_id(1) == 0:
        _norm_rope_heads(q_ptr, q_weight_ptr, stride_qt, stride_qh, num_q_heads, token, cos, sin, eps,
                         HEAD_DIM, HALF, BLOCK_D, BLOCK_HALF, BLOCK_HQ, IS_NEOX)
    else:
        _norm_rope_heads(k_ptr, k_weight_ptr, stride_kt, stride_kh, num_k_heads, token, cos, sin, eps,
                         HEAD_DIM, HALF, BLOCK_D, BLOCK_HALF, BLOCK_HK, IS_NEOX)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_config(num_q_heads: int, num_k_heads: int, head_dim: int, half: int):
    """(BLOCK_D, BLOCK_HALF, BLOCK_HQ, BLOCK_HK, num_warps) for Hq / Hk heads of D dims, R/2 pairs.

    A chunk holds as many whole heads as fit in TILE_ELEMENTS: up to 32 heads of 128 per pass (Qwen3
    up to 8B on one GPU: each program makes one pass); 4 warps up to 2048 elements, 8 above.
    """
    block_d = next_power_of_2(head_dim)
    heads_cap = max(1, TILE_ELEMENTS // block_d)
    block_hq = min(next_power_of_2(max(num_q_heads, 1)), heads_cap)
    block_hk = min(next_power_of_2(max(num_k_heads, 1)), heads_cap)
    tile = max(block_hq, block_hk) * block_d
    return block_d, next_power_of_2(max(half, 1)), block_hq, block_hk, 4 if tile <= 2048 else 8


def qk_norm_rope_(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox):
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    block_d, block_half, block_hq, block_hk, num_warps = _launch_config(num_q_heads, k.shape[1], head_dim, half)
    _qk_norm_rope_kernel[(num_tokens, 2)](
        q, k, q_weight, k_weight, positions, cos_sin_cache,
        num_q_heads, k.shape[1], cos_sin_cache.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), positions.stride(0), cos_sin_cache.stride(0), eps,
        HEAD_DIM=head_dim, HALF=half, BLOCK_D=block_d, BLOCK_HALF=block_half, BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk, IS_NEOX=bool(is_neox), num_warps=num_warps, **launch_kwargs(q, num_tokens),
    )
