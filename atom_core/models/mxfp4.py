"""MXFP4 checkpoint tensors (gpt-oss releases store their expert weights so) and their reference decoder.

MXFP4 (OCP microscaling) stores a weight ``W [..., R, C]`` as two tensors:

- ``NAME_blocks`` uint8 ``[..., R, G, B]``: ``C = G * 32`` FP4 (E2M1) codes, two per byte. Byte
  ``b`` of a block holds element ``2b`` in its low nibble and element ``2b + 1`` in its high
  nibble (so ``B = 16`` bytes for the 32 elements of a block);
- ``NAME_scales`` uint8 ``[..., R, G]``: one E8M0 scale per block of 32, the power of two
  ``2 ** (scale - 127)``; 255 encodes NaN.

An E2M1 code is a sign bit and a 3-bit magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6. Element
``W[..., r, 32 g + j] = value(code) * 2 ** (scales[..., r, g] - 127)``; every such value is exact
in bfloat16 and float32. Models keep them packed: gpt-oss's MXFP4 experts load ``NAME_blocks`` (its last
two dims flattened to ``[..., R, C/2]``) and ``NAME_scales`` as stored and compute with
``ops.fused_experts_quant(weight_format="mxfp4")``, whose twin and kernels decode in registers; the
decoder here (``dequantize_mxfp4``) is the reference that tests and tools compare against.
"""

from __future__ import annotations

import torch

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
E8M0_BIAS = 127
E8M0_NAN = 255

# code -> value: codes 0..7 positive, 8..15 the same magnitudes negated.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _E2M1_MAGNITUDES + tuple(-m for m in _E2M1_MAGNITUDES)

_ROWS_PER_CHUNK = 1 << 16  # bounds the int64 index temporaries of one decode pass


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks`` uint8 [..., G, B] and ``scales`` uint8 [..., G] -> ``dtype`` [..., G * 2B] on their device."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} "
                         "plus a last dim of bytes per block")
    if bool((scales == E8M0_NAN).any()):
        raise ValueError("MXFP4 scales hold 255, the E8M0 encoding of NaN")
    *lead, groups, nbytes = blocks.shape
    flat_blocks = blocks.reshape(-1, nbytes)
    exponents = scales.reshape(-1, 1).to(torch.int32) - E8M0_BIAS
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(flat_blocks.shape[0], 2 * nbytes, dtype=dtype, device=blocks.device)
    for start in range(0, flat_blocks.shape[0], _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        chunk = flat_blocks[rows]
        values = torch.empty(chunk.shape[0], 2 * nbytes, dtype=torch.float32, device=blocks.device)
        values[:, 0::2] = lut[(chunk & 0x0F).long()]
        values[:, 1::2] = lut[(chunk >> 4).long()]
        out[rows] = torch.ldexp(values, exponents[rows])
    return out.reshape(*lead, groups * 2 * nbytes)
