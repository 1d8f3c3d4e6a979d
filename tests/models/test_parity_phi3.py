"""Phi3ForCausalLM against transformers' Phi3ForCausalLM: Llama's decoder whose checkpoint stores q/k/v as one
``qkv_proj`` and gate/up as one ``gate_up_proj`` tensor; a window on every layer when ``sliding_window`` is set;
``partial_rotary_factor`` (Phi-4-mini) in ``rope_parameters``.

fp32 on CPU with the torch backend must match HF's logits within parity_harness.FP32_TOL at every position of
ragged prefills, decode steps (block sizes 1, 4, 16), prefill chunks and a prefix-cache resumption; the engine's
greedy tokens equal HF ``generate``. One case runs the Triton kernels in the interpreter; the GPU variant runs
every case in bf16 with the Triton backend.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from atom_core.models import ModelConfig, build_model  # noqa: E402
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
    build_pair,
    check_chunked_and_prefix,
    check_decode,
    check_parameter_names,
    check_ragged_prefill,
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
    # longrope whose table is no longer than the pretraining length: the short factors at every position (as
    # transformers for every sequence up to it), an explicit attention factor, Phi-4-mini's partial rotary
    ParityCase("longrope_short_partial", "phi3", PHI3,
               {"original_max_position_embeddings": 128,
                "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0], "attention_factor": 1.25}}),
]
# longrope past the pretraining length (6 of 128 positions): the long factors, the default attention factor
LONGROPE_LONG = ParityCase("longrope_long", "phi3", PHI3,
                           {"original_max_position_embeddings": 6,
                            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0],
                                                "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}})

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


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """LONGROPE_LONG's checkpoint: its table (128 rows) is longer than the pretraining length (6), so every
    position takes the long factors; transformers takes them for a forward whose longest position passes 6."""
    return build_pair(LONGROPE_LONG, tmp_path_factory.mktemp("longrope_long"))


def test_longrope_past_the_pretraining_length_matches_hf_on_sequences_longer_than_it(long_pair):
    """Every sequence here is longer than 6 tokens, where transformers' choice (per forward) and the table's
    (once) agree: prefill, decode at three block sizes, chunked prefill, a prefix hit and the engine."""
    model = long_pair.load_atom()
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert rotary.attention_scale == pytest.approx(math.sqrt(1 + math.log(128 / 6) / math.log(6)))
    with ops.use_backend("torch"):
        check_ragged_prefill(long_pair, model, lengths=(7, 13, 9))
        for block_size in (1, 4, 16):
            check_decode(long_pair, model, block_size)
        check_chunked_and_prefix(long_pair, model)
    check_engine_greedy(long_pair, lengths=(9, 14), max_tokens=6)


def test_longrope_factors_of_the_wrong_length_or_with_mscales_are_refused_by_name(tmp_path):
    config = json.loads((build_pair(LONGROPE_LONG, tmp_path / "ok").path / "config.json").read_text())
    for edit, message in (({"long_factor": [1.0] * 5}, r"scaling\['long_factor'\] must hold rotary_dim / 2 = 8"),
                          ({"long_mscale": 1.2}, r"scaling\['long_mscale'\] is not supported")):
        bad = {**config, "rope_parameters": {**config["rope_parameters"], **edit}}
        with pytest.raises(ValueError, match=message):
            build_model(ModelConfig.from_dict(bad), device="cpu", dtype=torch.float32)


def test_phi3s_older_rope_type_names_and_top_level_pretraining_length_are_read_as_transformers_reads_them():
    base = {"architectures": [PHI3], "model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 101, "max_position_embeddings": 128}
    for old_name in ("su", "yarn"):
        config = ModelConfig.from_dict({**base, "original_max_position_embeddings": 32,
                                        "rope_scaling": {"type": old_name, "short_factor": [1.0] * 8,
                                                         "long_factor": [2.0] * 8}})
        assert config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["original_max_position_embeddings"] == 32
    # the top-level key wins over the dict's, and its default is 4096 (Phi3Config's)
    config = ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                             "long_factor": [2.0] * 8,
                                                             "original_max_position_embeddings": 16}})
    assert config.rope_scaling["original_max_position_embeddings"] == 4096


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
