"""Reference per-head RMSNorm of q and k followed by RoPE: literally the two twins, one after the other.

Legend: T = tokens, Hq / Hk = query / key heads, D = head size, R = rotary dim (<= D, even),
P = cached positions.

This is the definition ``ops.qk_norm_rope_`` is checked against. Each head is normalised exactly as
Qwen3's ``RMSNorm`` module did before the fusion (the heads flattened to rows [T * H, D], then
:func:`~atom_core.ops.reference.norm.rms_norm`, rounded to the input dtype), and the rounded values
are rotated by :func:`~atom_core.ops.reference.rope.apply_rope_`; so the result equals
``rms_norm`` then ``apply_rope_`` bit for bit.
"""

from __future__ import annotations

import torch

from atom_core.ops.reference.norm import rms_norm
from atom_core.ops.reference.rope import apply_rope_


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, eps: float, is_neox: bool = True) -> None:
    """RMS-normalise every head of q [T, Hq, D] (weight q_weight [D]) and k [T, Hk, D] (k_weight [D]) over
    its D values, then rotate its first R dims by positions [T] (rows of cos_sin_cache [P, R]); in place."""
    for x, weight in ((q, q_weight), (k, k_weight)):
        rows = x.reshape(-1, x.shape[-1])  # [T * H, D]: a copy when x is a strided view, as RMSNorm made
        x.copy_(rms_norm(rows, weight, eps).view(x.shape))
    apply_rope_(q, k, positions, cos_sin_cache, is_neox=is_neox)
