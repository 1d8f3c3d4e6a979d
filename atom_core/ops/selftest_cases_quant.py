"""The selftest's grid, continued: dynamic activation quantization and the scaled GEMMs.

Quantization cases include an all-zero row (the scale's floor) and values at the formats' limits;
the quantized values may differ from the twin's by one step of the format, the scales by fp32
rounding (``tolerances.QUANT_VALUES`` / ``QUANT_SCALE``). GEMM inputs are the twin's quantization of
seeded normal activations and of weights scaled so the outputs are of order 1 (``tolerances.SCALED_MM``).

Legend: T / M tokens, K input features, N output features.
"""

from __future__ import annotations

import torch

from atom_core import ops
from atom_core.ops.reference import quant as reference_quant
from atom_core.ops.selftest_cases import Case, close_outputs, grid_dtypes, seeded_randn
from atom_core.ops.tolerances import QUANT_SCALE, QUANT_VALUES, SCALED_MM, tolerance

FP8, INT8 = torch.float8_e4m3fn, torch.int8
_SCALE_TOL = dict(zip(("atol", "rtol"), QUANT_SCALE))


def _check_quant(dtype: torch.dtype):
    values_tol = dict(zip(("atol", "rtol"), QUANT_VALUES[dtype]))

    def check(got, want) -> str | None:
        return close_outputs(got[:1], want[:1], values_tol) or close_outputs(got[1:], want[1:], _SCALE_TOL)

    return check


def _activations(seed: int, rows: int, cols: int, dtype, device) -> torch.Tensor:
    """Normal values with one all-zero row and one row of large magnitude."""
    x = seeded_randn(seed, rows, cols, scale=2.0)
    x[rows // 2] = 0.0
    x[-1] *= 300.0
    return x.to(device=device, dtype=dtype)


def quant_cases(grid: str, device) -> list[Case]:
    shapes = [(5, 200)] if grid == "quick" else [(1, 64), (33, 300), (256, 4096)]
    cases = []
    for (rows, cols) in shapes:
        for dtype in grid_dtypes(grid):
            for quant_dtype in (FP8, INT8):
                def x(rows=rows, cols=cols, dtype=dtype):
                    return _activations(21, rows, cols, dtype, device)

                label = f"T={rows} K={cols} {dtype} -> {quant_dtype}"
                check = _check_quant(quant_dtype)
                cases += [
                    Case("per_tensor_quant", label,
                         lambda b, x=x, q=quant_dtype: ops.per_tensor_quant(x(), dtype=q, backend=b), check),
                    Case("per_tensor_quant", label + " static scale",
                         lambda b, x=x, q=quant_dtype: ops.per_tensor_quant(
                             x(), dtype=q, scale=torch.tensor([0.05], device=device), backend=b), check),
                    Case("per_token_quant", label,
                         lambda b, x=x, q=quant_dtype: ops.per_token_quant(x(), dtype=q, backend=b), check),
                    Case("per_group_quant", label,
                         lambda b, x=x, q=quant_dtype: ops.per_group_quant(x(), dtype=q, backend=b), check),
                ]
    return cases


def _gemm_inputs(fmt: str, quant_dtype, m: int, n: int, k: int, with_bias: bool, device):
    """(a, a_scale, w, w_scale, bias) in ``fmt``'s layouts, built by the twins from seeded normals."""
    a = seeded_randn(31, m, k)
    w = seeded_randn(32, n, k, scale=k ** -0.5)  # outputs of order 1
    if fmt == "block":
        (a_q, a_scale), (w_q, w_scale) = reference_quant.per_group_quant(a, FP8), reference_quant.per_block_quant(w)
    elif fmt == "per_token":
        (a_q, a_scale), (w_q, w_scale) = (reference_quant.per_token_quant(t, quant_dtype) for t in (a, w))
    else:
        (a_q, a_scale), (w_q, w_scale) = (reference_quant.per_tensor_quant(t, quant_dtype) for t in (a, w))
    bias = seeded_randn(33, n) if with_bias else None
    return tuple(None if t is None else t.to(device) for t in (a_q, a_scale, w_q, w_scale, bias))


def scaled_mm_cases(grid: str, device) -> list[Case]:
    # (M, N, K): odd sizes, K off the 128 grid, and (full grid) a model-sized one.
    shapes = [(5, 48, 160)] if grid == "quick" else [(1, 256, 256), (33, 300, 260), (300, 512, 1024)]
    out_dtypes = grid_dtypes(grid)
    cases = []
    for (m, n, k) in shapes:
        for fmt, quant_dtypes in (("per_tensor", (FP8, INT8)), ("per_token", (FP8, INT8)), ("block", (FP8,))):
            for quant_dtype in quant_dtypes:
                for out_dtype in out_dtypes:
                    with_bias = out_dtype != torch.float32  # both ways across the grid

                    def run(backend, fmt=fmt, quant_dtype=quant_dtype, m=m, n=n, k=k, out_dtype=out_dtype,
                            with_bias=with_bias):
                        a, a_scale, w, w_scale, bias = _gemm_inputs(fmt, quant_dtype, m, n, k, with_bias, device)
                        call = getattr(ops, f"scaled_mm_{fmt}")
                        return (call(a, a_scale, w, w_scale, out_dtype=out_dtype, bias=bias, backend=backend),)

                    tol = tolerance(out_dtype, SCALED_MM)
                    label = f"M={m} N={n} K={k} {quant_dtype} -> {out_dtype}{' bias' if with_bias else ''}"
                    cases.append(Case(f"scaled_mm_{fmt}", label, run,
                                      lambda got, want, tol=tol: close_outputs(got, want, tol)))
    return cases
