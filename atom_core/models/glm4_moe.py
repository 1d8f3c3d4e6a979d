"""GLM-4-MoE (``Glm4MoeForCausalLM``): GQA attention with partial RoPE, group-limited sigmoid routing,
shared experts.

Legend: T = tokens, D = hidden size, H / Hk = query / KV heads on this rank, Dh = head dim,
E = routed experts (``n_routed_experts``), K = experts per token.

What differs from ``llama.py``:

- attention: biases on q, k, v (``attention_bias``) but never on o; an optional per-head RMSNorm on
  q and k before RoPE (``use_qk_norm``); RoPE turns only the first ``Dh * partial_rotary_factor``
  dims of each head (0.5 in every release);
- layers ``< first_k_dense_replace`` keep a dense SwiGLU MLP of ``intermediate_size``; the others
  are sparse:
  ``mlp.gate``: router weight [E, D] and ``e_score_correction_bias`` [E], both float32, logits in
  float32; scores = sigmoid(logits); the experts are chosen on scores + bias within the best
  ``topk_group`` of ``n_group`` groups; the weights are the unbiased scores, renormalised when
  ``norm_topk_prob``, times ``routed_scaling_factor`` (``ops.grouped_topk``);
  ``mlp.experts``: E SwiGLU experts of ``moe_intermediate_size``;
  ``mlp.shared_experts``: one dense SwiGLU MLP of ``moe_intermediate_size * n_shared_experts`` that
  every token goes through, added to the routed output.

Checkpoints store one tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``), stacked
by the loader (``expert_params_mapping``). Released checkpoints also hold the multi-token-prediction
layer(s) after the last decoder layer (``num_nextn_predict_layers``); the loader skips them.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_core import ops
from atom_core.models.base import QUANTIZED_DENSE_FORMATS, CausalLM, PreNormDecoderLayer
from atom_core.models.config import ModelConfig
from atom_core.models.layers.mlp import GatedMLP
from atom_core.models.layers.moe import (FusedMoE, expert_params_mapping, moe_ranks, moe_ranks_of,
                                          stacked_expert_params_mapping)
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.layers.rotary import RotaryEmbedding
from atom_core.models.llama import LlamaAttention
from atom_core.models.qwen3_moe import check_silu_experts, config_int
from atom_core.models.registry import register_model


class Glm4MoeAttention(LlamaAttention):
    """``LlamaAttention`` with q/k/v biases per ``attention_bias``, no o bias, optional q/k RMSNorm."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, *, sliding_window: int | None,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, quant_config=None,
                 prefix: str = "", tp_group=None) -> None:
        super().__init__(config, rotary_emb, sliding_window=sliding_window, dtype=dtype, tp_rank=tp_rank,
                         tp_size=tp_size, qkv_bias=config.attention_bias, o_bias=False, quant_config=quant_config,
                         prefix=prefix, tp_group=tp_group)
        self.use_qk_norm = bool(config.get("use_qk_norm", False))
        if self.use_qk_norm:  # weights [Dh], shared by all heads: identical on every rank
            self.set_qk_norms(RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype),
                              RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype))


class GroupedTopKRouter(nn.Module):
    """Router of a sigmoid-scored, group-limited MoE: ``weight`` [E, H] and ``e_score_correction_bias`` [E].

    Both are float32 whatever the model's dtype (as in transformers and the released checkpoints'
    use): the choice among near-equal sigmoid scores is sensitive to rounding.
    forward: x [T, H] -> router logits [T, E] float32.
    """

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class Glm4MoeSparseBlock(nn.Module):
    """``gate`` (router) + ``experts`` (routed) + ``shared_experts`` (every token). x [T, H] -> [T, H].

    ``quant_config`` / ``prefix`` (``model.layers.{i}.mlp``): the shared experts' quantization;
    ``expert_quant``: the routed experts' ``FusedMoE`` arguments (``CausalLM.expert_quant_args``)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool | str = False,
                 experts_ranks: dict | None = None, quant_config=None, prefix: str = "",
                 expert_quant: dict | None = None, tp_group=None) -> None:
        super().__init__()
        num_experts = config_int(config, "n_routed_experts", "num_local_experts")
        inter = config_int(config, "moe_intermediate_size")
        self.top_k = config_int(config, "num_experts_per_tok")
        self.num_expert_group = config_int(config, "n_group", default=1)
        self.topk_group = config_int(config, "topk_group", default=1)
        self.renormalize = bool(config.get("norm_topk_prob", True))
        self.routed_scaling_factor = float(config.get("routed_scaling_factor", 1.0))
        tp = {"tp_rank": tp_rank, "tp_size": tp_size, "tp_group": tp_group, "dtype": dtype}
        self.gate = GroupedTopKRouter(num_experts, config.hidden_size)
        self.experts = FusedMoE(num_experts, config.hidden_size, inter, activation="silu", dtype=dtype,
                                **(experts_ranks or moe_ranks(tp_rank, tp_size, expert_parallel, tp_group)),
                                **(expert_quant or {}))
        num_shared = config_int(config, "n_shared_experts", default=0)
        quant = {} if quant_config is None else {"quant_config": quant_config, "prefix": f"{prefix}.shared_experts"}
        self.shared_experts = (GatedMLP(config.hidden_size, inter * num_shared, config.hidden_act, **quant, **tp)
                               if num_shared > 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)                                                    # [T, E] fp32
        topk_weights, topk_ids = ops.grouped_topk(
            router_logits, self.top_k, num_expert_group=self.num_expert_group, topk_group=self.topk_group,
            renormalize=self.renormalize, scoring="sigmoid", e_score_correction_bias=self.gate.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor)                           # [T, K] fp32, int32
        out = self.experts(x, topk_weights, topk_ids)                                   # [T, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


@register_model("Glm4MoeForCausalLM")
class Glm4MoeForCausalLM(CausalLM):
    """GLM-4.5 / GLM-4.6 (and -Air) decoder-only MoE LM."""

    partial_rotary = True  # transformers' model rotates head_dim * partial_rotary_factor dims

    supported_quantization = QUANTIZED_DENSE_FORMATS  # dense layers, shared and routed experts

    def __init__(self, config: ModelConfig, **kwargs) -> None:
        check_silu_experts(config)
        if config.get("partial_rotary_factor") is None:
            config.extra["partial_rotary_factor"] = 0.5  # transformers' default for this model type
        self.num_experts = config_int(config, "n_routed_experts", "num_local_experts")
        # before __init__: the quant config binds it
        self.expert_params_mapping = expert_params_mapping(self.num_experts, scales=True)
        self.stacked_expert_params_mapping = stacked_expert_params_mapping()  # a trainer's state_dict
        super().__init__(config, **kwargs)

    def make_layer(self, layer_idx: int) -> nn.Module:
        config = self.config
        tp = self.tp_args()
        self_attn = Glm4MoeAttention(config, self.rotary_embedding(config.head_dim), sliding_window=None,
                                     **self.quant_args(f"model.layers.{layer_idx}.self_attn"), **tp)
        mlp_quant = self.quant_args(f"model.layers.{layer_idx}.mlp")
        if layer_idx < config_int(config, "first_k_dense_replace", default=0):
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, **mlp_quant, **tp)
        else:
            mlp = Glm4MoeSparseBlock(config, experts_ranks=moe_ranks_of(self.parallel), **mlp_quant, **tp,
                                     expert_quant=self.expert_quant_args(f"model.layers.{layer_idx}.mlp.experts"))
        return PreNormDecoderLayer(
            self_attn, mlp,
            input_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
            post_attention_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
        )
