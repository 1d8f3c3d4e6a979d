"""Reference KV-cache write: scatter each token's K and V rows into its slot of the paged pool.

Legend: T = tokens, Hk = KV heads, D = head size, NB = pool blocks, BS = block size (slots per block).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor fp8 e4m3: ``clamp(x / scale, -448, 448)`` rounded to nearest even. scale: fp32 [1]."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _cache_rows(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    return quantize_fp8(x, scale) if cache_dtype == FP8_DTYPE else x.to(cache_dtype)


def store_kv_(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
              v_scale: torch.Tensor | None = None) -> None:
    """Write k[t], v[t] ([Hk, D] each) at slot s = slot_mapping[t] of k_cache / v_cache [NB, BS, Hk, D]:
    block s // BS, offset s % BS. Tokens with s == -1 write nothing. fp8 caches store
    ``quantize_fp8(k, k_scale)`` / ``quantize_fp8(v, v_scale)``; other caches store k, v cast to their dtype.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = _cache_rows(k[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = _cache_rows(v[keep], v_cache.dtype, v_scale)
