"""Launch arithmetic for the Triton wrappers, in plain Python ints.

``triton.next_power_of_2`` and ``triton.cdiv`` cost about 1.5 µs a call (they are Triton
functions, not plain arithmetic), and a decode step makes hundreds of such calls. These two give
the same answers for the arguments the wrappers pass (n >= 1, b >= 1) at the cost of an int op.
Wrappers cache what they derive from these (block sizes, warps, grids) per shape with
``functools.lru_cache`` keyed by the shape ints.
"""

from __future__ import annotations

import functools

LAUNCH_CACHE_SIZE = 1024  # shapes remembered per wrapper: decode batch sizes and prefill lengths of a run


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints a >= 0, b >= 1."""
    return -(-a // b)


def unit_stride(*tensors):
    """The tensors a kernel reads at unit stride (1-D per-row tensors, the rows of a block table), each
    made contiguous: no copy when it already is, a copy of a strided or expanded view; None stays None."""
    return tuple(None if t is None else t.contiguous() for t in tensors)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Multiprocessors of CUDA / ROCm device ``device_index`` (asked once)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count
