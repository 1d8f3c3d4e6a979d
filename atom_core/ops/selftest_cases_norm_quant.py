"""The selftest's cases of the fused norm / activation + quantization ops (``rms_norm_quant``,
``silu_and_mul_quant``), in the format of ``atom_core.ops.selftest_cases``.

Inputs: seeded normal rows with one all-zero row (the scale's floor), over groups of 128 (with a short
last group where the row is no multiple of 128) and one group per row (per-token), fp8 and int8.

How a backend's outputs are compared with the twin's (:func:`close_quantized`). The backend's
activation ``h`` (the norm or ``silu(gate) * up``, rounded to x's dtype) may sit a few ulps of x's
dtype from the twin's (another fp32 summation order in the norm; the residual sum and ``h`` each
rounded by the interpreter's bf16 cast: up to two ulps), within the relative tolerance the unfused
ops are held to, rtol_h = ``ELEMENTWISE[x's dtype]``'s; where a group's amax moves, its scale moves
with it, and a quantized value near a rounding boundary may land one step of the format away. So:

- scale: relative ``max(QUANT_SCALE, rtol_h)``;
- q, compared dequantized (``q * scale``): one step of the format (``QUANT_VALUES``: 2**-3 relative
  and 2**-9 of the scale for fp8, one scale for int8) plus ``rtol_h * |value|``;
- residual_out: ``ELEMENTWISE`` of x's dtype.

Legend: T tokens, D hidden, I intermediate.
"""

from __future__ import annotations

import torch

from atom_core import ops
from atom_core.ops.reference.quant import dequantize
from atom_core.ops.selftest_cases import Case, close_outputs, grid_dtypes, seeded_randn
from atom_core.ops.tolerances import ELEMENTWISE, QUANT_SCALE, QUANT_VALUES, tolerance

FP8, INT8 = torch.float8_e4m3fn, torch.int8


def close_quantized(got: tuple, want: tuple, x_dtype: torch.dtype, quant_dtype: torch.dtype,
                    group_size: int) -> str | None:
    """None if ``got`` = (q, scale[, residual_out]) matches the twin's ``want`` within the bounds of the
    module docstring, else why not."""
    rtol_h = ELEMENTWISE[x_dtype][1]
    (q, scale), (want_q, want_scale) = got[:2], want[:2]
    why = close_outputs((scale,), (want_scale,), {"atol": 0.0, "rtol": max(QUANT_SCALE[1], rtol_h)})
    if why:
        return f"scale: {why}"
    group = min(group_size, max(q.shape[1], 1))
    value, want_value = dequantize(q, scale, group), dequantize(want_q, want_scale, group)
    atol, rtol = QUANT_VALUES[quant_dtype]
    step_scale = torch.maximum(scale, want_scale).repeat_interleave(group, dim=1)[:, :q.shape[1]]
    magnitude = torch.maximum(value.abs(), want_value.abs())
    bound = (rtol + rtol_h) * magnitude + atol * step_scale
    excess = (value - want_value).abs() - bound
    if bool((excess > 0).any()):
        where = tuple(int(i) for i in torch.nonzero(excess > 0)[0])
        return (f"q: {int((excess > 0).sum())} of {q.numel()} dequantized values out of bounds, first at {where}: "
                f"{value[where].item()} vs {want_value[where].item()}")
    if len(got) > 2:
        why = close_outputs(got[2:], want[2:], tolerance(x_dtype, ELEMENTWISE))
        return f"residual_out: {why}" if why else None
    return None


def _rows(seed: int, rows: int, cols: int, dtype, device) -> torch.Tensor:
    x = seeded_randn(seed, rows, cols, scale=2.0)
    x[rows // 2] = 0.0  # a padding token
    return x.to(device=device, dtype=dtype)


def _checker(x_dtype, quant_dtype, group_size):
    return lambda got, want: close_quantized(got, want, x_dtype, quant_dtype, group_size)


def norm_quant_cases(grid: str, device) -> list[Case]:
    # rms_norm_quant (T, D) and silu_and_mul_quant (T, I): odd sizes with a short last group; (full)
    # Llama-3-8B's hidden and intermediate sizes.
    norm_shapes = [(7, 200)] if grid == "quick" else [(1, 128), (33, 300), (64, 4096)]
    silu_shapes = [(5, 200)] if grid == "quick" else [(1, 128), (33, 300), (16, 14336)]
    cases = []
    for index, dtype in enumerate(grid_dtypes(grid)):
        for quant_dtype in (FP8, INT8):
            for per_token in (False, True):
                name = f"{dtype} -> {quant_dtype}{' per-token' if per_token else ''}"
                for (rows, hidden) in norm_shapes:
                    group = hidden if per_token else 128
                    with_residual, gemma = per_token == (quant_dtype == FP8), bool(index % 2)  # both ways

                    def run(backend, rows=rows, hidden=hidden, dtype=dtype, quant_dtype=quant_dtype, group=group,
                            with_residual=with_residual, gemma=gemma):
                        x = _rows(41, rows, hidden, dtype, device)
                        weight = (0.5 + torch.rand(hidden, generator=torch.Generator().manual_seed(42)))
                        residual = _rows(43, rows, hidden, dtype, device) if with_residual else None
                        return ops.rms_norm_quant(x, weight.to(device, dtype), 1e-6, residual=residual, gemma=gemma,
                                                  group_size=group, dtype=quant_dtype, backend=backend)

                    label = (f"T={rows} D={hidden} {name}{' residual' if with_residual else ''}"
                             f"{' gemma' if gemma else ''}")
                    cases.append(Case("rms_norm_quant", label, run, _checker(dtype, quant_dtype, group)))
                for (rows, inter) in silu_shapes:
                    group = inter if per_token else 128

                    def run(backend, rows=rows, inter=inter, dtype=dtype, quant_dtype=quant_dtype, group=group):
                        x = _rows(44, rows, 2 * inter, dtype, device)
                        return ops.silu_and_mul_quant(x, group_size=group, dtype=quant_dtype, backend=backend)

                    cases.append(Case("silu_and_mul_quant", f"T={rows} I={inter} {name}", run,
                                      _checker(dtype, quant_dtype, group)))
    return cases
