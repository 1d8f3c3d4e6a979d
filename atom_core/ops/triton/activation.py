"""Triton gated activations: out[t, i] = act(gate[t, i]) * up[t, i], fp32 math.

A 2-D grid of [BLOCK_T, BLOCK_I] output tiles: wide rows are split over programs along I, narrow
rows are packed several per program so every program moves a full tile.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2

SILU = tl.constexpr(0)
GELU_ERF = tl.constexpr(1)
GELU_TANH = tl.constexpr(2)
SWIGLU_CLAMPED = tl.constexpr(3)
_SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_TILE = 4096  # output elements per program


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, num_rows, inter, stride_x, stride_out, alpha, limit,
    ACT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_rows
    x_row = x_ptr + rows[:, None] * stride_x  # int64 row offsets: T * 2I can exceed 2**31
    if ACT == SWIGLU_CLAMPED:
        # Interleaved gate/up: load 2 * BLOCK_I contiguous values and split the pairs.
        cols2 = tl.program_id(1) * 2 * BLOCK_I + tl.arange(0, 2 * BLOCK_I)
        pairs = tl.load(x_row + cols2[None, :], mask=row_mask[:, None] & (cols2 < 2 * inter)[None, :], other=0.0)
        gate, up = tl.split(tl.reshape(pairs.to(tl.float32), (BLOCK_T, BLOCK_I, 2)))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        y = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    else:
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask = row_mask[:, None] & (cols < inter)[None, :]
        gate = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + inter + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ACT == SILU:
            act = gate * tl.sigmoid(gate)
        elif ACT == GELU_ERF:
            act = 0.5 * gate * (1.0 + tl.erf(gate * _SQRT_HALF))
        else:
            # g/2 * (1 + tanh(z)) = g * sigmoid(2z), as 1 + tanh(z) = 2 sigmoid(2z) (no tanh in core tl)
            z = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
            act = gate * tl.sigmoid(2.0 * z)
        y = act * up
    out_mask = row_mask[:, None] & (cols < inter)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_config(num_rows: int, inter: int) -> tuple[tuple[int, int], int, int, int]:
    """(grid, BLOCK_T, BLOCK_I, num_warps) for an output of [num_rows, inter]."""
    block_i = min(next_power_of_2(inter), 1024)
    block_t = max(1, min(_TILE // block_i, next_power_of_2(num_rows)))
    grid = (cdiv(num_rows, block_t), cdiv(inter, block_i))
    return grid, block_t, block_i, 4 if block_t * block_i <= 2048 else 8


def _launch(x, out, act, alpha=0.0, limit=0.0):
    num_rows, inter = out.shape
    if num_rows == 0 or inter == 0:
        return
    grid, block_t, block_i, num_warps = _launch_config(num_rows, inter)
    _act_and_mul_kernel[grid](
        x, out, num_rows, inter, x.stride(0), out.stride(0), alpha, limit,
        ACT=act, BLOCK_T=block_t, BLOCK_I=block_i, num_warps=num_warps, **launch_kwargs(x, num_rows),
    )


def silu_and_mul(x, out):
    _launch(x, out, SILU)


def gelu_and_mul(x, approximate, out):
    _launch(x, out, GELU_TANH if approximate == "tanh" else GELU_ERF)


def swiglu_clamped(x, alpha, limit, out):
    _launch(x, out, SWIGLU_CLAMPED, float(alpha), float(limit))
