"""Triton dynamic activation quantization: per-tensor, per-token (one program per row, read once up to 4,096
columns, else twice) and per-group (one program per row and run of groups), to fp8 e4m3fn or int8.

The results equal the twin's bit for bit, on GPUs and in the CPU interpreter:
- ``x / scale`` is the twin's IEEE division. The kernels here compute it as :func:`divide` does:
  ``x * (1 / scale)`` and two corrections by the exact residual (an fma), one reciprocal per scale. A
  per-element ``tl.div_rn`` cost more than the loads and stores (H200, bf16 to fp8 per token, 2,048 x 768:
  5.0 against 3.1 us with the cast below; 256 x 4,096: 3.5 against 2.3;
  ``benchmarks/results/h200_ops_quant_division.json``).
- int8 rounds half to even with the 1.5 * 2**23 trick (adding it leaves no fraction bits, and IEEE
  addition rounds to nearest even).
- fp8 e4m3fn: here, on CUDA, the hardware's conversion (``cvt.rn.satfinite``: to nearest, ties to even).
  In the interpreter and on ROCm, rounding to 3 mantissa bits the same way as int8, scaled by the value's
  power of two (the interpreter's own fp32 -> fp8 cast does not round ties to even), so that the cast then
  converts an exactly representable value.

Other kernels' quantizing epilogues (RMSNorm and SiLU-and-mul, the attention output, the MLA and DSA caches)
and the fp8 KV store quantize with the same :func:`quantize_groups`, :func:`divide` (:func:`divide_by_static`
under a static scale) and :func:`round_to_format`.
A fused kernel equals its two-op pipeline bit for bit only if the values it quantizes are the same bits: the
compiler's contraction of a multiply and an add into one fma depends on the code around them, so a sum that
feeds a quantization (RMSNorm's sum of squares) is written with explicit fma's (``norm.rms_normalize``).

Legend: T = rows (tokens), K = columns, G = groups per row.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_core.ops.dispatch import triton_interpret
from atom_core.ops.reference.quant import AMAX_FLOOR, FP8_DTYPE, INT8_DTYPE, qmax
from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2

_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (y + M) - M rounds y to an integer, ties to even
_ROW_BLOCK = 4096  # columns per step of the per-token loop
_TILE = 4096  # elements per program of the per-tensor and per-group kernels
# For other kernels' fp8 epilogues (quantize_groups' arguments): the scales' floor and e4m3's largest value.
TL_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
TL_FP8_MAX = tl.constexpr(qmax(FP8_DTYPE))
# fp8 e4m3fn through the hardware's conversion (module docstring): compiled for CUDA (every target that has
# e4m3fn, sm89 and later), not in the interpreter and not on ROCm.
_HARDWARE_FP8_CAST = tl.constexpr(not triton_interpret() and torch.version.hip is None)


@triton.jit
def round_to_format(y, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    """fp32 y (already divided by its scale) → the exactly representable value the twin stores (as fp32),
    fp8 by the hardware's cast on CUDA (module docstring). The clamp keeps NaN, as the twin's does (fp8 stores
    it; int8 has none, and the cast's result is the platform's)."""
    y = tl.clamp(y, -QMAX, QMAX, propagate_nan=tl.PropagateNan.ALL)
    if IS_INT8 or not _HARDWARE_FP8_CAST:
        return _round_clamped(y, IS_INT8)
    return y.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _round_clamped(y, IS_INT8: tl.constexpr):
    """fp32 y within the format's range → its value rounded to the format, by fp32 arithmetic (module docstring)."""
    if IS_INT8:
        return (y + _MAGIC) - _MAGIC
    # fp8 e4m3fn: 3 mantissa bits; below the smallest normal (2**-6) the step is 2**-9.
    bits = y.to(tl.int32, bitcast=True)
    magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    step_exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6) - 3  # biased exponent of the step
    step = (step_exponent << 23).to(tl.float32, bitcast=True)
    inverse_step = ((254 - step_exponent) << 23).to(tl.float32, bitcast=True)  # exact powers of two
    rounded = ((magnitude * inverse_step + _MAGIC) - _MAGIC) * step
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # sign kept


@triton.jit
def _corrected_quotient(y, scale, inverse):
    """(y * inverse, the quotient after two corrections): see :func:`divide`."""
    product = y * inverse
    q = product
    for _ in tl.static_range(2):
        q = tl.fma(tl.fma(-q, scale, y), inverse, q)
    return product, q


