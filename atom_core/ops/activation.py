"""Gated activations of an MLP: ``silu_and_mul``, ``gelu_and_mul`` and GPT-OSS's ``swiglu_clamped``.

Legend: T = tokens (rows), I = intermediate size. The input is the fused gate/up projection [T, 2I]:
halves ``[gate | up]`` for silu/gelu, interleaved columns ``gate, up, gate, up, ...`` for swiglu_clamped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import activation as reference_activation
from atom_core.ops.validation import FLOAT_DTYPES, check_out, check_out_shape, check_tensor, debug_enabled

SILU_AND_MUL = Op("silu_and_mul")
GELU_AND_MUL = Op("gelu_and_mul")
SWIGLU_CLAMPED = Op("swiglu_clamped")

GELU_APPROXIMATIONS = ("none", "tanh")


def _torch_silu_and_mul(x, out):
    out.copy_(reference_activation.silu_and_mul(x))


def _torch_gelu_and_mul(x, approximate, out):
    out.copy_(reference_activation.gelu_and_mul(x, approximate))


def _torch_swiglu_clamped(x, alpha, limit, out):
    out.copy_(reference_activation.swiglu_clamped(x, alpha, limit))


def _triton_supports(x, *rest) -> str | None:
    out = rest[-1]
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        return "triton activation kernels need the last dim of x and out contiguous"
    return None


def _triton_key(x, *rest):
    """What :func:`_triton_supports` reads (out is the last argument)."""
    return x.stride()[-1] == 1, rest[-1].stride()[-1] == 1


def _aiter_supports(x, *rest) -> str | None:
    out = rest[-1]
    # AITER's act_and_mul kernel indexes rows as token * 2I (input) and token * I (output).
    if not (x.is_contiguous() and out.is_contiguous()):
        return "aiter activation kernels need contiguous x and out"
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"aiter activation kernels are used for fp16/bf16 only, got {x.dtype}"
    return None


def _aiter_key(x, *rest):
    """What :func:`_aiter_supports` reads."""
    return x.is_contiguous(), rest[-1].is_contiguous(), x.dtype


SILU_AND_MUL.register("torch", _torch_silu_and_mul)
SILU_AND_MUL.register("triton", "atom_core.ops.triton.activation:silu_and_mul", _triton_supports, _triton_key)
SILU_AND_MUL.register("aiter", "atom_core.ops.aiter.activation:silu_and_mul", _aiter_supports, _aiter_key)
GELU_AND_MUL.register("torch", _torch_gelu_and_mul)
GELU_AND_MUL.register("triton", "atom_core.ops.triton.activation:gelu_and_mul", _triton_supports, _triton_key)
GELU_AND_MUL.register("aiter", "atom_core.ops.aiter.activation:gelu_and_mul", _aiter_supports, _aiter_key)
# AITER has no clamped (GPT-OSS) SwiGLU with adjustable alpha/limit: torch and triton only.
SWIGLU_CLAMPED.register("torch", _torch_swiglu_clamped)
SWIGLU_CLAMPED.register("triton", "atom_core.ops.triton.activation:swiglu_clamped", _triton_supports, _triton_key)


@custom_op("silu_and_mul", mutates_args=("out",))
def _silu_and_mul_op(x: Tensor, out: Tensor, backend: str | None) -> None:
    SILU_AND_MUL(x, out, backend=backend)


@_silu_and_mul_op.register_fake
def _(x, out, backend) -> None:
    return None


@custom_op("gelu_and_mul", mutates_args=("out",))
def _gelu_and_mul_op(x: Tensor, approximate: str, out: Tensor, backend: str | None) -> None:
    GELU_AND_MUL(x, approximate, out, backend=backend)


@_gelu_and_mul_op.register_fake
def _(x, approximate, out, backend) -> None:
    return None


@custom_op("swiglu_clamped", mutates_args=("out",))
def _swiglu_clamped_op(x: Tensor, alpha: float, limit: float, out: Tensor, backend: str | None) -> None:
    SWIGLU_CLAMPED(x, alpha, limit, out, backend=backend)


@_swiglu_clamped_op.register_fake
def _(x, alpha, limit, out, backend) -> None:
    return None


def _check_and_allocate(x: Tensor, out: Tensor | None) -> Tensor:
    """out [T, I] for x [T, 2I]: the caller's (its shape checked, always) or a new one; the other
    checks run in debug mode only (atom_core.ops.validation)."""
    if debug_enabled():
        check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
        if x.shape[1] % 2:
            raise ValueError(f"x must have an even number of columns (gate and up), got shape {tuple(x.shape)}")
    rows, columns = x.shape
    shape = (rows, columns // 2)
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if debug_enabled():
        check_out("out", out, shape, x.dtype, x.device)
    check_out_shape("out", out, shape)
    return out


def silu_and_mul(x: Tensor, *, out: Tensor | None = None, backend: str | None = None) -> Tensor:
    """``silu(x[:, :I]) * x[:, I:]``: x [T, 2I] fp32/fp16/bf16 → out [T, I] in x's dtype (fp32 math)."""
    out = _check_and_allocate(x, out)
    call_op("silu_and_mul", x, out, backend)
    return out


def gelu_and_mul(x: Tensor, *, approximate: str = "none", out: Tensor | None = None,
                 backend: str | None = None) -> Tensor:
    """``gelu(x[:, :I]) * x[:, I:]``: x [T, 2I] → out [T, I] in x's dtype.

    approximate="none" is the erf GELU, "tanh" the tanh approximation (as ``torch.nn.functional.gelu``).
    """
    if debug_enabled() and approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    out = _check_and_allocate(x, out)
    call_op("gelu_and_mul", x, approximate, out, backend)
    return out


def swiglu_clamped(x: Tensor, *, alpha: float = 1.702, limit: float = 7.0, out: Tensor | None = None,
                   backend: str | None = None) -> Tensor:
    """GPT-OSS's clamped SwiGLU. x [T, 2I] holds gate and up interleaved (gate = x[:, 0::2],
    up = x[:, 1::2]); out [T, I] = ``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = gate.clamp(max=limit)``, in x's dtype (fp32 math).
    """
    if debug_enabled() and not limit > 0:
        raise ValueError(f"limit must be > 0, got {limit!r}")
    out = _check_and_allocate(x, out)
    call_op("swiglu_clamped", x, float(alpha), float(limit), out, backend)
    return out
