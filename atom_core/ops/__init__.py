"""Functional ops: tensors in, tensors out. Each has a reference twin (``atom_core.ops.reference``),
a Triton kernel and an AITER adapter, and is registered as ``torch.ops.atom_core.<name>``.

Backend choice: ``backend=`` argument > ``use_backend()`` context > the default backend
(``ATOM_CORE_BACKEND``, read once at import; ``set_default_backend()`` changes it) > auto (aiter on
ROCm where ``python -m atom_core.ops.selftest`` verified it, triton on a GPU unless the selftest
failed it, then scaled_mm (``torch._scaled_mm``, the scaled GEMMs only) on a GPU, torch otherwise),
made once per op and argument signature and cached.
Argument checks run in debug mode only: ``ATOM_CORE_DEBUG=1``, ``set_debug(True)`` or
``with debug_checks(): ...``. See docs/ops.md.
"""

from atom_core.ops import reference
from atom_core.ops.activation import gelu_and_mul, silu_and_mul, swiglu_clamped
from atom_core.ops.attention import paged_attention, paged_attention_from_layout
from atom_core.ops.comm import all_gather, all_reduce, all_to_all
from atom_core.ops.dispatch import (
    BackendUnavailable,
    available_backends,
    backend_available,
    default_backend,
    preferred_backend,
    set_default_backend,
    trace_backends,
    use_backend,
)
from atom_core.ops.dsa import indexer_topk, mla_sparse_attention, store_indexer_k_
from atom_core.ops.fused_moe import fused_experts, fused_experts_quant
from atom_core.ops.kv_cache import store_kv_
from atom_core.ops.mla import mla_decode_attention, mla_prefill_attention, store_mla_
from atom_core.ops.moe_routing import gpt_oss_topk, grouped_topk, topk_softmax
from atom_core.ops.norm import layer_norm, rms_norm
from atom_core.ops.norm_quant import rms_norm_quant, silu_and_mul_quant
from atom_core.ops.penalties import apply_penalties_, apply_token_bias_
from atom_core.ops.qk_norm_rope import qk_norm_rope_
from atom_core.ops.quant import per_group_quant, per_tensor_quant, per_token_quant
from atom_core.ops.rope import apply_rope_, rope_cos_sin_cache, yarn_softmax_scale
from atom_core.ops.rope_kv import rope_store_kv_
from atom_core.ops.sampling import rejection_sample_greedy, sample
from atom_core.ops.scaled_mm import scaled_mm_block, scaled_mm_per_tensor, scaled_mm_per_token
from atom_core.ops.token_mask import apply_token_mask_
from atom_core.ops.validation import debug_checks, debug_enabled, set_debug

__all__ = [
    "BackendUnavailable",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "apply_penalties_",
    "apply_rope_",
    "apply_token_bias_",
    "apply_token_mask_",
    "available_backends",
    "backend_available",
    "debug_checks",
    "debug_enabled",
    "default_backend",
    "fused_experts",
    "fused_experts_quant",
    "gelu_and_mul",
    "gpt_oss_topk",
    "grouped_topk",
    "indexer_topk",
    "layer_norm",
    "mla_decode_attention",
    "mla_prefill_attention",
    "mla_sparse_attention",
    "paged_attention",
    "paged_attention_from_layout",
    "per_group_quant",
    "per_tensor_quant",
    "per_token_quant",
    "preferred_backend",
    "qk_norm_rope_",
    "reference",
    "rejection_sample_greedy",
    "rms_norm",
    "rms_norm_quant",
    "rope_cos_sin_cache",
    "rope_store_kv_",
    "sample",
    "scaled_mm_block",
    "scaled_mm_per_tensor",
    "scaled_mm_per_token",
    "set_debug",
    "set_default_backend",
    "silu_and_mul",
    "silu_and_mul_quant",
    "store_indexer_k_",
    "store_kv_",
    "store_mla_",
    "swiglu_clamped",
    "topk_softmax",
    "trace_backends",
    "use_backend",
    "yarn_softmax_scale",
]
