"""Normalisation ops: ``rms_norm`` and ``layer_norm``, each with an optional fused residual add.

Legend: T = tokens (rows), D = hidden size.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from atom_core.ops import reference
from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.validation import (FLOAT_DTYPES, check_out, check_out_shape, check_shape, check_tensor,
                                      debug_enabled)

RMS_NORM = Op("rms_norm")
LAYER_NORM = Op("layer_norm")


def _torch_rms_norm(x, weight, eps, residual, gemma, out, residual_out):
    result = reference.rms_norm(x, weight, eps, residual, gemma)
    _copy_results(result, out, residual_out)


def _torch_layer_norm(x, weight, bias, eps, residual, out, residual_out):
    result = reference.layer_norm(x, weight, bias, eps, residual)
    _copy_results(result, out, residual_out)


def _copy_results(result, out, residual_out):
    if residual_out is None:
        out.copy_(result)
    else:
        out.copy_(result[0])
        residual_out.copy_(result[1])


TRITON_MAX_HIDDEN = 65536  # one row per program, held in registers


def _triton_supports(x, weight, *rest) -> str | None:
    tensors = [t for t in (x, weight, *rest) if isinstance(t, Tensor)]
    if any(t.stride(-1) != 1 for t in tensors):
        return "triton norm kernels need the last dim contiguous"
    if x.shape[-1] > TRITON_MAX_HIDDEN:
        return f"hidden size {x.shape[-1]} exceeds one row per program ({TRITON_MAX_HIDDEN})"
    return None


def _unit_last_stride(t: Tensor | None) -> bool:
    return t is None or t.stride()[-1] == 1


def _triton_rms_key(x, weight, eps, residual, gemma, out, residual_out):
    """What :func:`_triton_supports` reads of an rms_norm call (an absent tensor passes)."""
    return (x.shape[-1] > TRITON_MAX_HIDDEN, x.stride()[-1] == 1, weight.stride()[-1] == 1, out.stride()[-1] == 1,
            _unit_last_stride(residual), _unit_last_stride(residual_out))


def _triton_ln_key(x, weight, bias, eps, residual, out, residual_out):
    """What :func:`_triton_supports` reads of a layer_norm call (an absent tensor passes)."""
    return (x.shape[-1] > TRITON_MAX_HIDDEN, x.stride()[-1] == 1, weight.stride()[-1] == 1, out.stride()[-1] == 1,
            _unit_last_stride(bias), _unit_last_stride(residual), _unit_last_stride(residual_out))


def _aiter_rms_supports(x, weight, eps, residual, gemma, out, residual_out) -> str | None:
    if gemma:
        return "aiter rmsnorm has no (1 + w) weight variant"
    if not all(t.is_contiguous() for t in (x, weight, out) if t is not None):
        return "aiter rmsnorm needs contiguous tensors"
    return None


def _aiter_rms_key(x, weight, eps, residual, gemma, out, residual_out):
    """What :func:`_aiter_rms_supports` reads."""
    return gemma, x.is_contiguous(), weight.is_contiguous(), out.is_contiguous()


def _aiter_ln_supports(x, weight, bias, eps, residual, out, residual_out) -> str | None:
    if bias is None:
        return "aiter layernorm2d_fwd needs a bias"
    return None if x.is_contiguous() else "aiter layernorm needs contiguous tensors"


def _aiter_ln_key(x, weight, bias, eps, residual, out, residual_out):
    """What :func:`_aiter_ln_supports` reads."""
    return bias is None, x.is_contiguous()


RMS_NORM.register("torch", _torch_rms_norm)
RMS_NORM.register("triton", "atom_core.ops.triton.norm:rms_norm", _triton_supports, _triton_rms_key)
RMS_NORM.register("aiter", "atom_core.ops.aiter.norm:rms_norm", _aiter_rms_supports, _aiter_rms_key)
LAYER_NORM.register("torch", _torch_layer_norm)
LAYER_NORM.register("triton", "atom_core.ops.triton.norm:layer_norm", _triton_supports, _triton_ln_key)
LAYER_NORM.register("aiter", "atom_core.ops.aiter.norm:layer_norm", _aiter_ln_supports, _aiter_ln_key)


@custom_op("rms_norm", mutates_args=("out", "residual_out"))
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor], gemma: bool,
                 out: Tensor, residual_out: Optional[Tensor], backend: Optional[str]) -> None:
    RMS_NORM(x, weight, eps, residual, gemma, out, residual_out, backend=backend)


@_rms_norm_op.register_fake
def _(x, weight, eps, residual, gemma, out, residual_out, backend) -> None:
    return None


@custom_op("layer_norm", mutates_args=("out", "residual_out"))
def _layer_norm_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, residual: Optional[Tensor],
                   out: Tensor, residual_out: Optional[Tensor], backend: Optional[str]) -> None:
    LAYER_NORM(x, weight, bias, eps, residual, out, residual_out, backend=backend)


@_layer_norm_op.register_fake
def _(x, weight, bias, eps, residual, out, residual_out, backend) -> None:
    return None


def _check_eps(eps) -> None:
    # eps <= 0 turns an all-zero row (a padding token) into NaN (0 * rsqrt(0)); NaN turns every row into NaN.
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")


def _check_norm_args(x, weight, bias, eps, residual, out, residual_out):
    """The per-call checks, run in debug mode only (atom_core.ops.validation)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_eps(eps)
    d = x.shape[-1]
    check_tensor("weight", weight, ndim=1)
    check_shape("weight", weight, (d,))
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        check_shape("bias", bias, (d,))
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,))
        check_shape("residual", residual, tuple(x.shape))
    _check_residual_out(residual, residual_out)
    check_out("out", out, x.shape, x.dtype, x.device)
    check_out("residual_out", residual_out, x.shape, x.dtype, x.device)


