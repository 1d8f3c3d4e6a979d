"""Activation quantization folded into the op that produces the activation: ``rms_norm_quant`` and
``silu_and_mul_quant``.

Legend: T = tokens (rows), D = hidden size, I = intermediate size, G = groups per row =
ceil(row length / group_size).

A linear layer with block-FP8 (1 x 128 groups) or per-token FP8/INT8 activations quantizes its input
first: unfused that is the producing op (``rms_norm`` before qkv / gate_up, ``silu_and_mul`` before
down), which writes the activation, then ``per_group_quant``, which reads it back. Each op here is one
launch, defined as exactly that pipeline (the twins: ``atom_core.ops.reference.norm_quant``): the
activation is rounded to x's dtype before it is quantized, so the result equals the two ops bit for bit.

``group_size`` is a power of two (128: DeepSeek's block FP8) or at least the row's length: one group
per row, the per-token quantization of ``per_token_quant`` (scale [T, 1]). Other sizes are refused
(always checked): a row held as [G_PAD, group_size] in the kernel needs a power of two.

Backends: torch (the twin) and triton. No AITER backend: AITER has no per-group fused variant to adapt
(tests/ops/aiter_signatures.txt: its ``rmsnorm2d_fwd``, ``rmsnorm2d_fwd_with_add`` and ``silu_and_mul``
do not quantize), and a composition of its norm / activation and quantization adapters would launch
no fewer kernels than the unfused path, yet ``auto`` prefers a verified AITER backend over Triton on
ROCm and would take the fusion away there. ``backend="aiter"`` is refused and ``use_backend("aiter")``
falls through, as for any op without an AITER adapter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.norm import TRITON_MAX_HIDDEN, _check_eps
from atom_core.ops.quant import fp8_e4m3fn_native
from atom_core.ops.reference import norm as reference_norm
from atom_core.ops.reference import norm_quant as reference_norm_quant
from atom_core.ops.reference.quant import FP8_DTYPE, GROUP_SIZE, QUANT_DTYPES
from atom_core.ops.validation import (
    FLOAT_DTYPES,
    check_out,
    check_same_device,
    check_shape,
    check_tensor,
    debug_enabled,
)

RMS_NORM_QUANT = Op("rms_norm_quant")
SILU_AND_MUL_QUANT = Op("silu_and_mul_quant")


def _torch_rms_norm_quant(x, weight, eps, residual, gemma, group_size, q, scale, residual_out, normed):
    # reference_norm_quant.rms_norm_quant's two twins, the normalised rows kept for ``normed``
    rows = reference_norm.rms_norm(x, weight, eps, residual, gemma)
    if residual is not None:
        rows, summed = rows
        residual_out.copy_(summed)
    got_q, got_scale = reference_norm_quant.quantize_rows(rows, q.dtype, group_size)
    q.copy_(got_q)
    scale.copy_(got_scale)
    if normed is not None:
        normed.copy_(rows)


def _torch_silu_and_mul_quant(x, group_size, q, scale):
    got_q, got_scale = reference_norm_quant.silu_and_mul_quant(x, group_size, q.dtype)
    q.copy_(got_q)
    scale.copy_(got_scale)


def _triton_row_supports(x, row_length: int, q) -> str | None:
    if row_length > TRITON_MAX_HIDDEN:
        return f"row length {row_length} exceeds one row per program ({TRITON_MAX_HIDDEN})"
    if q.dtype == FP8_DTYPE and x.is_cuda and not fp8_e4m3fn_native(x.device):
        return "triton fp8 e4m3fn needs an NVIDIA GPU of compute capability 8.9+ or an AMD gfx95x"
    return None


def _triton_rms_supports(x, weight, eps, residual, gemma, group_size, q, scale, residual_out, normed) -> str | None:
    if any(t is not None and t.stride()[-1] != 1 for t in (x, weight, residual, residual_out, normed)):
        return "triton rms_norm_quant needs the last dim of x, weight and residual contiguous"
    return _triton_row_supports(x, x.shape[-1], q)


def _unit_last_stride(t: Tensor | None) -> bool:
    return t is None or t.stride()[-1] == 1


def _triton_rms_key(x, weight, eps, residual, gemma, group_size, q, scale, residual_out, normed):
    """What :func:`_triton_rms_supports` reads (an absent tensor passes; the device is in every signature)."""
    return (x.shape[-1] > TRITON_MAX_HIDDEN, x.stride()[-1] == 1, weight.stride()[-1] == 1,
            _unit_last_stride(residual), _unit_last_stride(residual_out), _unit_last_stride(normed), q.dtype)


def _triton_silu_supports(x, group_size, q, scale) -> str | None:
    if x.stride()[-1] != 1:
        return "triton silu_and_mul_quant needs the last dim of x contiguous"
    return _triton_row_supports(x, x.shape[-1] // 2, q)


def _triton_silu_key(x, group_size, q, scale):
    """What :func:`_triton_silu_supports` reads."""
    return x.shape[-1] // 2 > TRITON_MAX_HIDDEN, x.stride()[-1] == 1, q.dtype


RMS_NORM_QUANT.register("torch", _torch_rms_norm_quant)
RMS_NORM_QUANT.register("triton", "atom_core.ops.triton.norm_quant:rms_norm_quant", _triton_rms_supports,
                        _triton_rms_key)
SILU_AND_MUL_QUANT.register("torch", _torch_silu_and_mul_quant)
SILU_AND_MUL_QUANT.register("triton", "atom_core.ops.triton.norm_quant:silu_and_mul_quant", _triton_silu_supports,
                            _triton_silu_key)


@custom_op("rms_norm_quant", mutates_args=("q", "scale", "residual_out", "normed"))
def _rms_norm_quant_op(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None, gemma: bool, group_size: int,
                       q: Tensor, scale: Tensor, residual_out: Tensor | None, normed: Tensor | None,
                       backend: str | None) -> None:
    RMS_NORM_QUANT(x, weight, eps, residual, gemma, group_size, q, scale, residual_out, normed, backend=backend)


@_rms_norm_quant_op.register_fake
def _(x, weight, eps, residual, gemma, group_size, q, scale, residual_out, normed, backend) -> None:
    return None


@custom_op("silu_and_mul_quant", mutates_args=("q", "scale"))
def _silu_and_mul_quant_op(x: Tensor, group_size: int, q: Tensor, scale: Tensor, backend: str | None) -> None:
    SILU_AND_MUL_QUANT(x, group_size, q, scale, backend=backend)


@_silu_and_mul_quant_op.register_fake
def _(x, group_size, q, scale, backend) -> None:
    return None


def _check_group_size(group_size, row_length: int) -> None:
    """Always run (cheap): a power of two, or one group per row."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or (
            group_size < row_length and group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a power of two or at least the row length {row_length}, "
                         f"got {group_size!r}")


