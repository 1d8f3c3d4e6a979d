"""Qwen3MoeForCausalLM against transformers' Qwen3MoeForCausalLM.

Tiny random configs vary the expert count and top-k, ``norm_topk_prob``, dense layers mixed in
(``mlp_only_layers``, ``decoder_sparse_step``), GQA with an explicit head_dim, tied embeddings
and sliding-window attention. HF saves the experts one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``), as the published checkpoints do. fp32 on CPU with the
torch backend must match HF's logits within parity_harness.FP32_TOL; one small case runs the
Triton kernels in the interpreter; the bf16 GPU runs
of these configs are in test_moe_gpu.py.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from atom_core.ops.dispatch import backend_available  # noqa: E402
from atom_core.models.layers.moe import FusedMoE  # noqa: E402
from atom_core.models.layers.mlp import GatedMLP  # noqa: E402
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    ParityCase,
    parity_pair_fixture,
    single_thread_torch,
)
from tests.models.moe_parity import (  # noqa: E402
    MoEParityChecks,
    build_moe_pair,
    check_triton_serves_every_op,
)

ARCH = "Qwen3MoeForCausalLM"
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "head_dim": 16}

CASES = [
    ParityCase("e8_k2_renorm", "qwen3_moe", ARCH, {**MOE, "norm_topk_prob": True}),
    # Layer 0 dense (mlp_only_layers), layers 1..2 sparse; top-3 of 6 without renormalisation; tied head.
    ParityCase("dense_layer_k3_tied", "qwen3_moe", ARCH,
               {**MOE, "num_experts": 6, "num_experts_per_tok": 3, "num_hidden_layers": 3, "mlp_only_layers": [0],
                "tie_word_embeddings": True, "norm_topk_prob": False}),
    # decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense; every layer slides over 5 positions.
    ParityCase("sparse_step2_sliding", "qwen3_moe", ARCH,
               {**MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2, "num_key_value_heads": 1,
                "use_sliding_window": True, "sliding_window": 5, "norm_topk_prob": True}),
]



pair = parity_pair_fixture(CASES, build_moe_pair)


class TestHFParity(MoEParityChecks):
    """Parameter names, ragged prefill, paged decode, chunked prefill and prefix resumption against HF."""


def test_dense_and_sparse_layers_where_hf_has_them(pair, model):
    """Each layer's MLP kind matches HF's (else a case meant to mix them would test nothing)."""
    for hf_layer, layer in zip(pair.hf_model.model.layers, model.model.layers):
        hf_sparse = hasattr(hf_layer.mlp, "experts")
        assert isinstance(getattr(layer.mlp, "experts", None), FusedMoE) == hf_sparse
        assert isinstance(layer.mlp, GatedMLP) == (not hf_sparse)


def test_sliding_window_reaches_every_layer(tmp_path):
    pair = build_moe_pair(CASES[-1], tmp_path)
    windows = [layer.self_attn.attn.sliding_window for layer in pair.load_atom().model.layers]
    assert windows == [5, 5, 5, 5]


def test_experts_are_routed_differently_per_token(pair):
    """The tiny models really route: tokens of one prompt pick different experts (HF's own router)."""
    hf_layer = next(l for l in pair.hf_model.model.layers if hasattr(l.mlp, "experts"))
    hidden = torch.randn(32, pair.hf_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, _, ids = hf_layer.mlp.gate(hidden)
    assert len(set(ids[:, 0].tolist())) > 1


@pytest.mark.skipif(not backend_available("triton") or torch.cuda.is_available(),
                    reason="CPU interpreter case (the GPU variant covers Triton on a GPU)")
def test_triton_backend_matches_hf_small(tmp_path):
    """Routing and grouped expert GEMMs through the Triton kernels (interpreter): a two-row prefill,
    a mixed step and a decode step of the first case, every op served by Triton."""
    pair = build_moe_pair(CASES[0], tmp_path)
    check_triton_serves_every_op(pair, "topk_softmax")
