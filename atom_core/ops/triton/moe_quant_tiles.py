"""Quantized operand tiles of the fused-MoE GEMMs (``atom_core.ops.triton.fused_moe``): what a K step
of the gate/up or down kernel does with an expert's weight tile and the activation tile it meets.

Weight formats (``W_FORMAT``, a constexpr of both kernels; layouts in ``atom_core.ops.reference.moe``):

- ``W_PLAIN``: weights in hidden's dtype (the unquantized path, unchanged);
- ``W_FP8_CHANNEL``: fp8 weights, one scale per output row; the activation rows arrive quantized to
  fp8 per token, and ``a_scale[m] * w_scale[n]`` multiplies the accumulator in the epilogue;
- ``W_FP8_BLOCK``: fp8 weights with a scale per 128 x 128 block; the activation rows arrive quantized
  per 1 x 128 group, and each K step covers exactly one 128-wide block column (BLOCK_K = 128), whose
  partial product is scaled by ``a_scale[m, step] * w_scale[n // 128, step]``;
  both fp8 formats take one K step with :func:`fp8_step` (transposed tiles for the decode launches, whose
  rows are fewer than 64: fp8 wgmma on sm90);
- ``W_MXFP4``: packed E2M1 codes (two per byte along K: the even element in the low nibble) with an
  E8M0 scale per 32 along K. A K step loads the [BLOCK_K / 2, BLOCK_N] tile of bytes and (a step
  ahead) the [BLOCK_K / 32, BLOCK_N] tile of their scales; each scale becomes its fp32 factor once
  (:func:`e8m0_value`) and is broadcast over its block's 16 bytes (:func:`mxfp4_block_rows`);
  :func:`mxfp4_decode` turns the bytes into the [BLOCK_K, BLOCK_N] tile of values in hidden's dtype
  (per value: two integer operations, half of a packed fp16 multiply, a conversion to fp32, the
  scale's multiply, the cast; :func:`mxfp4_tile` is the whole step), which meets the activation tile
  in one dot. The weights never exist decoded in memory. :func:`mxfp4_pairs` is the per-element
  decode the kernels used before (a scale load and its decode per byte), kept as the definition the
  tiled decode is pinned against (``decode_mxfp4(..., tiled=False)``).
  :func:`mxfp4_gate_up_loop` and :func:`mxfp4_down_loop` are the two kernels' whole K loops over MXFP4
  weights (whole steps unmasked, then one masked tail; each step loads the next step's scales).

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
def fp8_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """A zero fp32 accumulator for an fp8 tile: [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] with SWAP_AB."""
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def fp8_step(acc, a, w, a_scale, w_scale, BLOCKWISE: tl.constexpr, SWAP_AB: tl.constexpr):
    """One K step of an fp8 tile: acc += a [BM, BK] · w [BK, BN]; BLOCKWISE: the step is one scale group,
    times a_scale [BM] and w_scale [BN] (else the scales come after the loop, never read here).

    SWAP_AB: acc is the transposed tile [BN, BM], += w^T · a^T. On sm90 a 16-row fp8 dot runs on mma.sync
    with both tiles widened to fp16 first; transposed, its M is BLOCK_N (>= 64) and Triton issues fp8
    wgmma straight from shared memory (N = BLOCK_M = 16), with nothing widened."""
    if SWAP_AB:
        if BLOCKWISE:
            acc += tl.dot(tl.trans(w), tl.trans(a)) * w_scale[:, None] * a_scale[None, :]
        else:
            acc = tl.dot(tl.trans(w), tl.trans(a), acc)
    elif BLOCKWISE:
        acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    else:
        acc = tl.dot(a, w, acc)
    return acc


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
def e2m1_fp16_pair_bits(packed):
    """Packed bytes (any integer tile, 0..255) → uint32 holding two fp16s: the low half the even element's
    E2M1 code times 2**-14, the high half the odd element's (:func:`e2m1_value`'s construction: the code's
    magnitude bits at fp16 bits 9..11, its sign at bit 15). Both nibbles at once: ``byte * 0x1001`` puts
    the byte at bits 0..7 and again at 12..19, so one shift and mask place the low nibble's bits in the
    low half and the high nibble's in the high half (the stray copies fall outside the masks)."""
    both = packed.to(tl.uint32) * 0x1001
    return ((both << 9) & 0x0E000E00) | ((both << 12) & 0x80008000)


