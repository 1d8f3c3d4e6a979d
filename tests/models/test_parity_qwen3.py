"""Qwen3ForCausalLM against transformers' Qwen3ForCausalLM.

Tiny random configs vary the GQA ratio, head_dim (always explicit in Qwen3, here != hidden /
heads), tied embeddings, attention biases, yarn RoPE and sliding-window layers
(``use_sliding_window`` + ``max_window_layers``). fp32 on CPU with the torch backend must match
HF's logits within parity_harness.FP32_TOL; the GPU variant runs bf16 with the Triton backend.
(The Triton interpreter case of the shared kernels lives in test_parity_llama.py; the one here covers
the per-head q/k norms, which run fused with RoPE in ``ops.qk_norm_rope_``.)
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from atom_core.models.layers.norm import RMSNorm  # noqa: E402
from atom_core.ops.dispatch import backend_available  # noqa: E402
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    BF16_ARGMAX_MARGIN,
    BF16_TOL,
    HFParityChecks,
    ParityCase,
    backends_used,
    build_pair,
    check_decode,
    check_parameter_names,
    parity_pair_fixture,
    run_all_checks,
    single_thread_torch,
)

QWEN3 = "Qwen3ForCausalLM"

CASES = [
    ParityCase("gqa2_head_dim32", "qwen3", QWEN3,
               {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}),
    ParityCase("mha_tied", "qwen3", QWEN3,
               {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "tie_word_embeddings": True}),
    ParityCase("mqa_odd_sizes", "qwen3", QWEN3,
               {"hidden_size": 48, "intermediate_size": 100, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 24}),
    ParityCase("gqa4_bias_yarn", "qwen3", QWEN3,
               {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": True,
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                    "rope_theta": 1000000.0}}),
    # Layer 0 full attention, layer 1 a window of 5 (layers >= max_window_layers slide).
    ParityCase("sliding_window", "qwen3", QWEN3,
               {"head_dim": 16, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
]


pair = parity_pair_fixture(CASES)


def test_parameter_names_mirror_hf(pair, model):
    check_parameter_names(pair, model)


class TestHFParity(HFParityChecks):
    """Ragged prefill, paged decode, chunked prefill and prefix resumption against HF."""


def test_sliding_window_reaches_the_layers(tmp_path):
    """The config's sliding layers get the window, the others none (else the parity above is vacuous)."""
    pair = build_pair(CASES[-1], tmp_path)
    model = pair.load_atom()
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [None, 5]


def test_tied_head_shares_the_embedding(tmp_path):
    pair = build_pair(CASES[1], tmp_path)
    model = pair.load_atom()
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.skipif(not backend_available("triton") or torch.cuda.is_available(),
                    reason="CPU interpreter case (the GPU variant below covers Triton on a GPU)")
def test_qk_norms_and_rope_run_as_one_triton_op_and_match_hf_small(tmp_path):
    pair = build_pair(CASES[2], tmp_path)  # MQA, head_dim 24: odd sizes for the kernel
    model = pair.load_atom()

    def run():
        with ops.use_backend("triton"):
            check_decode(pair, model, 4, num_decode_steps=2, pad_rows=0)

    used = backends_used(run)
    assert ("qk_norm_rope_", "triton") in used
    assert "apply_rope_" not in {op for op, _ in used}  # the norms and the rotation: one op


def test_set_qk_norms_refuses_norms_the_fused_op_cannot_run(tmp_path):
    attn = build_pair(CASES[0], tmp_path).load_atom().model.layers[0].self_attn
    head_dim = attn.head_dim
    with pytest.raises(ValueError, match="must share one eps"):
        attn.set_qk_norms(RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-5))
    with pytest.raises(ValueError, match="k_norm must be a non-gemma RMSNorm over head_dim=32"):
        attn.set_qk_norms(RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6, gemma=True))
    with pytest.raises(ValueError, match="q_norm must be a non-gemma RMSNorm over head_dim=32"):
        attn.set_qk_norms(RMSNorm(2 * head_dim, 1e-6), RMSNorm(head_dim, 1e-6))
    assert [name for name, _ in attn.named_parameters() if "norm" in name] == ["q_norm.weight", "k_norm.weight"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_triton_serves_every_op_and_matches_hf_fp32(pair):
    model = pair.load_atom(dtype=torch.bfloat16, device="cuda")

    def run():
        with ops.use_backend("triton"):  # a preference: a case Triton cannot serve would fall back silently
            run_all_checks(pair, model, device="cuda", tol=BF16_TOL, argmax_margin=BF16_ARGMAX_MARGIN)

    used = backends_used(run)
    not_triton = sorted((op, backend) for op, backend in used if backend != "triton")
    assert not not_triton, f"ops not served by triton: {not_triton}"
    assert {"paged_attention", "store_kv_", "qk_norm_rope_", "rms_norm", "silu_and_mul"} <= {op for op, _ in used}
