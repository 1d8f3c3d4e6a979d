"""Llama (``LlamaForCausalLM``): pre-norm decoder with GQA, RoPE and a SwiGLU MLP.

Legend: T = tokens, D = hidden size, H / Hk = query / KV heads on this rank, Dh = head dim.

Covers the Llama 1-3.x family and look-alikes saved under this name: optional explicit
``head_dim`` (``!= D / heads``), ``attention_bias`` (q, k, v and o), ``mlp_bias``, RoPE scaling
(``linear``, ``llama3``, ``yarn``; ``partial_rotary_factor`` below 1 refused: ``CausalLM.partial_rotary``), and
per-layer sliding windows from ``layer_types`` (``"sliding_attention"`` layers attend over the last
``config.sliding_window`` positions, as Ministral does).

Parameter names follow the HF checkpoint, with q/k/v fused into ``qkv_proj`` and gate/up
into ``gate_up_proj`` (see ``base.DEFAULT_PACKED_MODULES_MAPPING``)::

    model.embed_tokens.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.qkv_proj.weight   (+ .bias with attention_bias)
    model.layers.{i}.self_attn.o_proj.weight     (+ .bias with attention_bias)
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.gate_up_proj.weight     (+ .bias with mlp_bias)
    model.layers.{i}.mlp.down_proj.weight        (+ .bias with mlp_bias)
    model.norm.weight
    lm_head.weight                               (shared with embed_tokens when tied)
"""

from __future__ import annotations

import torch
from torch import nn

from atom_core import ops
from atom_core.cache.token_layout import StepLayout
from atom_core.models.base import QUANTIZED_DENSE_FORMATS, CausalLM, PreNormDecoderLayer
from atom_core.models.config import ModelConfig
from atom_core.models.layers.attention import PagedAttention
from atom_core.models.layers.linear import QKVParallelLinear, RowParallelLinear
from atom_core.models.layers.mlp import GatedMLP
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.layers.rotary import RotaryEmbedding
from atom_core.models.quantization.activation import QuantizedActivation
from atom_core.models.registry import register_model


