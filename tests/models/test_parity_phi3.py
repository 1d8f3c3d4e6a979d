"""Phi3ForCausalLM against transformers' Phi3ForCausalLM: Llama's decoder whose checkpoint stores q/k/v as one
``qkv_proj`` and gate/up as one ``gate_up_proj`` tensor; a window on every layer when ``sliding_window`` is set;
``partial_rotary_factor`` (Phi-4-mini) in ``rope_parameters``.

fp32 on CPU with the torch backend must match HF's logits within parity_harness.FP32_TOL at every position of
ragged prefills, decode steps (block sizes 1, 4, 16), prefill chunks and a prefix-cache resumption; the engine's
greedy tokens equal HF ``generate``. One case runs the Triton kernels in the interpreter; the GPU variant runs
every case in bf16 with the Triton backend.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from atom_core.ops.dispatch import backend_available  # noqa: E402
from tests.models.moe_parity import (  # noqa: E402
    DENSE_LAYER_OPS,
    assert_triton_served,
    check_bf16_triton_matches_hf_fp32,
    check_engine_greedy,
)
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    HFParityChecks,
    ParityCase,
    check_decode,
    check_parameter_names,
    parity_pair_fixture,
    single_thread_torch,
)

PHI3 = "Phi3ForCausalLM"
CASES = [
    ParityCase("gqa2", "phi3", PHI3, {"num_key_value_heads": 2}),
    ParityCase("mha_tied_sliding", "phi3", PHI3,
               {"num_key_value_heads": 4, "sliding_window": 5, "tie_word_embeddings": True}),
    ParityCase("partial_rotary_mqa", "phi3", PHI3,
               {"num_key_value_heads": 1,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}),
    # a file without the keys equal to Phi-3's defaults: ModelConfig must supply rms_norm_eps 1e-5
    ParityCase("defaults_eps", "phi3", PHI3, {"rms_norm_eps": 1e-5}, saved_without=("rms_norm_eps",)),
]

pair = parity_pair_fixture(CASES)


def test_parameter_names_mirror_hf(pair, model):
    check_parameter_names(pair, model)


def test_the_window_reaches_every_layer_and_nothing_has_a_bias(pair, model):
    window = pair.hf_model.config.sliding_window
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.qkv_proj.bias is None and attn.o_proj.bias is None
        assert attn.attn.sliding_window == window
    assert model.config.rms_norm_eps == pair.hf_model.config.rms_norm_eps


def test_longrope_is_refused_by_name(tmp_path):
    import json

    from atom_core.models import load_model
    from tests.models.parity_harness import build_pair

    case = ParityCase("longrope", "phi3", PHI3, {"max_position_embeddings": 256,
                                                 "original_max_position_embeddings": 128,
                                                 "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                                     "short_factor": [1.0] * 8,
                                                                     "long_factor": [2.0] * 8}})
    built = build_pair(case, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "longrope"
    with pytest.raises((ValueError, NotImplementedError), match="longrope"):
        load_model(built.path, dtype=torch.float32, device="cpu")


class TestHFParity(HFParityChecks):
    """Ragged prefill, paged decode, chunked prefill and prefix resumption against HF."""

    def test_engine_greedy_equals_hf_generate(self, pair):
        check_engine_greedy(pair, lengths=(9, 1, 14), max_tokens=8)


@pytest.mark.skipif(not backend_available("triton") or torch.cuda.is_available(),
                    reason="CPU interpreter case (the GPU variant below covers Triton on a GPU)")
def test_triton_backend_serves_every_op_and_matches_hf(pair, model):
    if pair.case.name != "gqa2":
        pytest.skip("one case is enough in the interpreter")

    def run():
        with ops.use_backend("triton"):
            check_decode(pair, model, 4, num_decode_steps=2, pad_rows=0)

    assert_triton_served(run, DENSE_LAYER_OPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_triton_serves_every_op_and_matches_hf_fp32(pair):
    check_bf16_triton_matches_hf_fp32(pair, DENSE_LAYER_OPS)