def _check_rows(x) -> None:
    """Always on (one ``dim()``): every backend reads x as [T, D]; the twin would take more dims, Triton not."""
    if x.dim() != 2:
        raise ValueError(f"x must have 2 dims ([T, D]), got shape {tuple(x.shape)}: pass x.reshape(-1, x.shape[-1])")


def _check_residual_out(residual, residual_out) -> None:
    """Always on, like the out shapes: without a residual there is no residual stream to write."""
    if residual is None and residual_out is not None:
        raise ValueError("residual_out given without residual")


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, residual: Tensor | None = None, gemma: bool = False,
             out: Tensor | None = None, residual_out: Tensor | None = None, backend: str | None = None):
    """RMSNorm of the rows of ``x``, optionally after adding ``residual``.

    x: [T, D] fp32/fp16/bf16; weight: [D]; residual: [T, D] like x or None.
    gemma=True scales by ``1 + weight`` (Gemma's convention).
    Returns out [T, D] (x's dtype); with a residual, ``(out, residual_out)`` where
    ``residual_out = x + residual`` (the new residual stream) and ``out = norm(residual_out)``.
    """
    _check_rows(x)
    if debug_enabled():
        _check_norm_args(x, weight, None, eps, residual, out, residual_out)
    elif out is not None or residual_out is not None:  # always on (see check_out_shape)
        check_out_shape("out", out, x.shape)
        check_out_shape("residual_out", residual_out, x.shape)
        _check_residual_out(residual, residual_out)
    out = torch.empty_like(x) if out is None else out
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    call_op("rms_norm", x, weight, float(eps), residual, bool(gemma), out, residual_out, backend)
    return out if residual is None else (out, residual_out)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float = 1e-5, *, residual: Tensor | None = None,
               out: Tensor | None = None, residual_out: Tensor | None = None, backend: str | None = None):
    """LayerNorm of the rows of ``x`` (weight [D], bias [D] or None), optionally after adding ``residual``.

    Shapes and the residual convention as in :func:`rms_norm`.
    """
    _check_rows(x)
    if debug_enabled():
        _check_norm_args(x, weight, bias, eps, residual, out, residual_out)
    elif out is not None or residual_out is not None:  # always on (see check_out_shape)
        check_out_shape("out", out, x.shape)
        check_out_shape("residual_out", residual_out, x.shape)
        _check_residual_out(residual, residual_out)
    out = torch.empty_like(x) if out is None else out
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    call_op("layer_norm", x, weight, bias, float(eps), residual, out, residual_out, backend)
    return out if residual is None else (out, residual_out)