@triton.jit
def divide(y, scale, inverse):
    """y / scale rounded as one IEEE division (``tl.div_rn``), given inverse = ``tl.div_rn(1.0, scale)``
    (one per scale, broadcast as scale is), for a scale taken from the values' own amax (scale >= |y| / QMAX,
    so the quotient is within the format's range; a static scale takes :func:`divide_by_static`).

    q = y * inverse is within two ulps of the quotient; each step adds the exact residual y - q * scale
    (one fma) times inverse. After the first, q is within one ulp (faithful); after the second it is the
    rounded quotient (Markstein's theorem: a faithful q and a reciprocal within half an ulp). Where that
    sequence differs from the division, y * inverse is taken, which is the division there:
    - a zero y: the residual's sum of zeros would lose a -0's sign;
    - an infinite scale (a row holding an infinity): inverse is 0 and the residual NaN; IEEE's y / inf is 0
      for finite y and NaN for infinite."""
    product, q = _corrected_quotient(y, scale, inverse)
    return tl.where(y == 0.0, product, tl.where(inverse == 0.0, product, q))


@triton.jit
def divide_by_static(y, scale, inverse):
    """:func:`divide` under a scale that does not bound y (a static scale: the fp8 KV store, static per-tensor
    quantization). There a NaN q also comes from an infinite product (an infinite y, or a quotient past
    fp32's range: the corrections add inf - inf), and y * inverse is taken wherever q is NaN. Within two
    ulps of fp32's largest value the product may be infinite where the quotient is not: every format here
    clamps both to its largest value.

    Not :func:`divide` with this check added: the check costs where the quotient feeds a dot (the DSA score
    kernel's fp8 q, 0.212 against 0.353 ms at 64 x 32k on an H100)."""
    product, q = _corrected_quotient(y, scale, inverse)
    q = tl.where(q != q, product, q)
    return tl.where(y == 0.0, product, q)


@triton.jit
def quantize_groups(y, amax_floor, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    """fp32 y [G, N], one group a row (zeros where masked) → (q fp32 [G, N], the values the twin stores;
    scale fp32 [G] = max(amax, amax_floor) / QMAX), IEEE divisions as ``reference.quant``."""
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(y), axis=1), amax_floor), QMAX)
    quotient = divide(y, scale[:, None], tl.div_rn(1.0, scale)[:, None])
    return round_to_format(quotient, QMAX, IS_INT8), scale


