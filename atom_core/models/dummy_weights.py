"""Fill a model's parameters without a checkpoint: seeded random values or zeros.

Used by ``load_format="dummy"`` (benchmarks, tests of the plumbing: numbers of the right
scale, no download) and ``load_format="zeros"``.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, *, seed: int = 0, std: float = 0.02) -> None:
    """Random weights: matrices ~ normal(0, std), biases (``*.bias``) 0, other vectors 1.

    Vectors other than biases are mostly norm scales, for which 1 keeps activations at a sane
    scale. Values are drawn in float32 on the parameter's device from a generator seeded with
    ``seed`` (parameters in ``named_parameters`` order), then cast, so a given seed gives the
    same weights on every run on the same kind of device. Integer parameters are zeroed.
    """
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        data = param.data
        if not data.is_floating_point():
            data.zero_()
            continue
        if data.dim() <= 1:
            # via a float32 tensor: fill_ is not implemented for every dtype (float8)
            data.copy_(torch.full(data.shape, 0.0 if name.endswith("bias") else 1.0, device=data.device))
            continue
        gen = generators.get(data.device)
        if gen is None:
            gen = generators[data.device] = torch.Generator(device=data.device).manual_seed(seed)
        values = torch.empty(data.shape, dtype=torch.float32, device=data.device)
        values.normal_(0.0, std, generator=gen)
        data.copy_(values)


@torch.no_grad()
def initialize_zero_weights(model: nn.Module) -> None:
    """Every parameter set to zero."""
    for param in model.parameters():
        param.data.zero_()
