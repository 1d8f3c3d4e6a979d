"""Triton RMSNorm and SiLU-and-mul with the per-group quantization of their output, one launch each.

RMSNorm: one program per row, the whole row in registers (as ``_norm_kernel`` of triton/norm.py).
SiLU-and-mul: one program per chunk of CHUNK values of a row (whole groups; the values are independent,
so a decode row of I = 14336 spreads over 14 programs, as the unfused kernel's does), or the whole row
in one program when it is one group. Each program:

1. the activation in fp32, with the arithmetic of the unfused kernel: the RMSNorm exactly as
   ``_norm_kernel`` computes it (the residual sum rounded to x's dtype and stored, the same 1-D row
   reduction, the same BLOCK_D and warps), ``gate * sigmoid(gate) * up`` as ``_act_and_mul_kernel``;
2. rounded to x's dtype and back to fp32: the value the unfused op stores and ``per_group_quant``
   reads back;
3. the row (the chunk) viewed as [G_PAD, GROUP]: per group, ``scale = max(amax, AMAX_FLOOR) / qmax`` and
   ``q = round_to_format(y / scale)`` (IEEE divisions): ``quant.quantize_groups``, as ``_per_group_kernel``.

So on a GPU, and in the interpreter, a result equals the Triton ``rms_norm`` (``silu_and_mul``) then
``per_group_quant`` bit for bit. GROUP is the group size (a power of two below the row's length) or,
for one group per row, the padded row (G_PAD = 1); padding columns hold zeros, which change no amax.

Legend: T = rows (tokens), N = row length (D for the norm, I for the activation), G = groups per row.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.reference.quant import AMAX_FLOOR, INT8_DTYPE, qmax
from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2
from atom_core.ops.triton.norm import _launch_config as _row_launch_config
from atom_core.ops.triton.norm import load_row, rms_normalize
from atom_core.ops.triton.quant import quantize_groups

CHUNK = 1024  # activation values per SiLU program where groups split the row
# Dependent launch up to this many rows (None: dependent_launch.MAX_ROWS). SiLU-and-mul + quantization gains at
# one row and loses from two (dependent_launch's module docstring).
RMS_NORM_PDL_ROWS = None
SILU_PDL_ROWS = 1


@triton.jit
def _quantize_groups(y, row, first_group, q_ptr, scale_ptr, N, num_groups, stride_q, stride_s, amax_floor,
                     GROUP: tl.constexpr, G_PAD: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    """y: fp32 [G_PAD * GROUP], groups first_group... of the row (zeros past N) → their q and scales."""
    groups = first_group + tl.arange(0, G_PAD)
    q, scale = quantize_groups(tl.reshape(y, (G_PAD, GROUP)), amax_floor, QMAX, IS_INT8)
    tl.store(scale_ptr + row * stride_s + groups, scale, mask=groups < num_groups)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, res_out_ptr, normed_ptr,
    D, num_groups, stride_x, stride_res, stride_q, stride_s, stride_res_out, stride_normed, eps, amax_floor,
    HAS_RESIDUAL: tl.constexpr, HAS_NORMED: tl.constexpr, GEMMA: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    # _norm_kernel's own helpers: the same arithmetic, so the same bits
    x = load_row(x_ptr, res_ptr, res_out_ptr, row, cols, mask, stride_x, stride_res, stride_res_out, HAS_RESIDUAL)
    y = rms_normalize(x, w_ptr, cols, mask, D, eps, GEMMA)
    # The value rms_norm stores (x's dtype), as per_group_quant reads it back.
    y = y.to(x_ptr.dtype.element_ty)
    if HAS_NORMED:
        tl.store(normed_ptr + row * stride_normed + cols, y, mask=mask)
    y = y.to(tl.float32)
    _quantize_groups(y, row, 0, q_ptr, scale_ptr, D, num_groups, stride_q, stride_s, amax_floor,
                     GROUP, G_PAD, QMAX, IS_INT8)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, scale_ptr, inter, num_groups, stride_x, stride_q, stride_s, amax_floor,
    BLOCK_I: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < inter
    x_row = x_ptr + row * stride_x  # int64 row offsets: T * 2I can exceed 2**31
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate * tl.sigmoid(gate)  # _act_and_mul_kernel's SILU
    y = act * up
    # The value silu_and_mul stores (x's dtype), as per_group_quant reads it back.
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    _quantize_groups(y, row, chunk * G_PAD, q_ptr, scale_ptr, inter, num_groups, stride_q, stride_s, amax_floor,
                     GROUP, G_PAD, QMAX, IS_INT8)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_config(n: int, group_size: int) -> tuple[int, int, int, int]:
    """(BLOCK, num_warps, GROUP, G_PAD) for whole rows of n elements: BLOCK and warps as the RMSNorm kernel
    chooses them; groups of group_size (a power of two) when it is below n, else one group per row."""
    block, num_warps = _row_launch_config(n)
    if group_size >= n:
        return block, num_warps, block, 1
    return block, num_warps, group_size, block // group_size


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _chunk_launch_config(n: int, group_size: int) -> tuple[int, int, int, int, int]:
    """(chunks per row, BLOCK, num_warps, GROUP, G_PAD) of the SiLU kernel: chunks of CHUNK values (or of
    one group, if larger) when groups split the row, else the whole row in one program; warps by BLOCK
    as for a row of BLOCK values."""
    if group_size >= n:
        return (1, *_launch_config(n, group_size))
    block = max(group_size, min(CHUNK, next_power_of_2(n)))
    return cdiv(n, block), block, _row_launch_config(block)[1], group_size, block // group_size


def _format(q) -> dict:
    return dict(QMAX=qmax(q.dtype), IS_INT8=q.dtype == INT8_DTYPE)


def rms_norm_quant(x, weight, eps, residual, gemma, group_size, q, scale, residual_out, normed):
    """x [T, D] → q [T, D], scale [T, G] (and residual_out [T, D] with a residual, normed [T, D] if given)."""
    rows, d = x.shape
    if rows == 0 or d == 0:
        return
    block_d, num_warps, group, g_pad = _launch_config(d, group_size)
    _rms_norm_quant_kernel[(rows,)](
        x, residual, weight, q, scale, residual_out, normed,
        d, scale.shape[1], x.stride(0), residual.stride(0) if residual is not None else 0, q.stride(0),
        scale.stride(0), residual_out.stride(0) if residual_out is not None else 0,
        normed.stride(0) if normed is not None else 0, eps, AMAX_FLOOR,
        HAS_RESIDUAL=residual is not None, HAS_NORMED=normed is not None, GEMMA=gemma, BLOCK_D=block_d, GROUP=group,
        G_PAD=g_pad,
        num_warps=num_warps, **_format(q), **launch_kwargs(x, rows, RMS_NORM_PDL_ROWS),
    )


def silu_and_mul_quant(x, group_size, q, scale):
    """x [T, 2I] → q [T, I], scale [T, G]."""
    rows, inter = q.shape
    if rows == 0 or inter == 0:
        return
    chunks, block_i, num_warps, group, g_pad = _chunk_launch_config(inter, group_size)
    _silu_and_mul_quant_kernel[(rows, chunks)](
        x, q, scale, inter, scale.shape[1], x.stride(0), q.stride(0), scale.stride(0), AMAX_FLOOR,
        BLOCK_I=block_i, GROUP=group, G_PAD=g_pad, num_warps=num_warps, **_format(q),
        **launch_kwargs(x, rows, SILU_PDL_ROWS),
    )
