"""Activations handed to a quantized linear layer already quantized, by the op that produced them.

Legend: T = tokens, K = the layer's input features (this rank's), G = groups per row.

A linear method whose activation quantization is dynamic per 1 x 128 group (block FP8) or per token
(per-channel FP8 / INT8) says so in ``LinearMethod.input_quant``; a linear layer keeps it as
``layer.input_quant`` and the module that owns the layer as its own ``input_quant`` (attention: its
``qkv_proj``; a gated MLP: its ``gate_up_proj``). The op before the layer then quantizes in its own
epilogue (``ops.rms_norm_quant``, ``ops.silu_and_mul_quant``) and passes a ``QuantizedActivation``
where the float activation would go: the values equal quantizing the float activation (the fused ops
round to the activation's dtype first), with one launch fewer per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ActivationQuant:
    """Dynamic quantization of a linear layer's input: to ``dtype`` (fp8 e4m3fn or int8) with one scale per
    ``group_size`` consecutive values of a row (128: block FP8's groups; K: one scale per token)."""

    dtype: torch.dtype
    group_size: int
    keep_normed: bool = False  # the float activation too (QuantizedActivation.normed): a MoE block's router reads it


@dataclass(frozen=True)
class QuantizedActivation:
    """q [T, K] of ``ActivationQuant.dtype`` and scale [T, G] fp32, standing for a float activation of
    ``dtype`` (the layer's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    normed: torch.Tensor | None = None  # the float activation itself, when ActivationQuant.keep_normed asked for it

    @property
    def shape(self) -> torch.Size:
        return self.q.shape
