"""Launch arithmetic for the Triton wrappers, in plain Python ints.

``triton.next_power_of_2`` and ``triton.cdiv`` cost about 1.5 µs a call (they are Triton
functions, not plain arithmetic), and a decode step makes hundreds of such calls. These two give
the same answers for the arguments the wrappers pass (n >= 1, b >= 1) at the cost of an int op.
Wrappers cache what they derive from these (block sizes, warps, grids) per shape with
``functools.lru_cache`` keyed by the shape ints.

Launch tables are chosen on an H200, whose programs may use 227 KB of shared memory; GPUs other than the
datacenter parts give about 99 KB (sm86 / sm89), ROCm's 64 KB. :func:`stages_that_fit` trims a launch's
software-pipeline stages to the device's :func:`max_shared_memory`, so a table's tile runs everywhere
(with fewer loads in flight where memory is short) instead of failing to launch.
"""

from __future__ import annotations

import functools

LAUNCH_CACHE_SIZE = 1024  # shapes remembered per wrapper: decode batch sizes and prefill lengths of a run
# Shared memory a kernel may take beside its staged operand tiles (epilogue layout conversions, reductions).
SHARED_MEMORY_RESERVE = 16 * 1024


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints a >= 0, b >= 1."""
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Multiprocessors of CUDA / ROCm device ``device_index`` (asked once)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def max_shared_memory(device_index: int) -> int:
    """Bytes of shared memory one program may use on CUDA / ROCm device ``device_index`` (asked once, of
    Triton's driver: the opt-in limit its launches check)."""
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def stages_that_fit(stages: int, stage_bytes: int, limit: int | None) -> int:
    """The most pipeline stages, at most ``stages`` and at least 1, whose operand tiles (``stage_bytes`` a
    stage) fit in ``limit`` bytes of shared memory beside ``SHARED_MEMORY_RESERVE`` (None: no limit)."""
    if limit is None:
        return stages
    return max(1, min(stages, (limit - SHARED_MEMORY_RESERVE) // max(stage_bytes, 1)))
