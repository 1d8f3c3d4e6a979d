"""Dynamic activation quantization: ``per_tensor_quant``, ``per_token_quant``, ``per_group_quant``.

Legend: T = tokens (rows), K = the quantized (last) dim, G = ceil(K / group_size).

Each returns ``(q, scale)``: q [T, K] in fp8 e4m3fn (``torch.float8_e4m3fn``, ±448) or int8 (±127),
and fp32 scales that multiply (``x ≈ q * scale``) in the layout the scaled GEMMs read
(``atom_core.ops.scaled_mm``):

| op | scale | GEMM |
|---|---|---|
| per_tensor_quant | [1] | scaled_mm_per_tensor |
| per_token_quant | [T, 1] | scaled_mm_per_token (a_scale) |
| per_group_quant | [T, G], groups of 128 | scaled_mm_block (a_scale) |

Rounding, saturation and the floor that keeps an all-zero row finite are defined by the twins
(``atom_core.ops.reference.quant``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import quant as reference_quant
from atom_core.ops.reference.quant import FP8_DTYPE, GROUP_SIZE, INT8_DTYPE, QUANT_DTYPES
from atom_core.ops.validation import FLOAT_DTYPES, check_tensor, debug_enabled
from atom_core.ops.value_checks import check_static_scale

PER_TENSOR_QUANT = Op("per_tensor_quant")
PER_TOKEN_QUANT = Op("per_token_quant")
PER_GROUP_QUANT = Op("per_group_quant")


@functools.lru_cache(maxsize=None)
def _gpu_fp8_is_e4m3fn(index: int | None) -> bool:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is None:
        return torch.cuda.get_device_capability(index) >= (8, 9)  # fp8 conversions and MMAs: Ada, Hopper and later
    return getattr(props, "gcnArchName", "").startswith("gfx95")


def fp8_e4m3fn_native(device: torch.device) -> bool:
    """Whether GPU kernels on ``device`` compute in OCP fp8 e4m3fn (``torch.float8_e4m3fn``).

    NVIDIA: compute capability 8.9 or later. AMD: gfx95x; gfx94x (MI300) uses e4m3fnuz, another
    exponent bias, which AITER and Triton pick there. False for non-CUDA devices (the CPU
    interpreter handles fp8 itself and does not ask).
    """
    return device.type == "cuda" and _gpu_fp8_is_e4m3fn(device.index)


def _torch_per_tensor_quant(x, static_scale, q, scale):
    got_q, got_scale = reference_quant.per_tensor_quant(x, q.dtype, static_scale)
    q.copy_(got_q)
    scale.copy_(got_scale)


def _torch_per_token_quant(x, q, scale):
    got_q, got_scale = reference_quant.per_token_quant(x, q.dtype)
    q.copy_(got_q)
    scale.copy_(got_scale)


def _torch_per_group_quant(x, group_size, q, scale):
    got_q, got_scale = reference_quant.per_group_quant(x, q.dtype, group_size)
    q.copy_(got_q)
    scale.copy_(got_scale)


def _triton_supports(x, *rest) -> str | None:
    q = rest[-2]
    if x.stride()[-1] != 1:
        return "triton quantization kernels need the last dim of x contiguous"
    if q.dtype == FP8_DTYPE and x.is_cuda and not fp8_e4m3fn_native(x.device):
        return "triton fp8 e4m3fn needs an NVIDIA GPU of compute capability 8.9+ or an AMD gfx95x"
    return None


def _triton_key(x, *rest):
    """What :func:`_triton_supports` reads (the device is part of every call's signature)."""
    return x.stride()[-1] == 1, rest[-2].dtype


def _aiter_supports(x, *rest) -> str | None:
    q = rest[-2]
    if q.dtype == INT8_DTYPE:
        # AITER's own torch reference (aiter.pertoken_quant) truncates toward zero where the twin
        # rounds half to even; until its kernels are verified on a GPU, int8 stays with the others.
        return "aiter int8 quantization is not used: its rounding is not pinned to the twin's"
    if not fp8_e4m3fn_native(x.device):
        return "aiter's fp8 on this GPU is e4m3fnuz, not torch.float8_e4m3fn"
    if not x.is_contiguous():
        return "aiter quantization kernels need a contiguous x"
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"aiter quantization kernels are used for fp16/bf16 x only, got {x.dtype}"
    return None


def _aiter_key(x, *rest):
    """What :func:`_aiter_supports` reads."""
    return rest[-2].dtype, x.is_contiguous(), x.dtype


def _aiter_group_supports(x, group_size, q, scale) -> str | None:
    reason = _aiter_supports(x, group_size, q, scale)
    if reason is None and x.shape[1] % group_size:
        # AITER quantizes groups as rows of x.view(-1, group_size).
        return f"aiter per-group quantization needs K a multiple of group_size {group_size}, got K = {x.shape[1]}"
    if reason is None and group_size not in (32, 64, 128):
        return f"aiter per-group quantization takes group_size 32, 64 or 128, got {group_size}"
    return reason


def _aiter_group_key(x, group_size, q, scale):
    return _aiter_key(x, group_size, q, scale), x.shape[1] % group_size == 0, group_size


PER_TENSOR_QUANT.register("torch", _torch_per_tensor_quant)
PER_TENSOR_QUANT.register("triton", "atom_core.ops.triton.quant:per_tensor_quant", _triton_supports, _triton_key)
PER_TENSOR_QUANT.register("aiter", "atom_core.ops.aiter.quant:per_tensor_quant", _aiter_supports, _aiter_key)
PER_TOKEN_QUANT.register("torch", _torch_per_token_quant)
PER_TOKEN_QUANT.register("triton", "atom_core.ops.triton.quant:per_token_quant", _triton_supports, _triton_key)
PER_TOKEN_QUANT.register("aiter", "atom_core.ops.aiter.quant:per_token_quant", _aiter_supports, _aiter_key)
PER_GROUP_QUANT.register("torch", _torch_per_group_quant)
PER_GROUP_QUANT.register("triton", "atom_core.ops.triton.quant:per_group_quant", _triton_supports, _triton_key)
PER_GROUP_QUANT.register("aiter", "atom_core.ops.aiter.quant:per_group_quant", _aiter_group_supports,
                         _aiter_group_key)


@custom_op("per_tensor_quant", mutates_args=("q", "scale"))
def _per_tensor_quant_op(x: Tensor, static_scale: Tensor | None, q: Tensor, scale: Tensor,
                         backend: str | None) -> None:
    PER_TENSOR_QUANT(x, static_scale, q, scale, backend=backend)


@_per_tensor_quant_op.register_fake
def _(x, static_scale, q, scale, backend) -> None:
    return None


@custom_op("per_token_quant", mutates_args=("q", "scale"))
def _per_token_quant_op(x: Tensor, q: Tensor, scale: Tensor, backend: str | None) -> None:
    PER_TOKEN_QUANT(x, q, scale, backend=backend)


@_per_token_quant_op.register_fake
def _(x, q, scale, backend) -> None:
    return None


@custom_op("per_group_quant", mutates_args=("q", "scale"))
def _per_group_quant_op(x: Tensor, group_size: int, q: Tensor, scale: Tensor, backend: str | None) -> None:
    PER_GROUP_QUANT(x, group_size, q, scale, backend=backend)


@_per_group_quant_op.register_fake
def _(x, group_size, q, scale, backend) -> None:
    return None


def _check_x(x: Tensor, dtype: torch.dtype) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if dtype not in QUANT_DTYPES:
        raise TypeError(f"dtype must be one of {[str(d) for d in QUANT_DTYPES]}, got {dtype}")


def per_tensor_quant(x: Tensor, *, dtype: torch.dtype = FP8_DTYPE, scale: Tensor | None = None,
                     backend: str | None = None) -> tuple[Tensor, Tensor]:
    """x [T, K] fp32/fp16/bf16 → (q [T, K] of ``dtype``, scale [1] fp32), one scale for the tensor.

    Dynamic (scale = max(max |x|, 1e-10) / qmax) unless ``scale`` (fp32, one element, > 0) is given:
    then static, and the returned scale is that value.
    """
    if debug_enabled():
        _check_x(x, dtype)
        if scale is not None:
            check_tensor("scale", scale, dtypes=(torch.float32,))
            if scale.numel() != 1 or scale.device != x.device:
                raise ValueError(f"scale must be one fp32 element on {x.device}, got shape {tuple(scale.shape)} "
                                 f"on {scale.device}")
            check_static_scale("scale", scale)
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    out_scale = torch.empty(1, dtype=torch.float32, device=x.device)
    call_op("per_tensor_quant", x, scale, q, out_scale, backend)
    return q, out_scale


def per_token_quant(x: Tensor, *, dtype: torch.dtype = FP8_DTYPE,
                    backend: str | None = None) -> tuple[Tensor, Tensor]:
    """x [T, K] fp32/fp16/bf16 → (q [T, K] of ``dtype``, scale [T, 1] fp32): one scale per row,
    max(max |x[t]|, 1e-10) / qmax."""
    if debug_enabled():
        _check_x(x, dtype)
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    call_op("per_token_quant", x, q, scale, backend)
    return q, scale


def per_group_quant(x: Tensor, *, dtype: torch.dtype = FP8_DTYPE, group_size: int = GROUP_SIZE,
                    backend: str | None = None) -> tuple[Tensor, Tensor]:
    """x [T, K] fp32/fp16/bf16 → (q [T, K] of ``dtype``, scale [T, ceil(K / group_size)] fp32):
    one scale per ``group_size`` consecutive values of a row (1 x 128 groups by default; the last
    group of a row may be shorter)."""
    if debug_enabled():
        _check_x(x, dtype)
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty(x.shape[0], -(-x.shape[1] // group_size), dtype=torch.float32, device=x.device)
    call_op("per_group_quant", x, group_size, q, scale, backend)
    return q, scale

