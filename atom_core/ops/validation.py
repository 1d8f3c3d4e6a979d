"""Argument checks shared by the public ops (each raises naming the bad argument), and the debug
switch that turns the per-call checks on.

The public ops check their arguments only in debug mode: ``ATOM_CORE_DEBUG=1`` in the
environment (read once, at import), ``set_debug(True)``, or a ``with debug_checks():`` block. The
checks cost 1-10 µs a call, as much as a small kernel (those that read tensor contents,
``atom_core.ops.value_checks``, more, and a host sync on a GPU), and a model that has run once with
them calls the ops with the same kinds of arguments ever after. The few checks that stop a kernel from
writing out of bounds are always on (docs/ops.md lists them).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEBUG_ENV_VAR = "ATOM_CORE_DEBUG"
_debug = os.environ.get(DEBUG_ENV_VAR, "0").strip().lower() in ("1", "true", "yes", "on")


def debug_enabled() -> bool:
    """Whether the public ops check their arguments on every call."""
    return _debug


def set_debug(enabled: bool) -> None:
    """Turn the per-call argument checks of the public ops on or off (overrides ``ATOM_CORE_DEBUG``)."""
    global _debug
    _debug = bool(enabled)


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
    """Run the block with the per-call argument checks on (or off), then restore the previous setting."""
    previous = _debug
    set_debug(enabled)
    try:
        yield
    finally:
        set_debug(previous)


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    """``shape`` entries of None match anything."""
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def check_out_shape(name: str, out: torch.Tensor | None, shape) -> None:
    """Always on: kernels write ``out`` over the input's extents, so a smaller buffer would be
    written out of bounds. One size comparison, and only when the caller passes a buffer."""
    if out is not None and out.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")


def check_out(name: str, out: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device) -> None:
    if out is None:
        return
    check_tensor(name, out)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {out.dtype}")
    if out.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {out.device}")
