"""Argument checks shared by the public ops: each raises naming the bad argument."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
