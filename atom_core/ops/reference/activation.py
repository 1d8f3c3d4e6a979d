"""Reference gated activations: ``act(gate) * up`` over the two halves of each row, plain torch in fp32.

Legend: T = tokens (rows), I = intermediate size (the output width; the input is 2I wide).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = x.float().chunk(2, dim=-1)  # x[:, :I], x[:, I:]
    return gate, up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] → [T, I] = silu(x[:, :I]) * x[:, I:], silu(g) = g * sigmoid(g). Output in x's dtype."""
    gate, up = _halves(x)
    return (F.silu(gate) * up).to(x.dtype)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x [T, 2I] → [T, I] = gelu(x[:, :I]) * x[:, I:].

    approximate="none": gelu(g) = g/2 * (1 + erf(g / sqrt(2)));
    "tanh": g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))).
    """
    gate, up = _halves(x)
    return (F.gelu(gate, approximate=approximate) * up).to(x.dtype)


def swiglu_clamped(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU on interleaved columns: x [T, 2I] → [T, I].

    gate = x[:, 0::2].clamp(max=limit), up = x[:, 1::2].clamp(-limit, limit),
    out = (up + 1) * gate * sigmoid(alpha * gate).
    """
    h = x.float()
    gate = h[:, 0::2].clamp(max=limit)
    up = h[:, 1::2].clamp(min=-limit, max=limit)
    return ((up + 1) * gate * torch.sigmoid(alpha * gate)).to(x.dtype)
