"""DeepSeek-V2 / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``; Kimi-K2 checkpoints are the
latter with ``model_type: kimi_k2``): multi-head latent attention and DeepSeekMoE.

Legend: T = tokens, E = hidden size, H = heads, L = kv_lora_rank, R = qk_rope_head_dim,
Dn = qk_nope_head_dim, Dv = v_head_dim, X = routed experts (``n_routed_experts``), K = experts per token.

**Attention** (``layers.mla.MultiHeadLatentAttention``): q through ``q_proj`` (no ``q_lora_rank``:
V2-Lite) or ``q_a_proj -> q_a_layernorm -> q_b_proj``; one latent row ``[c_kv (L), k_pe (R)]`` per
token cached (``kv_cache_spec()`` is an MLA spec, no V); ``kv_b_proj`` expands or is absorbed. RoPE
turns the R rope dims only, in interleaved pairs (2i, 2i + 1) as every DeepSeek checkpoint is trained
(transformers' V2: a complex multiply; V3: ``rope_interleave``, default true; false there means the
NeoX halves, which V3 follows too). YaRN (``rope_scaling.type == "yarn"``): the cos/sin table carries
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, and the softmax scale is
``mscale(factor, mscale_all_dim)^2 / sqrt(Dn + R)`` (``ops.yarn_softmax_scale``).

**MLP.** Layer i is sparse when ``n_routed_experts`` is set, ``i >= first_k_dense_replace`` and
``i % moe_layer_freq == 0`` (the original DeepSeek rule; every release has ``moe_layer_freq`` 1, and
transformers only reads ``first_k_dense_replace``); other layers keep a dense SwiGLU MLP of
``intermediate_size``. A sparse layer's ``mlp``: ``gate`` (router, fp32 weight [X, E], logits in fp32),
``experts`` (X SwiGLU experts of ``moe_intermediate_size``), ``shared_experts`` (one SwiGLU MLP of
``moe_intermediate_size * n_shared_experts`` every token goes through, added). Routing by
``topk_method`` with ``scoring_func`` (``ops.grouped_topk``):

- ``greedy`` (V2-Lite): the K best scores over all experts;
- ``group_limited_greedy`` (V2): only within the ``topk_group`` best of ``n_group`` groups (group score:
  its best expert);
- ``noaux_tc`` (V3, Kimi-K2; ``gate.e_score_correction_bias`` [X] fp32): sigmoid scores, the choice on
  scores + bias within the ``topk_group`` best groups (group score: the sum of its two best biased
  scores), the weights the unbiased scores;

then divided by their sum when ``norm_topk_prob`` and times ``routed_scaling_factor``. Defaults:
V2 greedy / softmax / no renormalisation; V3 noaux_tc / sigmoid / renormalised. (transformers' V2
never renormalises; every released V2 sets ``norm_topk_prob: false``, so the two agree on them. V2 routing
with ``norm_topk_prob`` true and a scaling factor other than 1 is refused: DeepSeek's V2 code, transformers
and vLLM compute three different things there. ``noaux_tc`` takes sigmoid scores only.)

Checkpoint names are HF's (``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}``,
``self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``, ``mlp.experts.{e}.*``,
``mlp.shared_experts.*``, ``mlp.gate.{weight, e_score_correction_bias}``); gate/up fuse into
``gate_up_proj`` and the experts stack (``expert_params_mapping``). The multi-token-prediction layers
after ``num_hidden_layers`` (``num_nextn_predict_layers``) are skipped by the loader; ``models.mtp.load_mtp_module``
loads them into a draft module.

**KV pool contract** (what a runner allocates): ``kv_cache_spec(dtype)`` is ``KVCacheSpec.mla(num_layers,
L, R, dtype)``; per layer ONE tensor ``[num_blocks, block_size, L + R]`` of ``dtype`` (model dtype, or
float8_e4m3fn), bound with ``bind_kv_cache([(latent,), ...])`` or, for fp8, ``[(latent, kv_scale), ...]``
(fp32 [1]); ``kv_cache_scales()`` gives ``[(checkpoint scale or None,), ...]``, one per layer: a checkpoint's
per-layer ``self_attn.k_scale`` (compressed-tensors; ``kv_scale`` likewise, or a lone ``v_scale``) is the latent
cache's scale, as vLLM's MLA layers use it (an fp8 pool then stores ``row / k_scale``; a pool in the model dtype
ignores it).
``extra_kv_cache_specs()`` names the caches besides it (none here; DSA's indexer keys in
``models.deepseek_v32``), bound with ``bind_extra_kv_caches``.

**Quantization** (``fp8`` / compressed-tensors / quark configs, ``load_model(quantization=...)``): every
linear layer the config's rules quantize, as vLLM / ATOM serve DeepSeek-V3/R1, Kimi-K2, V3.2 and GLM-5's FP8
releases (HF ``fp8``, 128 x 128 blocks, fp32 ``weight_scale_inv`` beside each FP8 weight). MLA's
``q_proj`` / ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``o_proj`` and DSA's ``indexer.wq_b`` /
``indexer.wk`` run their linear methods (``Fp8Linear`` with block scales there); each rule (``ignore``,
``modules_to_not_convert``) applies to the checkpoint module itself (``q_a_proj`` and ``kv_a_proj_with_mqa``
stay two layers: only gate/up fuse). ``kv_b_proj`` is used as the ``w_uk`` / ``w_uv`` views of its weight,
not as a linear layer: a quantized one loads as stored and is dequantized to the model dtype once at load,
the stored copy then freed (2 bytes per element in bf16 where the checkpoint stores 1: 32 MiB per layer for V3
at tensor-parallel size 1; ``layers.mla.MultiHeadLatentAttention``). ``indexer.weights_proj`` stays fp32 and unquantized (DeepSeek stores
it so; a stored FP8 one is refused by the loader, naming the tensor). The routed experts load as FP8 block /
per-channel (``FusedMoE``), the shared experts and dense MLPs with their linear methods; the router stays fp32.
What is refused, by name: a tensor-parallel split that cuts a 128-block (``q_b_proj`` / ``kv_b_proj`` rows,
``o_proj`` columns), formats no dense layer serves (MXFP4 outside the experts), and what the config parsers
refuse (V3.1 / V3.2's ``scale_fmt: "ue8m0"`` is not refused: it loads with fp32 activation scales, see
``quantization.parse_hf``). Online quantization quantizes the same layers except ``kv_b_proj``, which stays
in the model dtype (rounding it only to dequantize it again would lose precision and save nothing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_core import ops
from atom_core.models.base import QUANTIZED_DENSE_FORMATS, CausalLM, PreNormDecoderLayer
from atom_core.models.config import ModelConfig
from atom_core.models.layers.mla import (
    LightningIndexer,
    MLACaches,
    MLAPagedAttention,
    MultiHeadLatentAttention,
)
from atom_core.models.layers.mlp import GatedMLP
from atom_core.models.layers.moe import (FusedMoE, expert_params_mapping, moe_ranks, moe_ranks_of,
                                          stacked_expert_params_mapping)
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.layers.rotary import RotaryEmbedding
from atom_core.models.qwen3_moe import check_silu_experts, config_int
from atom_core.models.registry import register_model

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


class DeepseekRouter(nn.Module):
    """``weight`` [X, E] float32 and, for ``noaux_tc``, ``e_score_correction_bias`` [X] float32 (as the
    released checkpoints are used: near-equal scores choose by rounding). forward: x [T, E] -> logits [T, X] fp32."""

    def __init__(self, num_experts: int, hidden_size: int, *, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class DeepseekMoE(nn.Module):
    """``gate`` + ``experts`` (routed) + ``shared_experts`` (every token). x [T, E] -> [T, E].

    ``quant_config`` / ``prefix`` (``model.layers.{i}.mlp``): the shared experts' quantization;
    ``expert_quant``: the routed experts' ``FusedMoE`` arguments (``CausalLM.expert_quant_args``)."""

    def __init__(self, config: ModelConfig, *, topk_method: str, scoring: str, renormalize: bool,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool | str = False,
                 experts_ranks: dict | None = None,
                 quant_config=None, prefix: str = "", expert_quant: dict | None = None, tp_group=None) -> None:
        super().__init__()
        num_experts = config_int(config, "n_routed_experts")
        inter = config_int(config, "moe_intermediate_size")
        self.top_k = config_int(config, "num_experts_per_tok")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {self.top_k}")
        self.scoring = scoring
        self.renormalize = renormalize
        self.routed_scaling_factor = float(config.get("routed_scaling_factor", 1.0))
        if topk_method == "greedy":  # every expert is one group
            self.num_expert_group, self.topk_group = 1, 1
        else:
            self.num_expert_group = config_int(config, "n_group", default=1)
            self.topk_group = config_int(config, "topk_group", default=1)
            if num_experts % self.num_expert_group or not 1 <= self.topk_group <= self.num_expert_group:
                raise ValueError(f"n_group={self.num_expert_group} must divide n_routed_experts={num_experts} and "
                                 f"topk_group={self.topk_group} lie in [1, n_group]")
            eligible = self.topk_group * (num_experts // self.num_expert_group)
            if self.top_k > eligible:
                raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the {eligible} experts its "
                                 f"topk_group={self.topk_group} of n_group={self.num_expert_group} groups hold "
                                 f"(n_routed_experts={num_experts})")
        tp = {"tp_rank": tp_rank, "tp_size": tp_size, "tp_group": tp_group, "dtype": dtype}
        self.gate = DeepseekRouter(num_experts, config.hidden_size, correction_bias=topk_method == "noaux_tc")
        self.experts = FusedMoE(num_experts, config.hidden_size, inter, activation="silu", dtype=dtype,
                                **(experts_ranks or moe_ranks(tp_rank, tp_size, expert_parallel, tp_group)),
                                **(expert_quant or {}))
        num_shared = config_int(config, "n_shared_experts", default=0)
        quant = {} if quant_config is None else {"quant_config": quant_config, "prefix": f"{prefix}.shared_experts"}
        self.shared_experts = (GatedMLP(config.hidden_size, inter * num_shared, config.hidden_act, **quant, **tp)
                               if num_shared > 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)                                                    # [T, X] fp32
        topk_weights, topk_ids = ops.grouped_topk(
            router_logits, self.top_k, num_expert_group=self.num_expert_group, topk_group=self.topk_group,
            renormalize=self.renormalize, scoring=self.scoring,
            e_score_correction_bias=self.gate.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor)                           # [T, K] fp32, int32
        out = self.experts(x, topk_weights, topk_ids)                                   # [T, E]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


