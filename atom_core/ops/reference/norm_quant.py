"""Reference activation quantization fused into the op that produces the activation: literally the
two twins, one after the other.

Legend: T = tokens (rows), D = hidden size, I = intermediate size, G = ceil(row length / group_size).

- ``rms_norm_quant``: :func:`~atom_core.ops.reference.norm.rms_norm` (its output rounded to x's dtype),
  then :func:`~atom_core.ops.reference.quant.per_group_quant` of that output.
- ``silu_and_mul_quant``: :func:`~atom_core.ops.reference.activation.silu_and_mul` (rounded to x's
  dtype), then ``per_group_quant``.

The activation is rounded to x's dtype before it is quantized, so each equals the two-op pipeline bit
for bit. A group of at least the row's length is the whole row: one scale per row, which is
``per_token_quant``'s quantization.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops.reference.activation import silu_and_mul
from atom_core.ops.reference.norm import rms_norm
from atom_core.ops.reference.quant import FP8_DTYPE, GROUP_SIZE, per_group_quant


def quantize_rows(h: Tensor, dtype: torch.dtype, group_size: int) -> tuple[Tensor, Tensor]:
    """``per_group_quant`` of the activation h [T, C]; a group of at least C columns is the whole row."""
    # A group past the row's end holds the row and zero padding: the same as a group of the row's
    # length (zeros change no amax), without padding to group_size columns.
    return per_group_quant(h, dtype, min(group_size, max(h.shape[1], 1)))


def rms_norm_quant(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, gemma: bool = False,
                   group_size: int = GROUP_SIZE, dtype: torch.dtype = FP8_DTYPE):
    """x [T, D], weight [D], residual [T, D] like x or None → (q [T, D] of ``dtype``, scale [T, G] fp32),
    and residual_out = x + residual [T, D] (x's dtype) as a third output when residual is given."""
    normed = rms_norm(x, weight, eps, residual, gemma)
    if residual is None:
        return quantize_rows(normed, dtype, group_size)
    out, residual_out = normed
    return (*quantize_rows(out, dtype, group_size), residual_out)


def silu_and_mul_quant(x: Tensor, group_size: int = GROUP_SIZE,
                       dtype: torch.dtype = FP8_DTYPE) -> tuple[Tensor, Tensor]:
    """x [T, 2I] = [gate | up] → (q [T, I] of ``dtype``, scale [T, G] fp32) of silu(gate) * up."""
    return quantize_rows(silu_and_mul(x), dtype, group_size)