@triton.jit
def _per_token_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, stride_s, amax_floor,
                      QMAX: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), amax_floor), QMAX)
    tl.store(scale_ptr + row * stride_s, scale)
    inverse = tl.div_rn(1.0, scale)
    for start in range(0, K, BLOCK):  # a second read: the row is still in cache
        mask = start + cols < K
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = round_to_format(divide(x, scale, inverse), QMAX, IS_INT8)
        tl.store(q_ptr + row * stride_q + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _per_token_row_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, stride_s, amax_floor,
                          QMAX: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row of K <= BLOCK columns a program, read once: a [1, BLOCK] tile, one group of ``quantize_groups``."""
    wait_for_inputs(PDL)
    row = tl.program_id(0) + tl.arange(0, 1)
    cols = tl.arange(0, BLOCK)
    mask = cols[None, :] < K
    row = row.to(tl.int64)
    x = tl.load(x_ptr + row[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, amax_floor, QMAX, IS_INT8)
    tl.store(scale_ptr + row * stride_s, scale)
    tl.store(q_ptr + row[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _per_group_kernel(x_ptr, q_ptr, scale_ptr, K, num_groups, stride_x, stride_q, stride_s, amax_floor,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr,
                      QMAX: tl.constexpr, IS_INT8: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    offsets = tl.arange(0, GROUP_PAD)
    cols = groups[:, None] * GROUP + offsets[None, :]  # [groups, GROUP_PAD]
    mask = (groups < num_groups)[:, None] & (offsets < GROUP)[None, :] & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, amax_floor, QMAX, IS_INT8)
    tl.store(scale_ptr + row * stride_s + groups, scale, mask=groups < num_groups)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, T, K, stride_x, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < T)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0))  # amax >= 0


@triton.jit
def _per_tensor_kernel(x_ptr, q_ptr, source_ptr, scale_ptr, T, K, stride_x, stride_q, amax_floor,
                       STATIC: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    if STATIC:
        scale = tl.load(source_ptr)
    else:  # source holds the tensor's amax (from _amax_kernel)
        scale = tl.div_rn(tl.maximum(tl.load(source_ptr), amax_floor), QMAX)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_ptr, scale)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < T)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        quotient = divide_by_static(x, scale, tl.div_rn(1.0, scale))
    else:
        quotient = divide(x, scale, tl.div_rn(1.0, scale))
    q = round_to_format(quotient, QMAX, IS_INT8)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _tile(rows: int, cols: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_T, BLOCK_K) of the 2-D per-tensor kernels for x [rows, cols]."""
    block_k = min(next_power_of_2(cols), 1024)
    block_t = max(1, min(_TILE // block_k, next_power_of_2(rows)))
    return (cdiv(rows, block_t), cdiv(cols, block_k)), block_t, block_k


def _format(q: torch.Tensor) -> dict:
    return dict(QMAX=qmax(q.dtype), IS_INT8=q.dtype == INT8_DTYPE)


def per_tensor_quant(x, static_scale, q, scale):
    """x [T, K] → q [T, K], scale [1]: dynamic (amax over x) unless static_scale [1] is given."""
    rows, cols = x.shape
    if x.numel() == 0:
        if static_scale is None:
            scale.fill_(AMAX_FLOOR / qmax(q.dtype))
        else:
            scale.copy_(static_scale.reshape(1))
        return
    grid, block_t, block_k = _tile(rows, cols)
    pdl = launch_kwargs(x, rows)
    if static_scale is None:
        source = torch.zeros(1, dtype=torch.float32, device=x.device)
        _amax_kernel[grid](x, source, rows, cols, x.stride(0), BLOCK_T=block_t, BLOCK_K=block_k, **pdl)
    else:
        source = static_scale
    _per_tensor_kernel[grid](x, q, source, scale, rows, cols, x.stride(0), q.stride(0), AMAX_FLOOR,
                             STATIC=static_scale is not None, BLOCK_T=block_t, BLOCK_K=block_k, **_format(q), **pdl)


def per_token_quant(x, q, scale, tokens=None):
    """x [T, K] → q [T, K], scale [T, 1]; ``tokens``: the tokens the launch serves, for dependent launch
    (default T; a fused MoE's [T * top_k, I] activation serves T)."""
    rows, cols = x.shape
    if rows == 0:
        return
    # Rows of up to _ROW_BLOCK columns stay in registers, one read (H200, bf16 to fp8: 16,384 x 768 27 against
    # 31 us, 8,192 x 4,096 38 against 44, 2,048 x 768 5.6 against 6.2; 1-256 rows within 0.3 us; docs/benchmarks.md).
    args = (x, q, scale, cols, x.stride(0), q.stride(0), scale.stride(0), AMAX_FLOOR)
    block = min(next_power_of_2(max(cols, 1)), _ROW_BLOCK)
    pdl = launch_kwargs(x, rows if tokens is None else tokens)
    if cols <= _ROW_BLOCK:
        _per_token_row_kernel[(rows,)](*args, BLOCK=block, **_format(q), **pdl)
    else:
        _per_token_kernel[(rows,)](*args, BLOCK=block, **_format(q), **pdl)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _group_launch(num_groups: int, group_size: int) -> tuple[int, int, int]:
    """(programs per row, GROUP_PAD, GROUPS_PER_PROGRAM)."""
    group_pad = next_power_of_2(group_size)
    per_program = max(1, min(_TILE // group_pad, next_power_of_2(num_groups)))
    return cdiv(num_groups, per_program), group_pad, per_program


def per_group_quant(x, group_size, q, scale, tokens=None):
    """x [T, K] → q [T, K], scale [T, G] with G = ceil(K / group_size); ``tokens`` as in
    :func:`per_token_quant`."""
    rows, cols = x.shape
    num_groups = scale.shape[1]
    if rows == 0 or num_groups == 0:
        return
    programs, group_pad, per_program = _group_launch(num_groups, group_size)
    _per_group_kernel[(rows, programs)](x, q, scale, cols, num_groups, x.stride(0), q.stride(0), scale.stride(0),
                                        AMAX_FLOOR, GROUP=group_size, GROUP_PAD=group_pad,
                                        GROUPS_PER_PROGRAM=per_program, **_format(q),
                                        **launch_kwargs(x, rows if tokens is None else tokens))


def per_head_quant(x, q, scale):
    """x [T, H, D] → q [T, H, D], scale [T, H]: ``per_group_quant`` of x viewed as [T, H * D], a group a head
    (q contiguous, as an attention output quantized for the projection after it)."""
    num_tokens = x.shape[0]
    per_group_quant(x.reshape(num_tokens, -1), x.shape[2], q.view(num_tokens, -1), scale)
