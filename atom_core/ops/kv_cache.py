"""Writing a step's keys and values into the paged KV pool: ``store_kv_``.

Legend: T = tokens, Hk = KV heads, D = head size, NB = pool blocks, BS = block size (slots per block).
The pool is NHD pages: k_cache, v_cache [NB, BS, Hk, D]; slot s is block s // BS, offset s % BS.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import kv_cache as reference_kv_cache
from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.validation import FLOAT_DTYPES, check_same_device, check_shape, check_tensor, debug_enabled
from atom_core.ops.value_checks import check_slots, check_static_scale

STORE_KV = Op("store_kv_")


def _torch_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    reference_kv_cache.store_kv_(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _triton_supports(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> str | None:
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        return "triton store_kv_ needs the head dim of k, v and the caches contiguous"
    return None


def _triton_key(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """What :func:`_triton_supports` reads."""
    return k.stride()[-1] == 1, v.stride()[-1] == 1, k_cache.stride()[-1] == 1, v_cache.stride()[-1] == 1


def _aiter_fp8_is_e4m3fn(device: torch.device) -> bool:
    # AITER converts to the platform's fp8: OCP e4m3fn on gfx95x, e4m3fnuz (another exponent bias)
    # on gfx94x. Only the former matches torch.float8_e4m3fn.
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "gcnArchName", "").startswith("gfx95")


def _aiter_supports(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> str | None:
    # AITER's reshape_and_cache_flash takes only a token stride for k/v (heads packed), a block
    # stride for the caches (each block packed [BS, Hk, D], the same stride for K and V), all int32.
    _, num_heads, head_size = k.shape
    if not slot_mapping.is_contiguous():
        return "aiter store_kv_ reads slot_mapping as a packed array"
    if k.dtype not in (torch.float16, torch.bfloat16):
        return f"aiter store_kv_ is used for fp16/bf16 k/v only, got {k.dtype}"
    for name, x in (("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != head_size:
            return f"aiter store_kv_ needs the heads of each token of {name} packed ([Hk, D] contiguous)"
    block_stride = k_cache.stride(0)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride()[1:] != (num_heads * head_size, head_size, 1) or cache.stride(0) != block_stride:
            return f"aiter store_kv_ needs each block of {name} packed and one block stride for both caches"
    if max(k.stride(0), v.stride(0), block_stride) > 2**31 - 1:
        return "aiter store_kv_ takes int32 strides"
    if k_cache.dtype == FP8_DTYPE and not _aiter_fp8_is_e4m3fn(k_cache.device):
        return "aiter's fp8 KV cache on this GPU is e4m3fnuz, not torch.float8_e4m3fn"
    return None


def _aiter_key(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """What :func:`_aiter_supports` reads (the fp8 flavour follows from k_cache's device, in the signature)."""
    return (slot_mapping.is_contiguous(), k.dtype, k_cache.dtype, k.shape[1:], k.stride(), v.stride(),
            k_cache.stride(), v_cache.stride())


STORE_KV.register("torch", _torch_store_kv)
STORE_KV.register("triton", "atom_core.ops.triton.kv_cache:store_kv_", _triton_supports, _triton_key)
STORE_KV.register("aiter", "atom_core.ops.aiter.kv_cache:store_kv_", _aiter_supports, _aiter_key)


@custom_op("store_kv_", mutates_args=("k_cache", "v_cache"))
def _store_kv_op(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                 k_scale: Tensor | None, v_scale: Tensor | None, backend: str | None) -> None:
    STORE_KV(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, backend=backend)


@_store_kv_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, backend) -> None:
    return None


def _check_scale(name: str, scale, device) -> None:
    if scale is None:
        raise ValueError(f"{name} is required when the cache is {FP8_DTYPE} (x is stored as x / {name})")
    check_tensor(name, scale, dtypes=(torch.float32,))
    if scale.numel() != 1:
        raise ValueError(f"{name} must hold one per-tensor scale (shape [1]), got shape {tuple(scale.shape)}")
    if scale.device != device:
        raise ValueError(f"{name} must be on {device}, got {scale.device}")
    check_static_scale(name, scale)


def _check_store_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """The per-call checks, run in debug mode only (atom_core.ops.validation)."""
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("v", v, ndim=3, dtypes=(k.dtype,))
    check_shape("v", v, tuple(k.shape))
    num_tokens, num_heads, head_size = k.shape
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(k.dtype, FP8_DTYPE))
    check_shape("k_cache", k_cache, (None, None, num_heads, head_size))
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    if k_cache.dtype == FP8_DTYPE:
        _check_scale("k_scale", k_scale, k.device)
        _check_scale("v_scale", v_scale, k.device)


def pool_scales(k_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None):
    """(k_scale, v_scale) as a store into ``k_cache`` takes them: None for a pool in the model's dtype; required
    for an fp8 pool (always on: the kernels divide by them)."""
    if k_cache.dtype != FP8_DTYPE:
        return None, None
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 cache needs k_scale and v_scale (fp32 [1] each; torch.ones(1) stores unscaled)")
    return k_scale, v_scale


def store_kv_(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *,
              k_scale: Tensor | None = None, v_scale: Tensor | None = None, backend: str | None = None) -> None:
    """Write each token's keys and values into its slot of the paged pool, in place.

    k, v: [T, Hk, D] fp32/fp16/bf16 (strided views allowed, e.g. slices of a fused qkv buffer).
    k_cache, v_cache: [NB, BS, Hk, D], k's dtype or torch.float8_e4m3fn.
    slot_mapping: int64 [T]; token t goes to block ``slot_mapping[t] // BS``, offset ``% BS``;
    -1 writes nothing. Slots are assumed distinct and below NB * BS (checked in debug mode,
    except distinctness).
    k_scale, v_scale: fp32 [1] per-tensor scales, required for an fp8 cache, which stores
    ``clamp(k / k_scale, -448, 448)`` rounded to nearest even (and likewise v); ignored otherwise.
    """
    if debug_enabled():
        _check_store_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    elif slot_mapping.shape[0] != k.shape[0]:
        # Always on: a short slot_mapping would make the kernel read slot ids past its end and
        # write whole rows to whatever slots those name.
        raise ValueError(f"slot_mapping must have one slot per token ({k.shape[0]}), got {slot_mapping.shape[0]}")
    k_scale, v_scale = pool_scales(k_cache, k_scale, v_scale)
    call_op("store_kv_", k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, backend)
