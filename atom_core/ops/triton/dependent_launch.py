"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (NVIDIA sm90 and later).

A decode step at small batch is a chain of short kernels (2-30 µs each), and without PDL each one
starts only after the one before it has finished, flushed its writes and been retired: the GPU idles for
the next kernel's launch and ramp at every link. A kernel launched with PDL (``launch_pdl=True``) is
scheduled as soon as every program of the kernel before it has signalled, so its programs are resident
and waiting when that kernel finishes.

The contract, for every kernel that takes a ``PDL`` constexpr: its first statement is
``wait_for_inputs(PDL)``. That waits until the kernel before it in the stream has finished and its writes
are visible (``griddepcontrol.wait``), then signals the kernel after it (``griddepcontrol.launch_dependents``).
Nothing is read or written before the wait, so two kernels' memory accesses never overlap: what overlaps
is one kernel's launch with the other's last programs. A kernel launched without PDL (torch's, cuBLAS's,
the interpreter's) waits for the previous one as usual, and the wait returns at once when nothing came
before. Loading a weight tile before the wait would race with a caller that writes a weight and multiplies by it
in the next launch, and it did not pay: the engine's Llama-3-8B FP8 bs-1 step took 2.923 ms with the GEMV's
first weight tile loaded before its wait against 2.875 without, so no kernel here does it.

``launch_kwargs(x, rows, max_rows)`` gives the two launch arguments for a kernel whose tensors live on x's
device and which serves ``rows`` tokens: on up to ``max_rows`` tokens (default ``MAX_ROWS``: small-batch
decode). Measured on an H200 (``python -m benchmarks.ops_dependent_launch``: 32 Llama-3-8B FP8 layers of these
ops in one CUDA graph, RMSNorm + quantization, GEMMs, quantization, SiLU-and-mul + quantization;
``benchmarks/results/h200_ops_dependent_launch.json``), ms without PDL / with it on every kernel / on every
kernel but SiLU-and-mul + quantization: 1 token 2.326 / 2.258 / 2.265, 2 tokens 2.770 / 2.677 / 2.582,
4 tokens 2.803 / 2.709 / 2.622, 16 tokens 2.894 / 2.966 / 2.759, 64 tokens 3.449 / 3.666 / 3.340. The
SiLU-and-mul + quantization kernel loses with it from two tokens (``norm_quant.SILU_PDL_ROWS`` = 1). In the
engine the rest do not gain at 64 tokens (Llama-3-8B FP8 bs 64: 5.187 ms with every kernel but the two
quantizing ones launched dependently up to 64 tokens, 5.167 with ``MAX_ROWS`` = 4), so ``MAX_ROWS`` stays 4.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from atom_core.ops.dispatch import triton_interpret

MAX_ROWS = 4  # the launches that take PDL: up to this many tokens (module docstring)
_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False, "launch_pdl": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """The first statement of a kernel launched with ``launch_kwargs`` (module docstring)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    if triton_interpret() or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def launch_kwargs(x: torch.Tensor, rows: int, max_rows: int | None = None) -> dict:
    """``PDL`` and ``launch_pdl`` for a launch on x's device serving ``rows`` tokens: on for
    ``rows <= max_rows`` (default ``MAX_ROWS``) on CUDA devices of compute capability 9.0 and later (not in the
    interpreter, not on ROCm)."""
    limit = MAX_ROWS if max_rows is None else max_rows
    return _ON if rows <= limit and x.is_cuda and _supported(x.device.index) else _OFF