def _check_dtype(dtype) -> None:
    if dtype not in QUANT_DTYPES:
        raise TypeError(f"dtype must be one of {[str(d) for d in QUANT_DTYPES]}, got {dtype}")


def _check_rms_norm_quant_args(x, weight, eps, residual, dtype) -> None:
    """The per-call checks, run in debug mode only (atom_core.ops.validation): rms_norm's and the format."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_eps(eps)
    check_tensor("weight", weight, ndim=1)
    check_shape("weight", weight, (x.shape[-1],))
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,))
        check_shape("residual", residual, tuple(x.shape))
    check_same_device(x=x, weight=weight, residual=residual)
    _check_dtype(dtype)


def _quant_outputs(x: Tensor, row_length: int, group_size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """q [T, row_length] of dtype and scale [T, G] fp32, on x's device."""
    q = torch.empty(x.shape[0], row_length, dtype=dtype, device=x.device)
    scale = torch.empty(x.shape[0], -(-row_length // group_size), dtype=torch.float32, device=x.device)
    return q, scale


def rms_norm_quant(x: Tensor, weight: Tensor, eps: float = 1e-6, *, residual: Tensor | None = None,
                   gemma: bool = False, group_size: int = GROUP_SIZE, dtype: torch.dtype = FP8_DTYPE,
                   normed: Tensor | None = None, backend: str | None = None):
    """:func:`rms_norm` of the rows of ``x`` quantized per group: exactly ``per_group_quant(rms_norm(...))``.

    x: [T, D] fp32/fp16/bf16; weight: [D]; residual: [T, D] like x or None; gemma as in :func:`rms_norm`.
    dtype: ``torch.float8_e4m3fn`` or ``torch.int8``; group_size: a power of two, or >= D for one
    scale per row (per-token).
    Returns ``(q [T, D] of dtype, scale [T, ceil(D / group_size)] fp32)`` with ``q * scale`` ≈ the
    normalised rows (rounded to x's dtype first, as ``rms_norm`` returns them); with a residual,
    ``(q, scale, residual_out)`` where ``residual_out = x + residual`` [T, D] in x's dtype is the new
    residual stream and the rows normalised are ``residual_out``'s.
    normed: [T, D] of x's dtype (last dim contiguous), or None: also receives the normalised rows themselves
    (what ``rms_norm`` returns), for a consumer that reads both (a MoE block: its router the rows, its experts
    the quantized rows); same launch.
    """
    if debug_enabled():
        _check_rms_norm_quant_args(x, weight, eps, residual, dtype)
    _check_group_size(group_size, x.shape[-1])
    q, scale = _quant_outputs(x, x.shape[-1], group_size, dtype)
    if normed is not None:
        check_out("normed", normed, x.shape, x.dtype, x.device)
    residual_out = None if residual is None else torch.empty_like(x)
    call_op("rms_norm_quant", x, weight, float(eps), residual, bool(gemma), group_size, q, scale, residual_out,
            normed, backend)
    return (q, scale) if residual is None else (q, scale, residual_out)


def silu_and_mul_quant(x: Tensor, *, group_size: int = GROUP_SIZE, dtype: torch.dtype = FP8_DTYPE,
                       backend: str | None = None) -> tuple[Tensor, Tensor]:
    """:func:`silu_and_mul` quantized per group: exactly ``per_group_quant(silu_and_mul(x))``.

    x: [T, 2I] = [gate | up], fp32/fp16/bf16; dtype: ``torch.float8_e4m3fn`` or ``torch.int8``;
    group_size: a power of two, or >= I for one scale per row (per-token).
    Returns ``(q [T, I] of dtype, scale [T, ceil(I / group_size)] fp32)`` with ``q * scale`` ≈
    ``silu(gate) * up`` (fp32 math, rounded to x's dtype first, as ``silu_and_mul`` returns it).
    """
    if debug_enabled():
        check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
        if x.shape[1] % 2:
            raise ValueError(f"x must have an even number of columns (gate and up), got shape {tuple(x.shape)}")
        _check_dtype(dtype)
    inter = x.shape[-1] // 2
    _check_group_size(group_size, inter)
    q, scale = _quant_outputs(x, inter, group_size, dtype)
    call_op("silu_and_mul_quant", x, group_size, q, scale, backend)
    return q, scale
