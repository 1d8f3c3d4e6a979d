"""Gemma 2 (``Gemma2ForCausalLM``): Llama's attention and gated MLP with Gemma's norms, scales and caps.

Legend: T = tokens, D = hidden size, Dh = head dim, V = vocabulary.

Differences from Llama (``llama.py``), as transformers' ``modeling_gemma2.py`` computes them:

- every RMSNorm scales by ``1 + weight`` (``RMSNorm(gemma=True)``), the final norm too;
- four norms per layer ("sandwich" norms): ``x + post_attention_layernorm(attn(input_layernorm(x)))``,
  then ``+ post_feedforward_layernorm(mlp(pre_feedforward_layernorm(.)))``;
- the embedding output is multiplied by ``sqrt(D)``, rounded to the activations' dtype first;
- attention scale ``query_pre_attn_scalar ** -0.5`` (not ``Dh ** -0.5``), and the scores soft-capped
  as ``c * tanh(s / c)`` with ``c = attn_logit_softcapping``;
- the final logits soft-capped the same way with ``c = final_logit_softcapping``;
- MLP activation from ``hidden_activation`` (``gelu_pytorch_tanh``), no MLP bias;
- a config without ``layer_types`` slides on the even layers (0, 2, ...) and attends fully on the odd
  ones; ``ModelConfig`` derives them, with the family's other defaults (tied head, ``head_dim`` 256,
  window 4096, caps 50 and 30) for keys an older config leaves out. A cap of null is off.

Parameter names follow the HF checkpoint, with q/k/v fused into ``qkv_proj`` and gate/up into
``gate_up_proj`` (see ``base.DEFAULT_PACKED_MODULES_MAPPING``)::

    model.embed_tokens.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.qkv_proj.weight   (+ .bias with attention_bias)
    model.layers.{i}.self_attn.o_proj.weight     (+ .bias with attention_bias)
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.pre_feedforward_layernorm.weight
    model.layers.{i}.mlp.gate_up_proj.weight
    model.layers.{i}.mlp.down_proj.weight
    model.layers.{i}.post_feedforward_layernorm.weight
    model.norm.weight
    lm_head.weight                               (shared with embed_tokens when tied, the default)
"""

from __future__ import annotations

import torch
from torch import nn

from atom_core.cache.token_layout import StepLayout
from atom_core.models.base import CausalLM
from atom_core.models.config import ModelConfig
from atom_core.models.layers.mlp import GatedMLP
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.llama import LlamaAttention
from atom_core.models.registry import register_model


def _softcap(config, key: str) -> float:
    """A soft-cap from the config: its value, 0.0 (off) where it is null."""
    value = config.get(key)
    return 0.0 if value is None else float(value)


class Gemma2DecoderLayer(nn.Module):
    """Sandwich norms: a norm before and after the attention and before and after the MLP.

    The residual adds are fused into ``input_layernorm`` and ``pre_feedforward_layernorm`` (the norms that
    read the residual stream, see ``layers.norm``); ``post_attention_layernorm`` and
    ``post_feedforward_layernorm`` normalise the attention and MLP outputs before they are added.
    ``forward`` returns ``(hidden, residual)`` with ``hidden + residual`` the layer's output. An attention or
    MLP module whose first linear layer quantizes its input dynamically says how in ``input_quant``; the
    norm before it then quantizes in the same launch, as in ``base.PreNormDecoderLayer``.
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, *, input_layernorm: RMSNorm,
                 post_attention_layernorm: RMSNorm, pre_feedforward_layernorm: RMSNorm,
                 post_feedforward_layernorm: RMSNorm) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.pre_feedforward_layernorm = pre_feedforward_layernorm
        self.post_feedforward_layernorm = post_feedforward_layernorm
        self._attn_quant = getattr(self_attn, "input_quant", None)
        self._mlp_quant = getattr(mlp, "input_quant", None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                batch: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64, hidden [T, D], residual [T, D] or None (first layer) -> (hidden, residual)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, quant=self._attn_quant)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, quant=self._attn_quant)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, batch))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual, quant=self._mlp_quant)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


@register_model("Gemma2ForCausalLM")
class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 decoder-only LM (2B, 9B, 27B). See the module docstring for how it differs from Llama."""

    # online FP8 is what the tests run (tests/models/test_parity_gemma2.py); checkpoints quantized as
    # compressed-tensors or quark have not been tried
    supported_quantization = ("fp8",)

    def __init__(self, config: ModelConfig, **kwargs) -> None:
        if isinstance(config, ModelConfig) and config.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True (attention over the whole sequence, for embedding "
                             "models) is not supported: Gemma2ForCausalLM attends causally")
        super().__init__(config, **kwargs)
        self.final_logit_softcap = _softcap(config, "final_logit_softcapping")

    def _norm(self) -> RMSNorm:
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps, gemma=True, dtype=self.dtype)

    def make_layer(self, layer_idx: int) -> nn.Module:
        config = self.config
        tp = self.tp_args()
        self_attn = LlamaAttention(config, self.rotary_embedding(config.head_dim, config.layer_types[layer_idx]),
                                   sliding_window=self.sliding_window_of(layer_idx),
                                   scale=config.query_pre_attn_scalar ** -0.5,
                                   logit_softcap=_softcap(config, "attn_logit_softcapping"),
                                   **self.quant_args(f"model.layers.{layer_idx}.self_attn"), **tp)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation, bias=False,
                       **self.quant_args(f"model.layers.{layer_idx}.mlp"), **tp)
        return Gemma2DecoderLayer(self_attn, mlp, input_layernorm=self._norm(), post_attention_layernorm=self._norm(),
                                  pre_feedforward_layernorm=self._norm(), post_feedforward_layernorm=self._norm())

    def make_final_norm(self) -> nn.Module:
        return self._norm()

    def embed_scale(self) -> float:
        return self.config.hidden_size ** 0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] float32, soft-capped: ``c * tanh(logits / c)`` (c > 0)."""
        logits = super().compute_logits(hidden)
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits
