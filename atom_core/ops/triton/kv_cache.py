"""Triton KV-cache write: each program scatters BLOCK_T tokens' K and V rows into their pool slots.

Slot s goes to block s // BS, offset s % BS; s < 0 (padding) is masked out, so its rows are not even
read. All offsets are int64 (block * block stride passes 2**31 on large pools). For an fp8 cache the
value ``clamp(x / scale, -448, 448)`` (the IEEE quotient, by ``quant.divide_by_static``) is rounded to the e4m3
grid, to nearest even (``quant.round_to_format``), so every Triton target, the CPU interpreter included,
stores the same bits as the twin's ``torch.Tensor.to(torch.float8_e4m3fn)``.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2
from atom_core.ops.triton.quant import TL_FP8_MAX, divide_by_static, round_to_format

_TILE = 2048  # elements of K (and of V) per program


@triton.jit
def _store_rows(src_ptr, dst_ptr, scale_ptr, stride_t, stride_h, stride_b, stride_s, stride_hc,
                tokens, blocks, offsets, valid, num_heads, head_size,
                FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    dims = tl.arange(0, BLOCK_D)
    src_base = tokens[:, None, None] * stride_t
    dst_base = blocks[:, None, None] * stride_b + offsets[:, None, None] * stride_s
    for h0 in range(0, num_heads, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mask = valid[:, None, None] & (heads < num_heads)[None, :, None] & (dims < head_size)[None, None, :]
        x = tl.load(src_ptr + src_base + heads[None, :, None] * stride_h + dims[None, None, :], mask=mask)
        if FP8:
            # The scale is loaded after the row, in the loop: loaded before it, the reciprocal's division (a
            # branch to its slow path) came between the two loads, and a token's store waited for both in turn.
            scale = tl.load(scale_ptr).to(tl.float32)
            inverse = tl.div_rn(1.0, scale)
            x = round_to_format(divide_by_static(x.to(tl.float32), scale, inverse), TL_FP8_MAX, False)  # to +-448, ties to even
        tl.store(dst_ptr + dst_base + heads[None, :, None] * stride_hc + dims[None, None, :],
                 x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_tokens(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, tokens, in_range,
                  num_heads, head_size, block_size, stride_slot, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                  FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write the K and V rows of the tokens ``tokens`` (int64 [BLOCK_T]) to their slots."""
    slots = tl.load(slot_ptr + tokens * stride_slot, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (slots >= 0)
    slots = tl.where(valid, slots, 0)
    blocks = slots // block_size
    offsets = slots % block_size
    _store_rows(k_ptr, k_cache_ptr, k_scale_ptr, stride_kt, stride_kh, stride_kcb, stride_kcs, stride_kch,
                tokens, blocks, offsets, valid, num_heads, head_size, FP8, BLOCK_H, BLOCK_D)
    _store_rows(v_ptr, v_cache_ptr, v_scale_ptr, stride_vt, stride_vh, stride_vcb, stride_vcs, stride_vch,
                tokens, blocks, offsets, valid, num_heads, head_size, FP8, BLOCK_H, BLOCK_D)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_tokens, num_heads, head_size, block_size, stride_slot,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    FP8: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    _store_tokens(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, tokens,
                  tokens < num_tokens, num_heads, head_size, block_size, stride_slot, stride_kt, stride_kh,
                  stride_vt, stride_vh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                  FP8, BLOCK_H, BLOCK_D)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_config(num_tokens: int, num_heads: int, head_size: int):
    """(grid, BLOCK_T, BLOCK_H, BLOCK_D, num_warps) for T tokens of [Hk, D]."""
    block_d = next_power_of_2(head_size)
    block_h = min(next_power_of_2(num_heads), max(1, _TILE // block_d))
    block_t = max(1, min(_TILE // (block_h * block_d), next_power_of_2(num_tokens)))
    tile = block_t * block_h * block_d
    return (cdiv(num_tokens, block_t),), block_t, block_h, block_d, 4 if tile <= 1024 else 8


def store_kv_(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    num_tokens, num_heads, head_size = k.shape
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype == FP8_DTYPE
    grid, block_t, block_h, block_d, num_warps = _launch_config(num_tokens, num_heads, head_size)
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,  # unread unless FP8
        num_tokens, num_heads, head_size, k_cache.shape[1], slot_mapping.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        FP8=fp8, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
        **launch_kwargs(k, num_tokens),
    )