@register_model("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(MLACaches, CausalLM):
    """DeepSeek-V2 and V2-Lite (and their Chat versions)."""

    model_types: tuple[str, ...] = ("deepseek_v2",)
    supported_quantization = QUANTIZED_DENSE_FORMATS  # MLA (kv_b_proj dequantized at load), MLPs, experts
    default_topk_method = "greedy"
    default_scoring = "softmax"
    default_norm_topk_prob = False
    # Only gate/up fuse: q_proj is MLA's own projection here, not part of a qkv_proj.
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, **kwargs) -> None:
        if config.model_type not in self.model_types and config.model_type:
            raise ValueError(f"{type(self).__name__} serves model_type {' or '.join(map(repr, self.model_types))}, "
                             f"got {config.model_type!r}")
        check_silu_experts(config)
        self.topk_method = config.get("topk_method") or self.default_topk_method
        self.scoring = config.get("scoring_func") or self.default_scoring
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; expected one of {TOPK_METHODS}")
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring!r} is not supported; expected one of {SCORING_FUNCS}")
        if self.topk_method == "noaux_tc" and self.scoring != "sigmoid":
            raise ValueError(f"topk_method 'noaux_tc' routes on sigmoid scores (DeepSeek-V3, as transformers and "
                             f"DeepSeek's code compute it); scoring_func {self.scoring!r} is not supported with it")
        norm = config.get("norm_topk_prob")
        self.renormalize = self.default_norm_topk_prob if norm is None else bool(norm)
        scaling = float(config.get("routed_scaling_factor", 1.0))
        if self.renormalize and self.topk_method != "noaux_tc":
            raise ValueError(f"topk_method {self.topk_method!r} with norm_topk_prob true (routed_scaling_factor "
                             f"{scaling}): the references disagree (transformers' DeepSeek-V2 never renormalises; "
                             "DeepSeek-V2's code renormalises instead of scaling, vLLM renormalises and scales), and "
                             "no released checkpoint sets it; set norm_topk_prob false (every DeepSeek-V2 release)")
        self.num_experts = config_int(config, "n_routed_experts", default=0)
        # before __init__: the quant config binds it
        self.expert_params_mapping = expert_params_mapping(self.num_experts, scales=True) if self.num_experts else []
        self.stacked_expert_params_mapping = stacked_expert_params_mapping() if self.num_experts else []
        self.kv_lora_rank = config_int(config, "kv_lora_rank")
        self.qk_rope_head_dim = config_int(config, "qk_rope_head_dim")
        self.qk_nope_head_dim = config_int(config, "qk_nope_head_dim")
        self.v_head_dim = config_int(config, "v_head_dim")
        q_lora_rank = config.get("q_lora_rank")
        self.q_lora_rank = None if q_lora_rank is None else config_int(config, "q_lora_rank")
        # Softmax scale over the Dn + R dims of q.k, with DeepSeek's YaRN correction.
        self.softmax_scale = ops.yarn_softmax_scale(self.qk_nope_head_dim + self.qk_rope_head_dim,
                                                    config.rope_scaling)
        super().__init__(config, **kwargs)
        self._mla_layers = [m for m in self.model.layers.modules() if isinstance(m, MLAPagedAttention)]
        self._indexers = [m for m in self.model.layers.modules() if isinstance(m, LightningIndexer)]

    def rope_is_neox(self) -> bool:
        """DeepSeek-V2 rotates interleaved pairs (transformers' complex multiply), always."""
        return False

    def mla_rotary_embedding(self) -> RotaryEmbedding:
        """The rotary embedding of the R rope dims, built once and shared by every layer."""
        if not hasattr(self, "_rotary"):  # after the build (an MTP block): the table the layers share
            return self.model.layers[0].self_attn.rotary_emb
        key = (self.qk_rope_head_dim, "mla")
        if key not in self._rotary:
            config = self.config
            self._rotary[key] = RotaryEmbedding(self.qk_rope_head_dim, self.qk_rope_head_dim,
                                                config.max_position_embeddings, config.rope_theta,
                                                config.rope_scaling, is_neox=self.rope_is_neox(),
                                                device=self._build_device)
        return self._rotary[key]

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """The original DeepSeek rule: experts from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
        config = self.config
        return (self.num_experts > 0 and layer_idx >= config_int(config, "first_k_dense_replace", default=0)
                and layer_idx % config_int(config, "moe_layer_freq", default=1) == 0)

    def make_attention(self, layer_idx: int, **dsa) -> MultiHeadLatentAttention:
        """Layer ``layer_idx``'s MLA block; ``dsa``: a DSA model's ``indexer`` / ``topk_share`` for it. Its linear
        layers get the model's quantization (``self_attn.*`` rules; see the module docstring)."""
        config = self.config
        return MultiHeadLatentAttention(
            config.hidden_size, config.num_attention_heads, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            rotary_emb=self.mla_rotary_embedding(), scale=self.softmax_scale, rms_norm_eps=config.rms_norm_eps,
            bias=config.attention_bias, **self.tp_args(), **dsa,
            **self.quant_args(f"model.layers.{layer_idx}.self_attn"))

    def make_layer(self, layer_idx: int) -> nn.Module:
        """Decoder layer ``layer_idx`` (also past ``num_hidden_layers``: the MTP blocks, ``models.mtp``)."""
        config = self.config
        tp = self.tp_args()
        self_attn = self.make_attention(layer_idx)
        mlp_quant = self.quant_args(f"model.layers.{layer_idx}.mlp")
        if self.is_sparse_layer(layer_idx):
            mlp = DeepseekMoE(config, topk_method=self.topk_method, scoring=self.scoring,
                              renormalize=self.renormalize, experts_ranks=moe_ranks_of(self.parallel), **mlp_quant, **tp,
                              expert_quant=self.expert_quant_args(f"model.layers.{layer_idx}.mlp.experts"))
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias,
                           **mlp_quant, **tp)
        return PreNormDecoderLayer(
            self_attn, mlp,
            input_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
            post_attention_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
        )


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 and Kimi-K2 (``model_type: kimi_k2``, the same architecture)."""

    model_types = ("deepseek_v3", "kimi_k2")
    default_topk_method = "noaux_tc"
    default_scoring = "sigmoid"
    default_norm_topk_prob = True

    def rope_is_neox(self) -> bool:
        """Interleaved pairs unless the config says ``rope_interleave: false`` (transformers' default is true)."""
        return not bool(self.config.get("rope_interleave", True))
