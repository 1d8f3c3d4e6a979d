"""Qwen2ForCausalLM against transformers' Qwen2ForCausalLM: Llama with a bias on q, k and v (none on o) and
sliding-window layers from ``use_sliding_window`` / ``max_window_layers``.

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

QWEN2 = "Qwen2ForCausalLM"
CASES = [
    ParityCase("gqa2", "qwen2", QWEN2, {"num_key_value_heads": 2}),
    ParityCase("sliding_from_layer_1_tied", "qwen2", QWEN2,
               {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1, "tie_word_embeddings": True}),
]

pair = parity_pair_fixture(CASES)


def test_parameter_names_mirror_hf(pair, model):
    check_parameter_names(pair, model)


def test_q_k_v_have_a_bias_o_none_and_the_window_reaches_the_layers_hf_slides(pair, model):
    hf_config = pair.hf_model.config
    windows = [hf_config.sliding_window if kind == "sliding_attention" else None for kind in hf_config.layer_types]
    for layer, window in zip(model.model.layers, windows, strict=True):
        attn = layer.self_attn
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
        assert attn.attn.sliding_window == window


class TestHFParity(HFParityChecks):
    """Ragged prefill, paged decode, chunked prefill and prefix resumption against HF."""

    def test_engine_greedy_equals_hf_generate(self, pair):
        check_engine_greedy(pair, lengths=(9, 1, 14), max_tokens=8)


@pytest.mark.skipif(not backend_available("triton") or torch.cuda.is_available(),
                    reason="CPU interpreter case (the GPU variant below covers Triton on a GPU)")
def test_triton_backend_serves_every_op_with_the_biases_and_matches_hf(pair, model):
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


def test_online_fp8_quantizes_the_projections_and_keeps_the_qkv_bias(pair):
    """The attention takes the quantization arguments Llama's make_layer passes (they once raised TypeError)."""
    from atom_core.models import load_model
    from atom_core.models.quantization.linear_methods import Fp8Linear

    model = load_model(pair.path, device="cpu", dtype=torch.float32, quantization="fp8")
    fp32 = pair.load_atom()
    for layer, reference in zip(model.model.layers, fp32.model.layers, strict=True):
        qkv = layer.self_attn.qkv_proj
        assert isinstance(qkv.quant_method, Fp8Linear) and qkv.weight.dtype == torch.float8_e4m3fn
        torch.testing.assert_close(qkv.bias, reference.self_attn.qkv_proj.bias, rtol=0, atol=0)