class LlamaAttention(nn.Module):
    """qkv_proj -> split heads -> (per-head q/k RMSNorm +) RoPE -> paged attention -> o_proj.

    ``q_norm`` / ``k_norm``: None here; architectures that normalise each q and k head over Dh
    before RoPE (Qwen3, GLM-4-MoE's ``use_qk_norm``) give them with :meth:`set_qk_norms`, and the
    norms and the rotation then run as one op (``ops.qk_norm_rope_``). ``qkv_bias`` / ``o_bias`` default to
    ``config.attention_bias``; architectures that bias only q, k, v (Qwen2) pass them explicitly.
    ``scale``: the softmax scale (None: ``Dh ** -0.5``; Gemma 2: ``query_pre_attn_scalar ** -0.5``);
    ``logit_softcap``: c > 0 caps the scores as ``c * tanh(s / c)`` (0: off), as ``PagedAttention`` takes them.
    ``quant_config`` / ``prefix`` (``model.layers.{i}.self_attn``): the projections' quantization.
    ``tp_group``: the process group ``o_proj``'s sum runs over (``models.parallel``).
    """

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, *, sliding_window: int | None,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                 qkv_bias: bool | None = None, o_bias: bool | None = None, scale: float | None = None,
                 logit_softcap: float = 0.0, quant_config=None, prefix: str = "", tp_group=None) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.head_dim = head_dim
        qkv_bias = config.attention_bias if qkv_bias is None else qkv_bias
        o_bias = config.attention_bias if o_bias is None else o_bias
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, qkv_bias,
                                          tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, dtype=dtype,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads          # H on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads    # Hk on this rank
        self.q_size = self.qkv_proj.q_size                # H * Dh
        self.kv_size = self.qkv_proj.kv_size              # Hk * Dh
        self.input_quant = self.qkv_proj.input_quant      # what forward also takes (layers.norm quantizes)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        o_bias, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, dtype=dtype,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        # A block-FP8 o_proj reads its input in 1 x 128 fp8 groups: with Dh = 128, one a head, which the
        # attention quantizes (ops.paged_attention(quantize=True): a launch fewer where it splits the context).
        o_quant = self.o_proj.input_quant
        self._quantized_out = (o_quant is not None and o_quant.dtype == torch.float8_e4m3fn
                               and o_quant.group_size == head_dim)
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(self.num_heads, head_dim, self.num_kv_heads,
                                   scale=head_dim ** -0.5 if scale is None else scale,
                                   sliding_window=sliding_window, logit_softcap=logit_softcap)
        self.sinks: nn.Parameter | None = None  # per-head sink logits [H] fp32 (GPT-OSS sets them)
        self.q_norm: RMSNorm | None = None  # per-head RMSNorms over Dh before RoPE (set_qk_norms)
        self.k_norm: RMSNorm | None = None

    def set_qk_norms(self, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        """Normalise every q head with ``q_norm`` and every k head with ``k_norm`` (over Dh) before RoPE.

        Their weights [Dh] are shared by all heads, so identical on every rank (no tensor-parallel
        split); HF's names ``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight``. The norms run
        fused with the rotation (``ops.qk_norm_rope_``), which takes one eps and plain weights: norms
        of another size than Dh, with different eps, or Gemma's ``1 + weight`` are refused here.
        """
        for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
            if not isinstance(norm, RMSNorm) or norm.hidden_size != self.head_dim or norm.gemma:
                raise ValueError(f"{name} must be a non-gemma RMSNorm over head_dim={self.head_dim}, got {norm!r}")
        if q_norm.eps != k_norm.eps:
            raise ValueError(f"q_norm and k_norm must share one eps (ops.qk_norm_rope_ takes one), "
                             f"got {q_norm.eps} and {k_norm.eps}")
        self.q_norm, self.k_norm = q_norm, k_norm

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: StepLayout) -> torch.Tensor:
        """positions [T] int64, hidden [T, D] -> [T, D]."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)                                             # [T, (H + 2 Hk) Dh]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # RoPE in place, in one op with the KV store
            rope = dict(rotary_emb=self.rotary_emb, positions=positions)
        else:  # per-head RMSNorm of q and k, then RoPE: one op, in place on the views of qkv
            ops.qk_norm_rope_(q, k, self.q_norm.weight, self.k_norm.weight, positions,
                              self.rotary_emb.cos_sin_cache, eps=self.q_norm.eps, is_neox=self.rotary_emb.is_neox)
            rope = {}
        if self._quantized_out:  # fp8 [T, H, Dh] and a scale a head [T, H]
            out, scale = self.attn(q, k, v, batch, sinks=self.sinks, quantize=True, **rope)
            return self.o_proj(QuantizedActivation(out.view(num_tokens, self.q_size), scale, q.dtype))
        out = self.attn(q, k, v, batch, sinks=self.sinks, **rope)               # [T, H, Dh]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(CausalLM):
    """Llama decoder-only LM. See the module docstring for what the config may turn on."""

    supported_quantization = QUANTIZED_DENSE_FORMATS

    attention_cls: type[LlamaAttention] = LlamaAttention

    def make_layer(self, layer_idx: int) -> nn.Module:
        config = self.config
        layer_type = config.layer_types[layer_idx]
        tp = self.tp_args()
        self_attn = self.attention_cls(config, self.rotary_embedding(config.head_dim, layer_type),
                                       sliding_window=self.sliding_window_of(layer_idx),
                                       **self.quant_args(f"model.layers.{layer_idx}.self_attn"), **tp)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                       bias=config.mlp_bias, **self.quant_args(f"model.layers.{layer_idx}.mlp"), **tp)
        return PreNormDecoderLayer(
            self_attn, mlp,
            input_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
            post_attention_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=self.dtype),
        )
