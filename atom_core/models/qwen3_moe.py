"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention with sparse mixture-of-experts MLPs.

Legend: T = tokens, D = hidden size, E = experts, K = experts per token.

Differences from ``qwen3.py``, all in the MLP:

- layer i is sparse when ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``
  (and ``num_experts > 0``); the other layers keep a dense SwiGLU MLP of ``intermediate_size``;
- a sparse layer's ``mlp`` is a router ``gate`` ([E, D], no bias) and ``experts`` (E SwiGLU experts
  of ``moe_intermediate_size``): softmax over E, the K = ``num_experts_per_tok`` most probable,
  renormalised to sum 1 when ``norm_topk_prob``;
- with ``use_sliding_window`` every layer attends over the last ``sliding_window`` positions
  (transformers' Qwen3-MoE ignores ``max_window_layers``).

Checkpoints store one tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, and in FP8
checkpoints ``weight_scale`` / ``weight_scale_inv`` beside each); the loader stacks them into
``mlp.experts.w13_weight`` / ``w2_weight`` (and ``*_weight_scale``) (``expert_params_mapping``).
Parameter names otherwise follow Qwen3's.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import torch
from torch import nn

from atom_core import ops
from atom_core.models.base import QUANTIZED_DENSE_FORMATS, CausalLM, PreNormDecoderLayer
from atom_core.models.config import ModelConfig
from atom_core.models.layers.linear import ReplicatedLinear
from atom_core.models.layers.mlp import GatedMLP
from atom_core.models.layers.moe import (
    FusedMoE,
    expert_params_mapping,
    moe_ranks,
    moe_ranks_of,
    stacked_expert_params_mapping,
)
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.quantization.activation import QuantizedActivation
from atom_core.models.qwen3 import Qwen3Attention
from atom_core.models.registry import register_model


def config_int(config: ModelConfig, *names: str, default: int | None = None) -> int:
    """The first of ``names`` the config holds (published and transformers-5 spellings differ), as an int."""
    for name in names:
        value = config.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"config.{name} must be an int, got {value!r}")
            return value
    if default is None:
        raise ValueError(f"config needs one of {', '.join(names)}")
    return default


def check_silu_experts(config: ModelConfig) -> None:
    """SwiGLU experts only: ``FusedMoE``'s "silu" activation is ``silu(gate) * up``."""
    if config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported by the MoE experts; expected 'silu'")


class SoftmaxTopKMoE(nn.Module):
    """Router ``gate`` ([E, H], no bias) + ``experts``: softmax top-K routing (Qwen3-MoE, Mixtral).

    forward: x [T, H] -> [T, H]. ``renormalize`` divides the K weights by their sum. ``quant_config`` /
    ``prefix`` (the experts' checkpoint name): the experts' quantization (``FusedMoE``).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool | str = False,
                 experts_ranks: dict | None = None, quant_config=None, prefix: str = "", tp_group=None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, dtype=dtype)
        quant = {} if quant_config is None else {"quant_config": quant_config, "prefix": prefix}
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, activation="silu", dtype=dtype,
                                **(experts_ranks or moe_ranks(tp_rank, tp_size, expert_parallel, tp_group)), **quant)
        self.input_quant = self.experts.input_quant  # what forward also takes (layers.norm quantizes)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """x [T, H], or quantized as ``input_quant`` says with its float rows (``normed``) -> [T, H]."""
        hidden_quant = x if isinstance(x, QuantizedActivation) else None
        if hidden_quant is not None:
            x = hidden_quant.normed
        router_logits = self.gate(x)                                                   # [T, E]
        topk_weights, topk_ids = ops.topk_softmax(router_logits, self.top_k,
                                                  renormalize=self.renormalize)        # [T, K] fp32, int32
        return self.experts(x, topk_weights, topk_ids, hidden_quant)                   # [T, H]


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE decoder-only LM (Qwen3-30B-A3B, Qwen3-235B-A22B). Quantized checkpoints: dense layers
    and experts (FP8 block / per-channel, ``CausalLM.expert_quant_args``)."""

    supported_quantization = QUANTIZED_DENSE_FORMATS

    def __init__(self, config: ModelConfig, **kwargs) -> None:
        self.num_experts = config_int(config, "num_experts", "num_local_experts", default=0)
        check_silu_experts(config)
        # before __init__: the quant config binds it
        self.expert_params_mapping = expert_params_mapping(self.num_experts, scales=True)
        self.stacked_expert_params_mapping = stacked_expert_params_mapping()  # a trainer's state_dict
        super().__init__(config, **kwargs)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """HF's rule: not listed in ``mlp_only_layers`` and every ``decoder_sparse_step``-th layer."""
        config = self.config
        step = config_int(config, "decoder_sparse_step", default=1)
        return (layer_idx not in (config.get("mlp_only_layers") or [])
                and self.num_experts > 0 and (layer_idx + 1) % step == 0)

    def sliding_window_of(self, layer_idx: int) -> int | None:
        # transformers' Qwen3-MoE: sliding_window applies to every layer, and only with use_sliding_window.
        if not self.config.get("use_sliding_window", False):
            return None
        return self.config.sliding_window

    def make_layer(self, layer_idx: int) -> nn.Module:
        config = self.config
        tp = self.tp_args()
        self_attn = Qwen3Attention(config, self.rotary_embedding(config.head_dim),
                                   sliding_window=self.sliding_window_of(layer_idx),
                                   **self.quant_args(f"model.layers.{layer_idx}.self_attn"), **tp)
        if self.is_sparse_layer(layer_idx):
            mlp = SoftmaxTopKMoE(self.num_experts, config_int(config, "num_experts_per_tok"), config.hidden_size,
                                 config_int(config, "moe_intermediate_size"),
                                 renormalize=bool(config.get("norm_topk_prob", False)),
                                 experts_ranks=moe_ranks_of(self.parallel),
                                 **self.expert_quant_args(f"model.layers.{layer_idx}.mlp.experts"), **tp)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           **self.quant_args(f"model.layers.{layer_idx}.mlp"), **tp)
        return PreNormDecoderLayer(
            self_attn, mlp,
            input_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
            post_attention_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
        )
