"""Triton RMSNorm / LayerNorm: one program per row, the whole row in registers, fp32 math."""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, next_power_of_2


@triton.jit
def load_row(x_ptr, res_ptr, res_out_ptr, row, cols, mask, stride_x, stride_res, stride_res_out,
             HAS_RESIDUAL: tl.constexpr):
    """Row ``row`` of x (x's dtype); with a residual, x + residual rounded to x's dtype (as a model adding in its
    own dtype would), also stored to res_out: the new residual stream."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    return x


@triton.jit
def rms_normalize(x, w_ptr, cols, mask, D, eps, GEMMA: tl.constexpr):
    """fp32 ``x / sqrt(mean(x**2) + eps) * w`` (``1 + w`` with GEMMA) of a row held whole (zeros past D)."""
    h = x.to(tl.float32)
    # Squares as explicit fma's: a plain h * h is contracted into the sum's adds, and which square stays a
    # multiply depends on the code after it, so rms_norm_quant would round rstd differently from rms_norm.
    var = tl.sum(tl.fma(h, h, 0.0), axis=0) / D
    y = h * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    return y * w


@triton.jit
def _norm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr,
    D, stride_x, stride_res, stride_out, stride_res_out, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr, GEMMA: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = load_row(x_ptr, res_ptr, res_out_ptr, row, cols, mask, stride_x, stride_res, stride_res_out, HAS_RESIDUAL)
    if IS_RMS:
        y = rms_normalize(x, w_ptr, cols, mask, D, eps, GEMMA)
    else:
        h = x.to(tl.float32)
        mean = tl.sum(h, axis=0) / D
        centred = tl.where(mask, h - mean, 0.0)
        var = tl.sum(centred * centred, axis=0) / D
        y = centred * tl.rsqrt(var + eps) * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_config(d: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps) for rows of d elements: the whole row in one tile."""
    block_d = next_power_of_2(d)
    return block_d, min(max(block_d // 256, 1), 16)


def _launch(x, residual, weight, bias, out, residual_out, eps, is_rms, gemma):
    rows, d = x.shape
    if rows == 0:
        return
    block_d, num_warps = _launch_config(d)
    _norm_kernel[(rows,)](
        x, residual, weight, bias, out, residual_out,
        d, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0, eps,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, IS_RMS=is_rms, GEMMA=gemma,
        BLOCK_D=block_d, num_warps=num_warps, **launch_kwargs(x, rows),
    )


def rms_norm(x, weight, eps, residual, gemma, out, residual_out):
    _launch(x, residual, weight, None, out, residual_out, eps, True, gemma)


def layer_norm(x, weight, bias, eps, residual, out, residual_out):
    _launch(x, residual, weight, bias, out, residual_out, eps, False, False)
