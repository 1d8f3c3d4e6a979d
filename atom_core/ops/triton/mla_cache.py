"""Triton writes of per-token rows into a paged pool whose entries are one row per slot (no head dim):
the MLA latent pool (``store_mla_``: ``[c_kv, k_pe]`` into ``[NB, BS, L + R]``) and DSA's indexer-key
cache (``store_indexer_k_``: ``k`` into ``[NB, BS, Di]``).

Each program scatters BLOCK_T tokens' rows into their slots: slot s is block s // BS, offset s % BS;
s < 0 (padding) is masked out, so its row is not even read. The row copy is ``kv_cache._store_rows``
(one "head"), so an fp8 pool stores ``clamp(x / scale, -448, 448)`` rounded to e4m3 in fp32 first,
bit-equal to ``torch.Tensor.to(torch.float8_e4m3fn)`` on every target. An fp8 indexer cache instead
quantizes each key with its own scale (``_store_quantized_keys_kernel``: amax / 448 into ``indexer_scale``,
``quant.quantize_groups``, as ``reference.quant.per_token_quant``). Offsets are int64.

Legend: T = tokens, L = kv_lora_rank, R = qk_rope_head_dim, Di = indexer head dim, NB = blocks, BS = block size.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.triton.kv_cache import _store_rows
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2
from atom_core.ops.triton.quant import TL_AMAX_FLOOR, TL_FP8_MAX, quantize_groups

_TILE = 4096  # elements of a row block per program


@triton.jit
def _slots(slot_ptr, stride_slot, num_tokens, block_size, BLOCK_T: tl.constexpr):
    """(tokens, blocks, offsets, valid) of this program's BLOCK_T tokens, int64."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tokens < num_tokens
    slots = tl.load(slot_ptr + tokens * stride_slot, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (slots >= 0)
    slots = tl.where(valid, slots, 0)
    return tokens, slots // block_size, slots % block_size, valid


@triton.jit
def _store_latent_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale_ptr,
    num_tokens, latent_dim, rope_dim, block_size, stride_slot, stride_ct, stride_pt, stride_cb, stride_cs,
    FP8: tl.constexpr, HAS_ROPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tokens, blocks, offsets, valid = _slots(slot_ptr, stride_slot, num_tokens, block_size, BLOCK_T)
    # A row of the pool is [kv_c | k_pe]: kv_c at columns 0 .. L-1, k_pe at L .. L+R-1 (one "head" each).
    _store_rows(kv_c_ptr, cache_ptr, scale_ptr, stride_ct, 0, stride_cb, stride_cs, 0,
                tokens, blocks, offsets, valid, 1, latent_dim, FP8, 1, BLOCK_L)
    if HAS_ROPE:
        _store_rows(k_pe_ptr, cache_ptr + latent_dim, scale_ptr, stride_pt, 0, stride_cb, stride_cs, 0,
                    tokens, blocks, offsets, valid, 1, rope_dim, FP8, 1, BLOCK_R)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_config(num_tokens: int, latent_dim: int, rope_dim: int):
    """(grid, BLOCK_T, BLOCK_L, BLOCK_R, num_warps) for T rows of L + R."""
    block_l, block_r = next_power_of_2(latent_dim), next_power_of_2(max(rope_dim, 1))
    fits = _TILE // (block_l + block_r)                      # rows per program, rounded down to a power of two
    block_t = max(1, min(1 << (fits.bit_length() - 1) if fits else 1, next_power_of_2(num_tokens)))
    return (cdiv(num_tokens, block_t),), block_t, block_l, block_r, 4 if block_t * block_l <= 1024 else 8


def _store(first, second, cache, slot_mapping, scale):
    num_tokens, latent_dim = first.shape
    if num_tokens == 0:
        return
    rope_dim = 0 if second is None else second.shape[1]
    fp8 = cache.dtype == FP8_DTYPE
    grid, block_t, block_l, block_r, num_warps = _launch_config(num_tokens, latent_dim, rope_dim)
    _store_latent_kernel[grid](
        first, first if second is None else second, cache, slot_mapping,
        scale if fp8 else slot_mapping,  # unread unless FP8
        num_tokens, latent_dim, rope_dim, cache.shape[1], slot_mapping.stride(0),
        first.stride(0), first.stride(0) if second is None else second.stride(0), cache.stride(0), cache.stride(1),
        FP8=fp8, HAS_ROPE=second is not None, BLOCK_T=block_t, BLOCK_L=block_l, BLOCK_R=block_r,
        num_warps=num_warps,
    )


def store_mla_(kv_c, k_pe, mla_cache, slot_mapping, kv_scale):
    """``mla_cache[slot] = [kv_c[t], k_pe[t]]`` (arguments as ``atom_core.ops.store_mla_``)."""
    _store(kv_c, k_pe, mla_cache, slot_mapping, kv_scale)


@triton.jit
def _store_quantized_keys_kernel(
    k_ptr, cache_ptr, scale_ptr, slot_ptr, num_tokens, dim, block_size, stride_slot, stride_kt, stride_cb, stride_cs,
    stride_sb, stride_ss, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tokens, blocks, offsets, valid = _slots(slot_ptr, stride_slot, num_tokens, block_size, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (dims < dim)[None, :]
    x = tl.load(k_ptr + tokens[:, None] * stride_kt + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, TL_AMAX_FLOOR, TL_FP8_MAX, False)               # one scale a token
    rows = blocks * stride_cb + offsets * stride_cs
    tl.store(cache_ptr + rows[:, None] + dims[None, :], q.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + blocks * stride_sb + offsets * stride_ss, scale, mask=valid)


def store_indexer_k_(k, indexer_cache, slot_mapping, indexer_scale):
    """``indexer_cache[slot] = k[t]`` cast to the cache's dtype, or for an fp8 cache quantized with one scale a
    token written to ``indexer_scale[slot]`` (arguments as ``atom_core.ops.store_indexer_k_``)."""
    if indexer_cache.dtype != FP8_DTYPE:
        _store(k, None, indexer_cache, slot_mapping, None)
        return
    num_tokens, dim = k.shape
    if num_tokens == 0:
        return
    grid, block_t, block_d, _, num_warps = _launch_config(num_tokens, dim, 0)
    _store_quantized_keys_kernel[grid](
        k, indexer_cache, indexer_scale, slot_mapping, num_tokens, dim, indexer_cache.shape[1],
        slot_mapping.stride(0), k.stride(0), indexer_cache.stride(0), indexer_cache.stride(1),
        indexer_scale.stride(0), indexer_scale.stride(1), BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps,
    )
