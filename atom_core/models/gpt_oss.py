"""GPT-OSS (``GptOssForCausalLM``): attention with per-head sinks and alternating sliding windows,
a biased top-K router and clamped-SwiGLU experts with biases.

Legend: T = tokens, D = hidden size, H / Hk = query / KV heads on this rank, Dh = head dim,
E = experts (``num_local_experts``), K = experts per token.

What differs from ``llama.py``:

- attention: biases on q, k, v and o; ``self_attn.sinks`` [H], one learned logit per head that
  joins every softmax over keys and takes probability mass without contributing a value
  (passed to ``ops.paged_attention(sinks=...)``, kept in float32); layers that ``layer_types``
  marks ``sliding_attention`` see the last ``sliding_window`` positions (every other layer in
  the releases);
- RoPE: yarn scaling (``truncate: false`` in the releases), rotating the two halves of Dh;
- MLP, every layer: ``mlp.router`` [E, D] with a bias; the K largest logits are softmaxed among
  themselves (``ops.gpt_oss_topk``); ``mlp.experts`` apply
  ``y = W2 ((up + 1) * g * sigmoid(1.702 g)) + b2`` with ``g = min(gate, 7)``, ``up`` clamped to
  [-7, 7], ``[gate, up] = W13 x + b13`` (``ops.fused_experts(activation="swiglu_clamped")``).

Checkpoints already stack the experts, with ``x @ W`` layout: ``mlp.experts.gate_up_proj``
``[E, D, 2I]`` whose columns interleave gate and up (column ``2j`` gate j, ``2j + 1`` up j),
``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj`` ``[E, I, D]``, ``down_proj_bias`` ``[E, D]``. The
loader transposes the weights into ``mlp.experts.w13_weight`` ``[E, 2I, D]`` (rows still
interleaved) and ``w2_weight`` ``[E, D, I]`` (``fused_expert_params_mapping``). The released
checkpoints store these two weights in MXFP4 instead (``gate_up_proj_blocks`` /
``gate_up_proj_scales``, ``down_proj_blocks`` / ``down_proj_scales``, see ``models.mxfp4``): the
quantised rows are the output dim, so the loader's decoded ``[E, 2I, D]`` and ``[E, D, I]`` are
already this module's layout and load without a transpose; the model computes in its own dtype.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import math

import torch
from torch import nn

from atom_core import ops
from atom_core.models.base import CausalLM, PreNormDecoderLayer
from atom_core.models.config import ModelConfig
from atom_core.models.layers.linear import ReplicatedLinear, check_shape, copy_into
from atom_core.models.layers.moe import (
    FusedMoE,
    fused_expert_params_mapping,
    moe_ranks,
    moe_ranks_of,
    mxfp4_expert_params_mapping,
)
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.layers.rotary import RotaryEmbedding
from atom_core.models.llama import LlamaAttention
from atom_core.models.qwen3_moe import config_int
from atom_core.models.registry import register_model

# The constants ops.fused_experts(activation="swiglu_clamped") computes with.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


class GptOssAttention(LlamaAttention):
    """``LlamaAttention`` with biases on q, k, v, o and a sink logit per query head."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, *, sliding_window: int | None,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, quant_config=None,
                 prefix: str = "", tp_group=None) -> None:
        super().__init__(config, rotary_emb, sliding_window=sliding_window, dtype=dtype, tp_rank=tp_rank,
                         tp_size=tp_size, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                         quant_config=quant_config, prefix=prefix, tp_group=tp_group)
        self.total_num_heads = config.num_attention_heads
        # fp32 whatever the model dtype: the kernels take the sinks as fp32 logits.
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.sinks.label = "GptOssAttention.sinks"
        self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Full [num_attention_heads] checkpoint tensor -> this rank's query heads."""
        if shard_id is not None:
            raise ValueError(f"{param.label} is not fused; got shard_id={shard_id!r}")
        check_shape(param.label, loaded, (self.total_num_heads,))
        copy_into(param.data, loaded.narrow(0, self.qkv_proj.shard.q_start, self.num_heads))


class GptOssMoE(nn.Module):
    """``router`` (with bias) + ``experts`` (clamped SwiGLU, biases). x [T, H] -> [T, H]. ``quant_config`` /
    ``prefix`` (``model.layers.{i}.mlp.experts``): the experts' quantization (MXFP4 kept packed)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool | str = False,
                 experts_ranks: dict | None = None, quant_config=None, prefix: str = "", tp_group=None) -> None:
        super().__init__()
        num_experts = config_int(config, "num_local_experts", "num_experts")
        self.top_k = config_int(config, "num_experts_per_tok", "experts_per_token")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {self.top_k}")
        self.router = ReplicatedLinear(config.hidden_size, num_experts, bias=True, dtype=dtype)
        quant = {} if quant_config is None else {"quant_config": quant_config, "prefix": prefix}
        self.experts = FusedMoE(num_experts, config.hidden_size, config.intermediate_size,
                                activation="swiglu_clamped", bias=True, dtype=dtype,
                                **(experts_ranks or moe_ranks(tp_rank, tp_size, expert_parallel, tp_group)), **quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.router(x)                                               # [T, E]
        topk_weights, topk_ids = ops.gpt_oss_topk(router_logits, self.top_k)         # [T, K] fp32, int32
        return self.experts(x, topk_weights, topk_ids)                               # [T, H]


@register_model("GptOssForCausalLM")
class GptOssForCausalLM(CausalLM):
    """gpt-oss-20b / gpt-oss-120b (MXFP4 or bf16 expert weights in the checkpoint)."""

    # the released checkpoints' MXFP4 experts; online FP8 (quantization="fp8"|"fp8_block") of a bf16 copy
    supported_quantization = ("mxfp4", "fp8")
    supported_expert_formats = ("mxfp4", "fp8_block", "fp8_channel")

    def __init__(self, config: ModelConfig, **kwargs) -> None:
        for key, expected in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
            value = config.get(key, expected)
            if not isinstance(value, (int, float)) or not math.isclose(value, expected):
                raise ValueError(f"config.{key}={value!r} is not supported: the experts' activation uses {expected}")
        # before __init__: the quant config binds it
        self.expert_params_mapping = fused_expert_params_mapping(bias=True) + mxfp4_expert_params_mapping()
        super().__init__(config, **kwargs)

    def make_layer(self, layer_idx: int) -> nn.Module:
        config = self.config
        tp = self.tp_args()
        self_attn = GptOssAttention(config, self.rotary_embedding(config.head_dim, config.layer_types[layer_idx]),
                                    sliding_window=self.sliding_window_of(layer_idx),
                                    **self.quant_args(f"model.layers.{layer_idx}.self_attn"), **tp)
        experts = self.expert_quant_args(f"model.layers.{layer_idx}.mlp.experts")
        return PreNormDecoderLayer(
            self_attn, GptOssMoE(config, experts_ranks=moe_ranks_of(self.parallel), **experts, **tp),
            input_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
            post_attention_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
        )
