"""Reference twins for normalisation: plain torch, computed in fp32."""

from __future__ import annotations

import torch


def rms_norm(x, weight, eps, residual=None, gemma=False):
    """RMSNorm over the last dim: ``x / sqrt(mean(x**2) + eps) * w`` (``w = 1 + weight`` when gemma).

    x: [T, D], weight: [D], residual: [T, D] or None. With a residual, the input is
    ``x + residual`` and the result is ``(out, x + residual)``. Outputs have x's dtype.
    """
    # The residual sum is rounded to x's dtype first, as a model adding in its own dtype would.
    h = x.float() if residual is None else (x + residual).float()
    w = weight.float() + 1.0 if gemma else weight.float()
    out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    return out if residual is None else (out, h.to(x.dtype))


def layer_norm(x, weight, bias, eps, residual=None):
    """LayerNorm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias``; residual as in rms_norm."""
    h = x.float() if residual is None else (x + residual).float()
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    out = (h - mean) * torch.rsqrt(var + eps) * weight.float()
    if bias is not None:
        out = out + bias.float()
    out = out.to(x.dtype)
    return out if residual is None else (out, h.to(x.dtype))
