"""Quantized operand tiles of the fused-MoE GEMMs (``atom_core.ops.triton.fused_moe``): what a K step
of the gate/up or down kernel does with an expert's weight tile and the activation tile it meets.

Weight formats (``W_FORMAT``, a constexpr of both kernels; layouts in ``atom_core.ops.reference.moe``):

- ``W_PLAIN``: weights in hidden's dtype (the unquantized path, unchanged);
- ``W_FP8_CHANNEL``: fp8 weights, one scale per output row; the activation rows arrive quantized to
  fp8 per token, and ``a_scale[m] * w_scale[n]`` multiplies the accumulator in the epilogue;
- ``W_FP8_BLOCK``: fp8 weights with a scale per 128 x 128 block; the activation rows arrive quantized
  per 1 x 128 group, and each K step covers exactly one 128-wide block column (BLOCK_K = 128), whose
  partial product is scaled by ``a_scale[m, step] * w_scale[n // 128, step]``;
- ``W_MXFP4``: packed E2M1 codes (two per byte along K: the even element in the low nibble) with an
  E8M0 scale per 32 along K. A K step loads the [BLOCK_K / 2, BLOCK_N] tile of bytes once, decodes
  each byte's two values in registers (:func:`mxfp4_pairs`) and meets them with the activation's even
  and odd columns: two dots of BLOCK_K / 2, in hidden's dtype. The weights never exist decoded in
  memory.

For the fp8 formats each GEMM's input is quantized once, by one launch before that GEMM, with the
activation quantization kernels of ``atom_core.ops.triton.quant`` (``per_group_quant`` with groups
of 128 for ``W_FP8_BLOCK``, ``per_token_quant`` for ``W_FP8_CHANNEL``): hidden [T, H] before the
gate/up kernel, the activation [T * K, I] before the down kernel. Those kernels equal the twins
(``reference.quant``) bit for bit, so the fp8 values the GEMMs read are the twin's; the GEMM kernels
load fp8 rows and fp32 scales and do no quantization arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

W_PLAIN = tl.constexpr(0)
W_FP8_CHANNEL = tl.constexpr(1)
W_FP8_BLOCK = tl.constexpr(2)
W_MXFP4 = tl.constexpr(3)
FORMAT_CODES = {None: 0, "fp8_channel": 1, "fp8_block": 2, "mxfp4": 3}  # weight_format -> W_FORMAT

FP8_BLOCK = tl.constexpr(128)
MXFP4_BLOCK = tl.constexpr(32)


@triton.jit
def e2m1_value(code):
    """int32 E2M1 codes (0..15) → fp32 values, ``E2M1_VALUES[code]`` exactly (-0.0 for code 8).

    The code's sign bit becomes fp16's sign and its three magnitude bits (2-bit exponent e, 1-bit
    mantissa m) fp16's two lowest exponent bits and top mantissa bit: that fp16 is the value times
    2**-14 (e > 0: 2**(e - 15) * (1 + m / 2); e = 0: the subnormal m * 2**-15), and the conversion
    to fp32 and the product with 2**14 are exact. Four integer operations and two conversions.
    """
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_value(scale):
    """int32 E8M0 byte (0..255) → fp32 2**(scale - 127), exactly: the byte is the fp32 exponent
    field; 0 is the subnormal 2**-127 (bits 0x00400000); 255 is NaN."""
    bits = tl.where(scale == 0, 0x00400000, scale << 23)
    return tl.where(scale == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_pairs(byte_ptrs, scale_ptrs, mask):
    """Packed MXFP4 bytes and their blocks' E8M0 scales (pointer tiles of one shape) → the fp32 values
    of the two elements each byte holds: (low nibble: the even element, high nibble: the odd one),
    each times its block's ``2 ** (e8m0 - 127)``. One byte load per two elements."""
    packed = tl.load(byte_ptrs, mask=mask, other=0).to(tl.int32)
    scale = e8m0_value(tl.load(scale_ptrs, mask=mask, other=127).to(tl.int32))
    return e2m1_value(packed & 0xF) * scale, e2m1_value(packed >> 4) * scale


@triton.jit
def _decode_mxfp4_kernel(packed_ptr, scales_ptr, out_ptr, rows, cols, stride_pr, stride_sr, stride_or,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out [R, C] fp32 = the decode :func:`mxfp4_pairs` does inside the GEMMs (for tests); a program
    covers BLOCK_R rows x BLOCK_C bytes (2 * BLOCK_C elements)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (b < cols // 2)[None, :]
    byte_ptrs = packed_ptr + r[:, None] * stride_pr + b[None, :]
    scale_ptrs = scales_ptr + r[:, None] * stride_sr + (b // (MXFP4_BLOCK // 2))[None, :]
    even, odd = mxfp4_pairs(byte_ptrs, scale_ptrs, mask)
    out_ptrs = out_ptr + r[:, None] * stride_or + 2 * b[None, :]
    tl.store(out_ptrs, even, mask=mask)
    tl.store(out_ptrs + 1, odd, mask=mask)


def decode_mxfp4(packed, scales):
    """packed uint8 [R, C/2], scales uint8 [R, C/32] (last dims contiguous) → fp32 [R, C], decoded by
    the kernels' own :func:`mxfp4_pairs` (what tests pin against the checkpoint decoder)."""
    import torch

    rows, cols = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(rows, cols, dtype=torch.float32, device=packed.device)
    grid = (triton.cdiv(rows, 16), triton.cdiv(cols // 2, 32))
    _decode_mxfp4_kernel[grid](packed, scales, out, rows, cols, packed.stride(0), scales.stride(0), out.stride(0),
                               BLOCK_R=16, BLOCK_C=32)
    return out
