"""The engine's device argument, checked against what this machine can run."""

from __future__ import annotations

import torch


def check_device(device) -> torch.device:
    """``device`` as a torch.device, refused by name when this machine cannot use it. ``"cuda"`` without an
    index becomes this thread's current device (``cuda:N``): the engine's other threads (``AsyncEngine``'s
    step thread) start on device 0 and must be told which one the engine's tensors live on."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this machine has no usable CUDA (torch {torch.__version__}, "
                         f"built {'with' if torch.version.cuda or torch.version.hip else 'without'} GPU support); "
                         f"use device='cpu'")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {str(device)!r}: the engine runs on 'cuda' or 'cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
