"""AITER adapters for normalisation (signatures in aiter/ops/rmsnorm.py and aiter/ops/norm.py)."""

from __future__ import annotations

import aiter


def rms_norm(x, weight, eps, residual, gemma, out, residual_out):
    if residual is None:
        out.copy_(aiter.rmsnorm2d_fwd(x, weight, eps))
    else:
        aiter.rmsnorm2d_fwd_with_add(out, x, residual, residual_out, weight, eps)


def layer_norm(x, weight, bias, eps, residual, out, residual_out):
    if residual is not None:
        residual_out.copy_(x + residual)
        x = residual_out
    out.copy_(aiter.layernorm2d_fwd(x, weight, bias, eps))
