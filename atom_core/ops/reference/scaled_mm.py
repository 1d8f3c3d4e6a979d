"""Reference scaled GEMMs: dequantize both operands, multiply in fp32, add the bias, cast.

Legend: M = tokens (rows of the activation), N = output features, K = input features.
Weights are stored [N, K] like ``nn.Linear.weight``; every scale *multiplies* (``x ≈ q * scale``).

    out[m, n] = sum_k (a[m, k] * a_scale(m, k)) * (w[n, k] * w_scale(n, k))  (+ bias[n]), in fp32,
    then cast to ``out_dtype``.

Scale layouts (fp32):

| format | a (activation) | a_scale | w (weight) | w_scale |
|---|---|---|---|---|
| per-tensor | fp8 e4m3fn or int8 [M, K] | one element ([] or [1]) | same dtype [N, K] | one element |
| per-token x per-channel | fp8 or int8 [M, K] | [M, 1] | same dtype [N, K] | [N, 1] |
| block | fp8 [M, K] | [M, ceil(K/128)]: 1 x 128 groups | fp8 [N, K] | [ceil(N/128), ceil(K/128)]: 128 x 128 blocks |

The block format is DeepSeek-V3's: ``w_scale`` is the checkpoint's ``weight_scale_inv`` as stored
(despite the name, it multiplies). Partial groups/blocks at the K and N edges use their own scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops.reference.quant import GROUP_SIZE, expand_group_scales

BLOCK = GROUP_SIZE  # weight blocks are BLOCK x BLOCK, activation groups 1 x BLOCK


def _finish(a_deq: Tensor, w_deq: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    out = a_deq @ w_deq.t()  # fp32 operands: an fp32 matmul
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def scaled_mm_per_tensor(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None,
                         out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """a [M, K], w [N, K] (fp8 or int8), one-element fp32 scales → out [M, N] of ``out_dtype``."""
    return _finish(a.float() * a_scale.float().reshape(()), w.float() * w_scale.float().reshape(()), bias, out_dtype)


def scaled_mm_per_token(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """a [M, K] with a_scale [M, 1] (per token), w [N, K] with w_scale [N, 1] (per output channel)."""
    return _finish(a.float() * a_scale.float(), w.float() * w_scale.float(), bias, out_dtype)


def expand_block_scales(w_scale: Tensor, rows: int, cols: int, block: int = BLOCK) -> Tensor:
    """w_scale [ceil(N/block), ceil(K/block)] → [N, K]: element (n, k) uses block (n // block, k // block)."""
    return w_scale.float().repeat_interleave(block, dim=0)[:rows].repeat_interleave(block, dim=1)[:, :cols]


def scaled_mm_block(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None,
                    out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """a [M, K] fp8 with a_scale [M, ceil(K/128)] (1 x 128 groups), w [N, K] fp8 with
    w_scale [ceil(N/128), ceil(K/128)] (128 x 128 blocks)."""
    cols, n = a.shape[1], w.shape[0]
    a_deq = a.float() * expand_group_scales(a_scale, cols, BLOCK)
    w_deq = w.float() * expand_block_scales(w_scale, n, cols)
    return _finish(a_deq, w_deq, bias, out_dtype)
