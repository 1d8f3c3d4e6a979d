"""Gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul.

Legend: T = tokens, D = hidden size, I = intermediate size, R = tensor-parallel ranks.

``gate_up_proj`` (column-parallel) computes ``[T, 2 * I / R]`` = this rank's ``[gate | up]``;
the activation op folds the product into ``[T, I / R]``; ``down_proj`` (row-parallel) sums the
ranks' partial products back to ``[T, D]``. The checkpoint's ``gate_proj`` / ``up_proj`` load
into ``gate_up_proj`` as shards 0 / 1 (``packed_modules_mapping``). ``tp_group``: the process group
the ``down_proj`` sum runs over (``layers.linear``).
"""

from __future__ import annotations

import torch
from torch import nn

from atom_core import ops
from atom_core.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from atom_core.models.quantization.activation import QuantizedActivation

# HF ``hidden_act`` names -> (op, extra keyword arguments).
_GATED_ACTIVATIONS = {
    "silu": ("silu_and_mul", {}),
    "swish": ("silu_and_mul", {}),
    "gelu": ("gelu_and_mul", {"approximate": "none"}),
    "gelu_pytorch_tanh": ("gelu_and_mul", {"approximate": "tanh"}),
    "gelu_new": ("gelu_and_mul", {"approximate": "tanh"}),
}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class GatedMLP(nn.Module):
    """x [T, D] -> [T, D]; parameters ``gate_up_proj`` and ``down_proj`` (HF's names, gate/up fused).

    ``hidden_act``: one of ``silu`` (SwiGLU), ``gelu`` (exact GeGLU), ``gelu_pytorch_tanh`` /
    ``gelu_new`` (tanh-approximated GeGLU). ``quant_config`` / ``prefix`` (e.g. ``model.layers.0.mlp``):
    the linear layers' quantization (``layers.linear``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", *,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype | None = None, quant_config=None, prefix: str = "", tp_group=None) -> None:
        super().__init__()
        if hidden_act not in _GATED_ACTIVATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; choose one of {sorted(_GATED_ACTIVATIONS)}")
        self.hidden_act = hidden_act
        op_name, self._act_kwargs = _GATED_ACTIVATIONS[hidden_act]
        self._act = getattr(ops, op_name)
        tp = {"tp_rank": tp_rank, "tp_size": tp_size, "tp_group": tp_group, "dtype": dtype,
              "quant_config": quant_config}
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias,
                                                       prefix=_join(prefix, "gate_up_proj"), **tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, prefix=_join(prefix, "down_proj"),
                                           **tp)
        self.input_quant = self.gate_up_proj.input_quant  # what forward also takes (layers.norm quantizes)
        # SiLU's product reaches down_proj quantized where down_proj quantizes its input dynamically
        self._down_quant = self.down_proj.input_quant if op_name == "silu_and_mul" else None

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """x: [T, D] (or quantized as ``input_quant`` says) -> [T, D] in the weights' dtype."""
        gate_up = self.gate_up_proj(x)                    # [T, 2 * I / R] = [gate | up]
        if self._down_quant is not None:                  # act(gate) * up, quantized for down_proj: one launch
            q, scale = ops.silu_and_mul_quant(gate_up, group_size=self._down_quant.group_size,
                                              dtype=self._down_quant.dtype)
            return self.down_proj(QuantizedActivation(q, scale, gate_up.dtype))
        hidden = self._act(gate_up, **self._act_kwargs)   # [T, I / R] = act(gate) * up
        return self.down_proj(hidden)

    def extra_repr(self) -> str:
        return f"hidden_act={self.hidden_act}"
