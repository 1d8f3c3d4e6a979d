"""AITER adapters for dynamic activation quantization (aiter/ops/quant.py): AITER writes into the
q and scale buffers the op allocated. fp8 only (int8 is refused by the op's rule, see
``atom_core.ops.quant``), on GPUs whose AITER fp8 is e4m3fn.

Legend: T rows, K columns, G = K / group_size groups per row.
"""

from __future__ import annotations

import aiter


def per_tensor_quant(x, static_scale, q, scale):
    """scale [1]: dynamic (``dynamic_per_tensor_quant`` writes amax / qmax) or the static one given."""
    if static_scale is None:
        aiter.dynamic_per_tensor_quant(q, x, scale)
    else:
        scale.copy_(static_scale.reshape(1))
        aiter.static_per_tensor_quant(q, x, scale)


def per_token_quant(x, q, scale):
    """scale [T, 1], one per row."""
    aiter.dynamic_per_token_scaled_quant(q, x, scale)


def per_group_quant(x, group_size, q, scale):
    """scale [T, G]: each group is a row of ``x.view(-1, group_size)`` (x contiguous, K % group_size == 0),
    as AITER's own per_group_quant_hip does for fp32 scales; row-major scales (shuffle_scale=False)."""
    aiter.dynamic_per_token_scaled_quant(q.view(-1, group_size), x.view(-1, group_size), scale.view(-1, 1),
                                         shuffle_scale=False)
