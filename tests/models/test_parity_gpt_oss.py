"""GptOssForCausalLM against transformers' GptOssForCausalLM.

Tiny random configs vary the expert count and top-k, sliding-window layers (``layer_types``),
yarn RoPE (``truncate: false`` as released), GQA / MQA / MHA, odd intermediate sizes and tied
embeddings; every case has attention sinks, q/k/v/o biases, a biased router and expert biases,
all randomised. The checkpoint holds the stacked, transposed, gate/up-interleaved expert tensors
GPT-OSS ships. fp32 on CPU with the torch backend must match HF's logits within
parity_harness.FP32_TOL; one small case runs the Triton kernels in the interpreter; the bf16
GPU runs of these configs are in test_moe_gpu.py.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from atom_core.ops.dispatch import backend_available  # noqa: E402
from tests.models.moe_parity import (  # noqa: E402
    MoEParityChecks,
    build_moe_pair,
    check_triton_serves_every_op,
)
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    ParityCase,
    parity_pair_fixture,
    single_thread_torch,
)

ARCH = "GptOssForCausalLM"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0}

CASES = [
    # Released layout: layer 0 slides (window 5), layer 1 full; yarn RoPE.
    ParityCase("e4_k2_yarn_sliding", "gpt_oss", ARCH,
               {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "head_dim": 16,
                "sliding_window": 5, "rope_parameters": YARN}),
    # MQA; full, then two sliding layers (window 3); top-4 of 8.
    ParityCase("mqa_e8_k4_window3", "gpt_oss", ARCH,
               {"num_local_experts": 8, "num_experts_per_tok": 4, "intermediate_size": 24, "head_dim": 16,
                "num_key_value_heads": 1, "num_hidden_layers": 3, "sliding_window": 3,
                "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}),
    # MHA with head_dim 24 != hidden / heads, intermediate 20, tied head, no sliding layers.
    ParityCase("mha_odd_tied", "gpt_oss", ARCH,
               {"num_local_experts": 3, "num_experts_per_tok": 2, "intermediate_size": 20, "head_dim": 24,
                "num_key_value_heads": 4, "tie_word_embeddings": True,
                "layer_types": ["full_attention", "full_attention"]}),
]



pair = parity_pair_fixture(CASES, build_moe_pair)


class TestHFParity(MoEParityChecks):
    """Parameter names, ragged prefill, paged decode, chunked prefill and prefix resumption against HF."""


def test_windows_and_sinks_reach_the_layers(pair, model):
    """Sliding layers get the window, the others none; sinks are the checkpoint's (else the parity is vacuous)."""
    hf_config = pair.hf_model.config
    for i, (hf_layer, layer) in enumerate(zip(pair.hf_model.model.layers, model.model.layers)):
        sliding = hf_config.layer_types[i] == "sliding_attention"
        assert layer.self_attn.attn.sliding_window == (hf_config.sliding_window if sliding else None)
        torch.testing.assert_close(layer.self_attn.sinks, hf_layer.self_attn.sinks.float(), rtol=0, atol=0)
        assert layer.self_attn.sinks.abs().max() > 0


def test_expert_weights_are_hf_transposed_with_gate_up_interleaved(pair, model):
    """w13 row 2j is HF's gate column j (``gate_up_proj[..., ::2]``), row 2j + 1 its up column j."""
    hf_experts = pair.hf_model.model.layers[0].mlp.experts
    experts = model.model.layers[0].mlp.experts
    gate_cols = hf_experts.gate_up_proj[:, :, 0::2]                         # [E, H, I]
    up_cols = hf_experts.gate_up_proj[:, :, 1::2]
    assert torch.equal(experts.w13_weight[:, 0::2, :], gate_cols.transpose(1, 2))
    assert torch.equal(experts.w13_weight[:, 1::2, :], up_cols.transpose(1, 2))
    assert torch.equal(experts.w2_weight, hf_experts.down_proj.transpose(1, 2))
    assert torch.equal(experts.w13_bias, hf_experts.gate_up_proj_bias)


def test_moe_block_matches_hf_where_the_clamp_bites(pair, model):
    """Inputs 8x larger than a normed hidden state push gate/up past the clamp at 7 (checked on HF's
    side); the MoE block still matches HF's GptOssMLP."""
    hidden_size = pair.hf_model.config.hidden_size
    x = 8.0 * torch.randn(24, hidden_size, generator=torch.Generator().manual_seed(5))
    hf_mlp = pair.hf_model.model.layers[0].mlp
    with torch.no_grad():
        gate_up = torch.einsum("th,ehi->tei", x, hf_mlp.experts.gate_up_proj) + hf_mlp.experts.gate_up_proj_bias
        assert (gate_up[..., 0::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()
        expected, _ = hf_mlp(x[None])
        with ops.use_backend("torch"):
            actual = model.model.layers[0].mlp(x)
    torch.testing.assert_close(actual, expected[0], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not backend_available("triton") or torch.cuda.is_available(),
                    reason="CPU interpreter case (the GPU variant covers Triton on a GPU)")
def test_triton_backend_matches_hf_small(tmp_path):
    """Sinks, the biased top-K and the clamped interleaved experts through the Triton kernels
    (interpreter): a two-row prefill, a mixed step and a decode step, every op served by Triton."""
    pair = build_moe_pair(CASES[0], tmp_path)
    check_triton_serves_every_op(pair, "gpt_oss_topk")
