"""Glm4MoeForCausalLM against transformers' Glm4MoeForCausalLM.

Tiny random configs vary the routing (groups kept of groups, top-k, renormalisation, the scaling
factor, a random ``e_score_correction_bias``), shared experts, dense layers before
``first_k_dense_replace``, attention biases, the optional QK norm, partial RoPE and tied
embeddings. fp32 on CPU with the torch backend must match HF's logits within
parity_harness.FP32_TOL; the bf16 GPU runs of these
configs are in test_moe_gpu.py.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from atom_core.models.layers.mlp import GatedMLP  # noqa: E402
from tests.models.moe_parity import (  # noqa: E402
    MoEParityChecks,
    build_moe_pair,
)
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    ParityCase,
    parity_pair_fixture,
    single_thread_torch,
)

ARCH = "Glm4MoeForCausalLM"
MOE = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "head_dim": 16,
       "n_shared_experts": 1, "first_k_dense_replace": 1}

CASES = [
    # Layer 0 dense, layer 1 sparse; 2 groups of 4, 1 kept; scaling 2.5; q/k/v biases; RoPE on half of Dh.
    ParityCase("groups2_bias_scaled", "glm4_moe", ARCH,
               {**MOE, "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                "attention_bias": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    # Every layer sparse, QK norm, two shared experts, no renormalisation, RoPE on a quarter of Dh = 32, tied.
    ParityCase("qk_norm_all_sparse_tied", "glm4_moe", ARCH,
               {**MOE, "first_k_dense_replace": 0, "n_shared_experts": 2, "use_qk_norm": True, "head_dim": 32,
                "norm_topk_prob": False, "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}),
    # 16 experts in 4 groups, 2 kept, top-4; 3 layers (first dense); MQA.
    ParityCase("e16_groups4_k4", "glm4_moe", ARCH,
               {**MOE, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                "num_hidden_layers": 3, "num_key_value_heads": 1, "routed_scaling_factor": 1.5}),
]



pair = parity_pair_fixture(CASES, build_moe_pair)


class TestHFParity(MoEParityChecks):
    """Parameter names, ragged prefill, paged decode, chunked prefill and prefix resumption against HF."""


def test_structure_follows_the_config(pair, model):
    """Dense layers, partial rotary dims and the correction bias are really there (else the parity is vacuous)."""
    hf_config = pair.hf_model.config
    first_sparse = hf_config.first_k_dense_replace
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp, GatedMLP) == (i < first_sparse)
        rotary = layer.self_attn.rotary_emb
        factor = hf_config.rope_parameters["partial_rotary_factor"]
        assert rotary.rotary_dim == int(hf_config.head_dim * factor) < rotary.head_dim
    bias = model.model.layers[first_sparse].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0  # loaded from the checkpoint, randomised by build_moe_pair