@triton.jit
def mxfp4_block_rows(block_tile, PAIRS: tl.constexpr):
    """[PAIRS / 16, N] tile of per-block values (one per 32 elements = 16 bytes along K) → [PAIRS, N],
    each value repeated on its block's 16 byte rows (a broadcast and a reshape: no loads)."""
    groups: tl.constexpr = PAIRS // (MXFP4_BLOCK // 2)
    cols: tl.constexpr = block_tile.shape[1]
    rows = tl.broadcast_to(tl.expand_dims(block_tile, 1), [groups, MXFP4_BLOCK // 2, cols])
    return tl.reshape(rows, [PAIRS, cols])


@triton.jit
def mxfp4_decode(packed, scale, DTYPE: tl.constexpr):
    """Packed bytes [P, N] and the fp32 :func:`e8m0_value` of each byte's block (broadcast to [P, N]) → the
    [2P, N] tile of element values in DTYPE (row 2p: byte p's even element, row 2p + 1: its odd one):
    ``e2m1_value(code) * e8m0_value(scale)`` bit for bit, then cast to DTYPE as the kernels always did.
    Per value: half of :func:`e2m1_fp16_pair_bits` (two integer operations), times 2**14 in fp16 (exact:
    the 0.5 code enters as the fp16 subnormal 2**-15 and leaves normal), the exact conversion to fp32,
    the scale's multiply (the same single rounding as the old per-element product: to +-inf past fp32,
    to NaN for scale 255), the cast. A byte's two values stay side by side in one thread from the
    bits to the dot operand (join, then permute and reshape, which move no data): packed fp16x2
    multiplies and bf16x2 casts serve them, with no register shuffles."""
    bits = e2m1_fp16_pair_bits(packed)
    codes = tl.join(bits.to(tl.uint16), (bits >> 16).to(tl.uint16)).to(tl.float16, bitcast=True)
    values = ((codes * 16384.0).to(tl.float32) * tl.expand_dims(scale, 2)).to(DTYPE)
    return tl.reshape(tl.permute(values, (0, 2, 1)), [2 * packed.shape[0], packed.shape[1]])


@triton.jit
def mxfp4_tile(byte_ptrs, byte_mask, scales, DTYPE: tl.constexpr):
    """One K step's MXFP4 weight tile → its [BLOCK_K, N] values in DTYPE (:func:`mxfp4_decode`).

    byte_ptrs: [P, N] pointers to the packed bytes (P = BLOCK_K / 2; byte_mask broadcasts to that shape);
    scales: the [P / 16, N] tile of their blocks' E8M0 bytes, already loaded (the kernels load it a step
    ahead, so its latency hides behind a step of work). Each scale becomes its fp32 factor once and is
    broadcast over its block's 16 bytes (:func:`mxfp4_block_rows`)."""
    packed = tl.load(byte_ptrs, mask=byte_mask, other=0)
    scale = mxfp4_block_rows(e8m0_value(scales.to(tl.int32)), byte_ptrs.shape[0])
    return mxfp4_decode(packed, scale, DTYPE)


@triton.jit
def mxfp4_dot(a, w_byte_ptrs, byte_mask, w_scales, acc, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] · the decoded MXFP4 tile [BLOCK_K, BLOCK_N] (bytes [BLOCK_K / 2, BLOCK_N] at
    w_byte_ptrs, their E8M0 scales [BLOCK_K / 32, BLOCK_N] already loaded), one dot: the activation tile as
    loaded (contiguous), the weights decoded in K order (:func:`mxfp4_tile`) to hidden's dtype (exact
    in bf16 and fp32; fp16: for scales 2**-23 ... 2**13), or to fp32 where the interpreter's dots take fp32
    operands (UPCAST_DOT)."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), mxfp4_tile(w_byte_ptrs, byte_mask, w_scales, tl.float32), acc,
                      input_precision=DOT_PRECISION)
    return tl.dot(a, mxfp4_tile(w_byte_ptrs, byte_mask, w_scales, a.dtype), acc, input_precision=DOT_PRECISION)


