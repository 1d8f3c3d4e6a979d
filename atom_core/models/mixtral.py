"""Mixtral (``MixtralForCausalLM``): Llama's attention with a top-2 mixture of SwiGLU experts in every layer.

Legend: T = tokens, D = hidden size, E = experts (``num_local_experts``), K = experts per token.

Differences from ``llama.py``:

- every layer's MLP is sparse: router ``gate`` ([E, D], no bias), softmax over E, the K =
  ``num_experts_per_tok`` most probable experts, their weights renormalised to sum 1; each
  expert is a SwiGLU MLP of ``intermediate_size``;
- ``sliding_window`` (when set) applies to every layer (Mixtral-8x7B v0.1 sets 4096; later
  checkpoints set null);
- no attention biases.

Checkpoints name the block ``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up) and
``w2`` (down): ``model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight``. The model names it
``mlp`` (as transformers does in memory): ``checkpoint_renames`` maps the name, and
``expert_params_mapping`` stacks the experts into ``mlp.experts.w13_weight`` / ``w2_weight``.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

from torch import nn

from atom_core.models.base import PreNormDecoderLayer
from atom_core.models.config import ModelConfig
from atom_core.models.layers.moe import expert_params_mapping, moe_ranks_of, stacked_expert_params_mapping
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.llama import LlamaAttention, LlamaForCausalLM
from atom_core.models.qwen3_moe import SoftmaxTopKMoE, check_silu_experts, config_int
from atom_core.models.registry import register_model


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral sparse decoder-only LM (Mixtral-8x7B, 8x22B)."""

    def __init__(self, config: ModelConfig, **kwargs) -> None:
        self.num_experts = config_int(config, "num_local_experts", "num_experts")
        check_silu_experts(config)
        # Before __init__: the quant config binds it.
        self.expert_params_mapping = expert_params_mapping(self.num_experts, gate="w1", up="w3", down="w2",
                                                           scales=True)
        self.stacked_expert_params_mapping = stacked_expert_params_mapping()  # a trainer's state_dict
        super().__init__(config, **kwargs)

    @staticmethod
    def checkpoint_renames(name: str) -> str:
        """``...layers.{i}.block_sparse_moe.*`` -> ``...layers.{i}.mlp.*``."""
        return name.replace(".block_sparse_moe.", ".mlp.")

    def make_layer(self, layer_idx: int) -> nn.Module:
        config = self.config
        tp = self.tp_args()
        self_attn = LlamaAttention(config, self.rotary_embedding(config.head_dim, config.layer_types[layer_idx]),
                                   sliding_window=self.sliding_window_of(layer_idx),
                                   **self.quant_args(f"model.layers.{layer_idx}.self_attn"), **tp)
        # The checkpoint's name for the experts (rules are written against it): block_sparse_moe.
        mlp = SoftmaxTopKMoE(self.num_experts, config_int(config, "num_experts_per_tok"), config.hidden_size,
                             config.intermediate_size, renormalize=True, experts_ranks=moe_ranks_of(self.parallel),
                             **self.expert_quant_args(f"model.layers.{layer_idx}.block_sparse_moe.experts"), **tp)
        return PreNormDecoderLayer(
            self_attn, mlp,
            input_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
            post_attention_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
        )
