"""MixtralForCausalLM against transformers' MixtralForCausalLM.

Tiny random configs vary the expert count and top-k (the weights of the K chosen experts always
renormalised), GQA / MQA, odd sizes, tied embeddings and the every-layer sliding window. HF saves
the checkpoint as Mixtral's published files are laid out (``block_sparse_moe.experts.{e}.w1/w2/w3``).
fp32 on CPU with the torch backend must match HF's logits within parity_harness.FP32_TOL; the
bf16 GPU runs of these configs are in test_moe_gpu.py.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.models.moe_parity import (  # noqa: E402
    MoEParityChecks,
    build_moe_pair,
    checkpoint_tensor_names,
)
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    ParityCase,
    parity_pair_fixture,
    single_thread_torch,
)

ARCH = "MixtralForCausalLM"

CASES = [
    ParityCase("e4_k2_gqa", "mixtral", ARCH,
               {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48, "head_dim": 16}),
    # MQA, hidden 48 / intermediate 100 / head_dim 24, top-3 of 5 experts, tied head.
    ParityCase("mqa_odd_sizes_k3_tied", "mixtral", ARCH,
               {"hidden_size": 48, "intermediate_size": 100, "num_key_value_heads": 1, "head_dim": 24,
                "num_local_experts": 5, "num_experts_per_tok": 3, "tie_word_embeddings": True}),
    # Every layer attends over the last 5 positions.
    ParityCase("sliding_window", "mixtral", ARCH,
               {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "head_dim": 16,
                "sliding_window": 5}),
]



pair = parity_pair_fixture(CASES, build_moe_pair)


class TestHFParity(MoEParityChecks):
    """Parameter names, ragged prefill, paged decode, chunked prefill and prefix resumption against HF."""


def test_sliding_window_reaches_every_layer(pair, model):
    expected = pair.case.overrides.get("sliding_window")
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [expected, expected]


def test_checkpoint_uses_block_sparse_moe_names(pair):
    """The saved files carry Mixtral's published names, so loading them exercises the renaming."""
    names = checkpoint_tensor_names(pair.path)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names
    assert not any(".mlp." in n for n in names)
