"""Qwen3 (``Qwen3ForCausalLM``): Llama's layout plus a per-head RMSNorm on q and k before RoPE.

Legend: T = tokens, H / Hk = query / KV heads on this rank, Dh = head dim.

Differences from ``llama.py``, all in the attention block:

- ``self_attn.q_norm`` and ``self_attn.k_norm``: RMSNorm over each head's Dh values (weight
  ``[Dh]``, shared by all heads), applied to q and k after the projection, before RoPE;
- ``head_dim`` is explicit in every Qwen3 config (e.g. 128 with hidden 1024 and 16 heads);
- ``attention_bias`` adds biases to q, k, v and o (off in the released checkpoints);
- sliding-window layers come from ``use_sliding_window`` / ``max_window_layers`` (or an explicit
  ``layer_types``), normalised by ``ModelConfig``.

Small Qwen3 checkpoints tie ``lm_head`` to ``embed_tokens`` (``tie_word_embeddings``).
Parameter names are Llama's plus ``model.layers.{i}.self_attn.{q,k}_norm.weight``.
"""

from __future__ import annotations

import torch

from atom_core.models.config import ModelConfig
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.layers.rotary import RotaryEmbedding
from atom_core.models.llama import LlamaAttention, LlamaForCausalLM
from atom_core.models.registry import register_model


class Qwen3Attention(LlamaAttention):
    """``LlamaAttention`` with ``q_norm`` / ``k_norm`` (RMSNorm over Dh, per head) before RoPE."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, *, sliding_window: int | None,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, quant_config=None,
                 prefix: str = "", tp_group=None) -> None:
        super().__init__(config, rotary_emb, sliding_window=sliding_window, dtype=dtype, tp_rank=tp_rank,
                         tp_size=tp_size, quant_config=quant_config, prefix=prefix, tp_group=tp_group)
        self.set_qk_norms(RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype),
                          RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype))


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense decoder-only LM (0.6B-32B)."""

    attention_cls = Qwen3Attention