@triton.jit
def mxfp4_gate_up_loop(x_ptrs, gate_rows_ptr, gate_rows_s_ptr, up_offset, up_offset_s, row_ok, col_ok, hidden,
                       stride_xh, stride_wh, stride_sh, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       UPCAST_DOT: tl.constexpr):
    """The gate/up kernel's K loop over MXFP4 weights → (acc_gate, acc_up) fp32 [BLOCK_M, BLOCK_N].

    x_ptrs: [BLOCK_M, BLOCK_K] pointers to the first K step of the rows' hidden; gate_rows_ptr /
    gate_rows_s_ptr: [1, BLOCK_N] pointers to the gate rows' bytes and scales (column 0); the up rows are
    up_offset / up_offset_s further. H // BLOCK_K whole steps run without K masks; the rest of H (a
    multiple of 32), if any, in one masked step after them (EVEN_K: none). Each step loads the next
    step's scale tiles (the pipeliner overlaps the activation and byte tiles' loads by itself)."""
    k = tl.arange(0, BLOCK_K)
    pair = tl.arange(0, BLOCK_K // 2)
    group = tl.arange(0, BLOCK_K // MXFP4_BLOCK)
    gate_ptrs = gate_rows_ptr + pair[:, None] * stride_wh
    gate_s_ptrs = gate_rows_s_ptr + group[:, None] * stride_sh
    s_mask = (group * MXFP4_BLOCK < hidden)[:, None] & col_ok[None, :]
    gate_s = tl.load(gate_s_ptrs, mask=s_mask, other=127)
    up_s = tl.load(gate_s_ptrs + up_offset_s, mask=s_mask, other=127)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(hidden // BLOCK_K):
        gate_s_ptrs += (BLOCK_K // MXFP4_BLOCK) * stride_sh
        s_mask = (group * MXFP4_BLOCK < hidden - (step + 1) * BLOCK_K)[:, None] & col_ok[None, :]
        next_gate_s = tl.load(gate_s_ptrs, mask=s_mask, other=127)
        next_up_s = tl.load(gate_s_ptrs + up_offset_s, mask=s_mask, other=127)
        a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        acc_gate = mxfp4_dot(a, gate_ptrs, col_ok[None, :], gate_s, acc_gate, BLOCK_M, BLOCK_K, DOT_PRECISION,
                             UPCAST_DOT)
        acc_up = mxfp4_dot(a, gate_ptrs + up_offset, col_ok[None, :], up_s, acc_up, BLOCK_M, BLOCK_K, DOT_PRECISION,
                           UPCAST_DOT)
        gate_s, up_s = next_gate_s, next_up_s
        x_ptrs += BLOCK_K * stride_xh
        gate_ptrs += (BLOCK_K // 2) * stride_wh
    if not EVEN_K:
        left = hidden % BLOCK_K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & (k < left)[None, :], other=0.0)
        byte_mask = (2 * pair < left)[:, None] & col_ok[None, :]
        acc_gate = mxfp4_dot(a, gate_ptrs, byte_mask, gate_s, acc_gate, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST_DOT)
        acc_up = mxfp4_dot(a, gate_ptrs + up_offset, byte_mask, up_s, acc_up, BLOCK_M, BLOCK_K, DOT_PRECISION,
                           UPCAST_DOT)
    return acc_gate, acc_up


@triton.jit
def mxfp4_down_loop(a_ptrs, w_rows_ptr, w_rows_s_ptr, row_ok, col_ok, inter, stride_wi, stride_si,
                    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """The down kernel's K loop over MXFP4 weights → acc fp32 [BLOCK_M, BLOCK_N] (as :func:`mxfp4_gate_up_loop`, one
    weight matrix: a_ptrs [BLOCK_M, BLOCK_K] into act, w_rows_ptr / w_rows_s_ptr [1, BLOCK_N] into w2)."""
    k = tl.arange(0, BLOCK_K)
    pair = tl.arange(0, BLOCK_K // 2)
    group = tl.arange(0, BLOCK_K // MXFP4_BLOCK)
    w_ptrs = w_rows_ptr + pair[:, None] * stride_wi
    s_ptrs = w_rows_s_ptr + group[:, None] * stride_si
    w_s = tl.load(s_ptrs, mask=(group * MXFP4_BLOCK < inter)[:, None] & col_ok[None, :], other=127)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(inter // BLOCK_K):
        s_ptrs += (BLOCK_K // MXFP4_BLOCK) * stride_si
        next_w_s = tl.load(s_ptrs, mask=(group * MXFP4_BLOCK < inter - (step + 1) * BLOCK_K)[:, None] & col_ok[None, :],
                           other=127)
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        acc = mxfp4_dot(a, w_ptrs, col_ok[None, :], w_s, acc, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST_DOT)
        w_s = next_w_s
        a_ptrs += BLOCK_K
        w_ptrs += (BLOCK_K // 2) * stride_wi
    if not EVEN_K:
        left = inter % BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (k < left)[None, :], other=0.0)
        acc = mxfp4_dot(a, w_ptrs, (2 * pair < left)[:, None] & col_ok[None, :], w_s, acc, BLOCK_M, BLOCK_K,
                        DOT_PRECISION, UPCAST_DOT)
    return acc


@triton.jit
def _decode_mxfp4_kernel(packed_ptr, scales_ptr, out_ptr, rows, cols, stride_pr, stride_sr, stride_or,
                         TILED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out [R, C] = the kernels' decode (for tests): TILED, :func:`mxfp4_tile` as the GEMMs run it (rows of
    the matrix as the tile's N, a block of BLOCK_C bytes along K as its pairs), cast to out's dtype;
    else the per-element :func:`mxfp4_pairs`. A program covers BLOCK_R rows x BLOCK_C bytes (2 *
    BLOCK_C elements)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if TILED:  # [bytes, rows] tiles, as the GEMMs hold them
        g = tl.program_id(1) * (BLOCK_C // (MXFP4_BLOCK // 2)) + tl.arange(0, BLOCK_C // (MXFP4_BLOCK // 2))
        mask = (b < cols // 2)[:, None] & (r < rows)[None, :]
        byte_ptrs = packed_ptr + r[None, :] * stride_pr + b[:, None]
        scale_ptrs = scales_ptr + r[None, :] * stride_sr + g[:, None]
        scales = tl.load(scale_ptrs, mask=(g < cols // MXFP4_BLOCK)[:, None] & (r < rows)[None, :], other=127)
        values = mxfp4_tile(byte_ptrs, mask, scales, out_ptr.dtype.element_ty)
        k = tl.program_id(1) * 2 * BLOCK_C + tl.arange(0, 2 * BLOCK_C)
        tl.store(out_ptr + r[None, :] * stride_or + k[:, None], values, mask=(k < cols)[:, None] & (r < rows)[None, :])
    else:
        mask = (r < rows)[:, None] & (b < cols // 2)[None, :]
        byte_ptrs = packed_ptr + r[:, None] * stride_pr + b[None, :]
        scale_ptrs = scales_ptr + r[:, None] * stride_sr + (b // (MXFP4_BLOCK // 2))[None, :]
        even, odd = mxfp4_pairs(byte_ptrs, scale_ptrs, mask)
        out_ptrs = out_ptr + r[:, None] * stride_or + 2 * b[None, :]
        tl.store(out_ptrs, even.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptrs + 1, odd.to(out_ptr.dtype.element_ty), mask=mask)


def decode_mxfp4(packed, scales, dtype=None, tiled=True):
    """packed uint8 [R, C/2], scales uint8 [R, C/32] (last dims contiguous) → [R, C] in ``dtype`` (default
    fp32), decoded by the kernels' own :func:`mxfp4_tile` and cast to ``dtype`` as the GEMMs cast it for
    their dots (what tests pin against the checkpoint decoder); ``tiled=False``: by the per-element
    :func:`mxfp4_pairs` instead (fp32 products, then the same cast)."""
    import torch

    rows, cols = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(rows, cols, dtype=dtype or torch.float32, device=packed.device)
    grid = (triton.cdiv(rows, 16), triton.cdiv(cols // 2, 32))
    _decode_mxfp4_kernel[grid](packed, scales, out, rows, cols, packed.stride(0), scales.stride(0), out.stride(0),
                               TILED=tiled, BLOCK_R=16, BLOCK_C=32)
    return out
