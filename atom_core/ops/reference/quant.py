"""Reference dynamic activation quantization: the definition of every scale and rounding rule.

Legend: T = tokens (rows), K = the quantized (last) dim, G = groups per row = ceil(K / group_size).

Formats: ``torch.float8_e4m3fn`` (OCP fp8, largest finite 448) and ``torch.int8`` (symmetric, ±127;
-128 is never produced). Scales are fp32 and *multiply*: ``x ≈ q * scale``.

- scale = max(amax, AMAX_FLOOR) / qmax over the tensor (per-tensor), a row (per-token) or a group of
  ``group_size`` consecutive values of a row (per-group; the last group of a row may be shorter).
  The floor keeps an all-zero row (a padding token) finite: its scale is 1e-10 / qmax and its
  values quantize to 0.
- int8: q = clamp(round(x / scale), -127, 127), rounding half to even (``torch.round``).
- fp8:  q = clamp(x / scale, -448, 448) cast to e4m3fn, which rounds to nearest, ties to even.

``x / scale`` is one IEEE fp32 division of ``x`` (cast to fp32) by the fp32 scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
INT8_DTYPE = torch.int8
QUANT_DTYPES = (FP8_DTYPE, INT8_DTYPE)
QMAX = {FP8_DTYPE: 448.0, INT8_DTYPE: 127.0}  # largest magnitude each format stores
# SGLang's eps for per-token-group fp8 quantization: small enough never to touch a real activation
# row, large enough that amax / qmax is a normal fp32 number.
AMAX_FLOOR = 1e-10
GROUP_SIZE = 128  # the 1 x 128 activation groups of DeepSeek-style block FP8


def qmax(dtype: torch.dtype) -> float:
    """Largest magnitude of the quantized format (448 for fp8 e4m3fn, 127 for int8)."""
    return QMAX[dtype]


def scale_from_amax(amax: Tensor, dtype: torch.dtype) -> Tensor:
    """fp32 scale = max(amax, AMAX_FLOOR) / qmax, elementwise, one IEEE division. (qmax is a tensor on
    amax's device: CUDA torch divides by a Python number as a multiplication by its reciprocal, one ulp
    off the division the CPU, the kernels and the definition make.)"""
    return amax.float().clamp(min=AMAX_FLOOR) / torch.tensor(qmax(dtype), dtype=torch.float32, device=amax.device)


def round_to_format(y: Tensor, dtype: torch.dtype) -> Tensor:
    """y (fp32, already divided by its scale) → the stored value: clamp to ±qmax, then round
    (int8: half to even; fp8: the cast's round to nearest even)."""
    bound = qmax(dtype)
    y = y.clamp(-bound, bound)
    return torch.round(y).to(dtype) if dtype == INT8_DTYPE else y.to(dtype)


def per_tensor_quant(x: Tensor, dtype: torch.dtype = FP8_DTYPE, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [T, K] float → (q [T, K] of ``dtype``, scale [1] fp32). One scale for the whole tensor:
    dynamic (max |x| / qmax) unless ``scale`` (fp32, one element) is given (static)."""
    xf = x.float()
    if scale is None:
        scale = scale_from_amax(xf.abs().amax() if xf.numel() else xf.new_zeros(()), dtype)
    scale = scale.float().reshape(1)
    return round_to_format(xf / scale, dtype), scale


def per_token_quant(x: Tensor, dtype: torch.dtype = FP8_DTYPE) -> tuple[Tensor, Tensor]:
    """x [T, K] float → (q [T, K] of ``dtype``, scale [T, 1] fp32): one scale per row (token)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True) if xf.shape[1] else xf.new_zeros(xf.shape[0], 1)
    scale = scale_from_amax(amax, dtype)
    return round_to_format(xf / scale, dtype), scale


def per_group_quant(x: Tensor, dtype: torch.dtype = FP8_DTYPE,
                    group_size: int = GROUP_SIZE) -> tuple[Tensor, Tensor]:
    """x [T, K] float → (q [T, K] of ``dtype``, scale [T, G] fp32), G = ceil(K / group_size): one scale
    per ``group_size`` consecutive values of a row (``scale[t, g]`` covers columns
    ``g * group_size ... min(K, (g + 1) * group_size) - 1``)."""
    rows, cols = x.shape
    groups = -(-cols // group_size)
    padded = torch.zeros(rows, groups * group_size, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.float()  # zero padding changes no group's amax
    grouped = padded.view(rows, groups, group_size)
    scale = scale_from_amax(grouped.abs().amax(dim=2), dtype) if groups else padded.new_zeros(rows, 0)
    q = round_to_format(grouped / scale[:, :, None], dtype).view(rows, groups * group_size)
    return q[:, :cols].contiguous(), scale


def expand_group_scales(scale: Tensor, cols: int, group_size: int = GROUP_SIZE) -> Tensor:
    """scale [T, G] → [T, K]: each column's scale (column k uses group k // group_size)."""
    return scale.float().repeat_interleave(group_size, dim=1)[:, :cols]


def dequantize(q: Tensor, scale: Tensor, group_size: int | None = None) -> Tensor:
    """fp32 ``q * scale``. scale: [1] or [] (per-tensor), [T, 1] (per-token), or [T, G] with
    ``group_size`` (per-group)."""
    if group_size is not None:
        scale = expand_group_scales(scale, q.shape[1], group_size)
    return q.float() * scale.float()


def per_block_quant(w: Tensor, dtype: torch.dtype = FP8_DTYPE, block: int = GROUP_SIZE) -> tuple[Tensor, Tensor]:
    """Weight quantization to the block format (load time, not an op): w [N, K] float →
    (q [N, K] of ``dtype``, scale [ceil(N/block), ceil(K/block)] fp32), one scale per block x block tile
    (DeepSeek's ``weight_scale_inv`` layout), with the rules above."""
    rows, cols = w.shape
    row_blocks, col_blocks = -(-rows // block), -(-cols // block)
    padded = torch.zeros(row_blocks * block, col_blocks * block, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(row_blocks, block, col_blocks, block)
    scale = scale_from_amax(tiles.abs().amax(dim=(1, 3)), dtype)
    q = round_to_format(tiles / scale[:, None, :, None], dtype).view(row_blocks * block, col_blocks * block)
    return q[:rows, :cols].contiguous(), scale
