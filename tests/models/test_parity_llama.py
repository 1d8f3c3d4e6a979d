"""LlamaForCausalLM against transformers' LlamaForCausalLM (and MinistralForCausalLM for sliding windows).

Each case is a tiny random model; fp32 on CPU with the torch backend must match HF's logits
within parity_harness.FP32_TOL at every position of ragged prefills, decode steps (block sizes
1, 4, 16), prefill chunks and a prefix-cache resumption. One small case runs the Triton
kernels in the interpreter; the GPU variant runs every case in bf16 with the Triton backend.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hypothesis import given, settings, strategies as st  # noqa: E402

from atom_core import ops  # noqa: E402
from atom_core.ops.dispatch import backend_available  # noqa: E402
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    BF16_ARGMAX_MARGIN,
    BF16_TOL,
    HFParityChecks,
    PagedRunner,
    ParityCase,
    assert_logits_match,
    backends_used,
    build_pair,
    check_decode,
    check_parameter_names,
    parity_pair_fixture,
    random_tokens,
    run_all_checks,
    single_thread_torch,
)

LLAMA = "LlamaForCausalLM"
ROPE = {"rope_theta": 10000.0}

CASES = [
    ParityCase("mha", "llama", LLAMA, {"num_attention_heads": 4, "num_key_value_heads": 4}),
    ParityCase("gqa2", "llama", LLAMA, {"num_attention_heads": 4, "num_key_value_heads": 2}),
    # hidden 48 over 8 heads would give head_dim 6; the config says 12.
    ParityCase("gqa4_odd_sizes_head_dim", "llama", LLAMA,
               {"hidden_size": 48, "intermediate_size": 100, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 12}),
    ParityCase("mqa_tied", "llama", LLAMA,
               {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True}),
    ParityCase("llama3_rope_biases", "llama", LLAMA,
               {"attention_bias": True, "mlp_bias": True,
                "rope_parameters": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                    "rope_theta": 500000.0}}),
    ParityCase("linear_rope", "llama", LLAMA, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, **ROPE}}),
    ParityCase("yarn_rope", "llama", LLAMA,
               {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                    "beta_fast": 32.0, "beta_slow": 1.0, **ROPE}}),
    # Ministral is Llama with per-layer sliding windows; saved, it loads as LlamaForCausalLM.
    ParityCase("sliding_window_layers", "ministral", LLAMA,
               {"head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
]


pair = parity_pair_fixture(CASES)


def test_parameter_names_mirror_hf(pair, model):
    check_parameter_names(pair, model)


class TestHFParity(HFParityChecks):
    """Ragged prefill, paged decode, chunked prefill and prefix resumption against HF."""


# ---- contract details, on one case --------------------------------------------------------------

@pytest.fixture(scope="module")
def gqa_pair(tmp_path_factory):
    return build_pair(CASES[1], tmp_path_factory.mktemp("gqa_single"))


@pytest.fixture(scope="module")
def gqa_model(gqa_pair):
    return gqa_pair.load_atom()


def test_kv_cache_spec_follows_config(gqa_pair):
    model = gqa_pair.load_atom()
    spec = model.kv_cache_spec()
    # BASE_CONFIG: 2 layers, 2 KV heads, head_dim = 64 hidden / 4 heads = 16.
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (2, 2, 16, torch.float32)


def test_forward_without_a_bound_pool_raises(gqa_pair):
    from atom_core.cache import build_step_layout

    model = gqa_pair.load_atom()
    layout = build_step_layout([3], [0], [[0]], 4)
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        model(torch.tensor([1, 2, 3]), layout.positions, layout)


def test_bind_kv_cache_checks_its_argument(gqa_pair):
    model = gqa_pair.load_atom()
    good = torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="2 attention layers"):
        model.bind_kv_cache([(good, good)])
    with pytest.raises(ValueError, match="k_cache must have shape"):
        model.bind_kv_cache([(torch.zeros(4, 4, 3, 16), good)] * 2)


def test_compute_logits_is_float32(gqa_pair):
    model = gqa_pair.load_atom(dtype=torch.bfloat16)
    logits = model.compute_logits(torch.randn(3, 64, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32 and logits.shape == (3, 101)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_any_chunk_schedule_and_block_size_matches_hf(gqa_pair, gqa_model, data):
    """Property: a prompt fed in any chunking, with any block size, gives HF's logits."""
    length = data.draw(st.integers(1, 20), label="prompt length")
    block_size = data.draw(st.sampled_from([1, 2, 3, 5, 8, 16]), label="block_size")
    cuts = sorted(data.draw(st.sets(st.integers(1, length - 1), max_size=4), label="cuts")) if length > 1 else []
    bounds = [0, *cuts, length]
    prompt = random_tokens(length, 101, seed=length)
    runner = PagedRunner(gqa_model, block_size=block_size, num_blocks=2 * (length // block_size + 2), seed=block_size)
    with ops.use_backend("torch"):
        outs = [runner.step([("s", prompt[a:b])])[0] for a, b in zip(bounds, bounds[1:])]
    assert_logits_match(torch.cat(outs), gqa_pair.hf_logits(prompt), f"chunks at {cuts}, block_size {block_size}")


# ---- Triton kernels in the CPU interpreter (small), and on a GPU -------------------------------

@pytest.mark.skipif(not backend_available("triton") or torch.cuda.is_available(),
                    reason="CPU interpreter case (the GPU variants below cover Triton on a GPU)")
def test_triton_backend_matches_hf_small(gqa_pair, gqa_model):
    model = gqa_model

    def run():
        # Steps: a two-row prefill, a mixed step (two decode rows and a prefill row), a pure decode step.
        with ops.use_backend("triton"):
            check_decode(gqa_pair, model, 4, num_decode_steps=2, pad_rows=0)

    used = backends_used(run)
    not_triton = sorted(op for op, backend in used if backend != "triton")
    assert not not_triton, f"ops not served by triton: {not_triton} (all: {sorted(used)})"
    names = {op for op, _ in used}
    assert {"paged_attention", "rope_store_kv_", "rms_norm", "silu_and_mul"} <= names
    assert not {"apply_rope_", "store_kv_"} & names  # the rotation and the store: one op


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
    names = {op for op, _ in used}
    assert {"paged_attention", "rope_store_kv_", "rms_norm", "silu_and_mul"} <= names
    assert not {"apply_rope_", "store_kv_"} & names  # the rotation and the store: one op
