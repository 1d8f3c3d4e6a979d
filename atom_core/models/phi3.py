"""Phi-3 (``Phi3ForCausalLM``): Llama's decoder with q/k/v and gate/up stored fused in the checkpoint.

Legend: T = tokens, D = hidden size, H / Hk = query / KV heads on this rank, Dh = head dim, I = intermediate.

transformers' ``modeling_phi3.py`` differs from Llama only in its parameter layout and config:

- ``self_attn.qkv_proj`` is one ``[(H + 2 Hk) Dh, D]`` tensor in the checkpoint (q rows, then k, then v),
  ``mlp.gate_up_proj`` one ``[2 I, D]`` tensor (gate rows, then up; ``up * act(gate)``). atom_core's
  ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` keep the same order, so the checkpoint tensors load
  whole (``shard_id=None``) and each rank cuts out its heads / columns.
- no biases anywhere (Phi-3 has no ``attention_bias`` / ``mlp_bias`` keys);
- ``sliding_window`` (when not null) applies to every layer, as Mistral's;
- ``partial_rotary_factor`` in ``rope_parameters``; ``longrope`` scaling (Phi-3-mini-128k, Phi-3.5-mini,
  Phi-4-mini): the long factors for the whole rotary table when ``max_position_embeddings`` passes
  ``original_max_position_embeddings``, else the short ones (vLLM's choice; transformers picks per forward,
  ``ops.rope_cos_sin_cache``); ``ModelConfig`` reads Phi-3's older names ``su`` / ``yarn`` as longrope and its
  top-level ``original_max_position_embeddings`` (default 4096), as ``Phi3Config`` does.

Parameter names are HF's, unchanged::

    model.embed_tokens.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.qkv_proj.weight
    model.layers.{i}.self_attn.o_proj.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.gate_up_proj.weight
    model.layers.{i}.mlp.down_proj.weight
    model.norm.weight
    lm_head.weight
"""

from __future__ import annotations

from atom_core.models.llama import LlamaForCausalLM
from atom_core.models.registry import register_model


@register_model("Phi3ForCausalLM")
class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5-mini and Phi-4-mini. Llama's layers and ``packed_modules_mapping``; the checkpoint's
    fused tensors load whole under their own names."""

    partial_rotary = True  # transformers' model rotates head_dim * partial_rotary_factor dims
