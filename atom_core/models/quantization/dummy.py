"""Random weights for a quantized model (``load_format="dummy"`` with a quantization): benchmarks of the
real shapes in the real storage format, without a checkpoint and without the unquantized model.

Each quantized layer draws normal(0, ``std``) values and quantizes them as its scheme stores them, a
chunk of rows (dense) or one expert (MoE) at a time, so the largest temporary is one fp32 chunk, never
the unquantized model (``LinearMethod.init_dummy``, ``ExpertMethod.init_dummy``); MXFP4 experts get
uniformly random codes with one power-of-two scale of the same magnitude. Every other parameter follows
``models.dummy_weights.initialize_dummy_weights``' rule (matrices normal(0, ``std``), biases 0, other
vectors 1, integer parameters 0).
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def initialize_dummy_quantized_weights(model: nn.Module, *, seed: int = 0, std: float = 0.02) -> None:
    """Fill ``model`` (built with a ``QuantConfig``) with seeded random weights in its stored formats."""
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generators[device]

    filled: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        init = getattr(method, "init_dummy", None)
        if init is None:
            continue
        device = next(module.parameters()).device
        filled.update(id(p) for p in init(module, generator(device), std))
    for name, param in model.named_parameters():
        if id(param) in filled:
            continue
        data = param.data
        if not data.is_floating_point():
            data.zero_()
        elif data.dim() <= 1:
            data.copy_(torch.full(data.shape, 0.0 if name.endswith("bias") else 1.0, device=data.device))
        else:
            values = torch.empty(data.shape, dtype=torch.float32, device=data.device)
            values.normal_(0.0, std, generator=generator(data.device))
            data.copy_(values)
