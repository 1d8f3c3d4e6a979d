"""Qwen2 (``Qwen2ForCausalLM``: Qwen2, Qwen2.5 and their Coder / Math variants): Llama's layout with a bias
on the q, k and v projections and none on o.

Sliding-window layers come from ``use_sliding_window`` / ``max_window_layers`` (or an explicit
``layer_types``), normalised by ``ModelConfig``; the released checkpoints turn the window off.
Parameter names are Llama's plus ``model.layers.{i}.self_attn.qkv_proj.bias`` (the checkpoint's
``q_proj.bias``, ``k_proj.bias``, ``v_proj.bias``). This file is the worked example of docs/models.md
("Adding an architecture").
"""

from __future__ import annotations

from atom_core.models.llama import LlamaAttention, LlamaForCausalLM
from atom_core.models.registry import register_model


class Qwen2Attention(LlamaAttention):
    """Bias on q, k, v; none on o."""

    def __init__(self, config, rotary_emb, *, sliding_window, dtype, tp_rank=0, tp_size=1, tp_group=None,
                 quant_config=None, prefix=""):
        super().__init__(config, rotary_emb, sliding_window=sliding_window, dtype=dtype, tp_rank=tp_rank,
                         tp_size=tp_size, tp_group=tp_group, qkv_bias=True, o_bias=False,
                         quant_config=quant_config, prefix=prefix)


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 dense decoder-only LM (0.5B-72B)."""

    attention_cls = Qwen2Attention
