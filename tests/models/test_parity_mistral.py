"""MistralForCausalLM (loaded as ``LlamaForCausalLM``) against transformers' MistralForCausalLM: Llama with
``config.sliding_window`` on every layer (Mistral 7B v0.1), or on none when it is null (v0.2, v0.3, Nemo's
explicit ``head_dim``).

fp32 on CPU with the torch backend must match HF's logits within parity_harness.FP32_TOL at every position of
ragged prefills, decode steps (block sizes 1, 4, 16), prefill chunks and a prefix-cache resumption; the engine's
greedy tokens equal HF ``generate``. The GPU variant runs every case in bf16 with the Triton backend.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from atom_core.models.llama import LlamaForCausalLM  # noqa: E402
from tests.models.moe_parity import (  # noqa: E402
    DENSE_LAYER_OPS,
    check_bf16_triton_matches_hf_fp32,
    check_engine_greedy,
)
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    HFParityChecks,
    ParityCase,
    check_parameter_names,
    parity_pair_fixture,
    single_thread_torch,
)

MISTRAL = "MistralForCausalLM"
CASES = [
    ParityCase("window5", "mistral", MISTRAL, {"sliding_window": 5}),
    ParityCase("no_window_head_dim24", "mistral", MISTRAL, {"sliding_window": None, "head_dim": 24}),
]

pair = parity_pair_fixture(CASES)


def test_parameter_names_mirror_hf(pair, model):
    check_parameter_names(pair, model)


def test_it_loads_as_llama_with_the_window_on_every_layer_or_none(pair, model):
    window = pair.hf_model.config.sliding_window
    assert type(model) is LlamaForCausalLM
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [window] * len(model.model.layers)


class TestHFParity(HFParityChecks):
    """Ragged prefill, paged decode, chunked prefill and prefix resumption against HF."""

    def test_engine_greedy_equals_hf_generate(self, pair):
        check_engine_greedy(pair, lengths=(9, 1, 14), max_tokens=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_triton_serves_every_op_and_matches_hf_fp32(pair):
    check_bf16_triton_matches_hf_fp32(pair, DENSE_LAYER_OPS)
