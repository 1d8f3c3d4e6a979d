"""Reference twins: plain-torch definitions of every op, written for clarity. They are the spec.

Each group lives in its own module (``norm``, ``rope``, ``qk_norm_rope``, ``activation``, ``norm_quant``,
``kv_cache``, ``rope_kv``, ``attention``, ``sampling``, ``moe``); the most used twins are also importable from here.
"""

from atom_core.ops.reference.activation import gelu_and_mul, silu_and_mul, swiglu_clamped
from atom_core.ops.reference.attention import naive_attention, paged_attention
from atom_core.ops.reference.kv_cache import store_kv_
from atom_core.ops.reference.moe import fused_experts, gpt_oss_topk, grouped_topk, topk_softmax
from atom_core.ops.reference.norm import layer_norm, rms_norm
from atom_core.ops.reference.norm_quant import rms_norm_quant, silu_and_mul_quant
from atom_core.ops.reference.qk_norm_rope import qk_norm_rope_
from atom_core.ops.reference.rope import apply_rope_, rope_cos_sin_cache
from atom_core.ops.reference.rope_kv import rope_store_kv_
from atom_core.ops.reference.sampling import rejection_sample_greedy, sample

__all__ = [
    "apply_rope_",
    "fused_experts",
    "gelu_and_mul",
    "gpt_oss_topk",
    "grouped_topk",
    "layer_norm",
    "naive_attention",
    "paged_attention",
    "qk_norm_rope_",
    "rejection_sample_greedy",
    "rms_norm",
    "rms_norm_quant",
    "rope_cos_sin_cache",
    "rope_store_kv_",
    "sample",
    "silu_and_mul",
    "silu_and_mul_quant",
    "store_kv_",
    "swiglu_clamped",
    "topk_softmax",
]
