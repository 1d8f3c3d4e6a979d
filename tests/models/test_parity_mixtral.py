"""MixtralForCausalLM against transformers' MixtralForCausalLM.

Tiny random configs vary the expert count and top-k (the weights of the K chosen experts always
renormalised), GQA / MQA, odd sizes, tied embeddings and the every-layer sliding window. HF saves
the checkpoint as Mixtral's published files are laid out (``block_sparse_moe.experts.{e}.w1/w2/w3``).
fp32 on CPU with the torch backend must match HF's logits within parity_harness.FP32_TOL; the GPU
variant runs bf16 with the Triton backend on the same configs with every expert chosen
(``moe_parity.every_expert_case`` says why).
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from tests.models.moe_parity import (  # noqa: E402
    MoEParityChecks,
    build_moe_pair,
    check_engine_greedy,
    checkpoint_tensor_names,
    every_expert_case,
)
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    BF16_ARGMAX_MARGIN,
    BF16_TOL,
    ParityCase,
    parity_pair_fixture,
    run_all_checks,
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


# bf16 on a GPU: the same configs with every expert chosen (see moe_parity.every_expert_case).
GPU_CASES = [every_expert_case(c) for c in CASES]


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


def test_engine_greedy_equals_hf_generate(pair):
    check_engine_greedy(pair)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.name for c in GPU_CASES])
def test_gpu_bf16_triton_matches_hf_fp32(case, tmp_path):
    pair = build_moe_pair(case, tmp_path)
    model = pair.load_atom(dtype=torch.bfloat16, device="cuda")
    with ops.use_backend("triton"):
        run_all_checks(pair, model, device="cuda", tol=BF16_TOL, argmax_margin=BF16_ARGMAX_MARGIN)
