"""On a GPU: the norms and SiLU that quantize for the next linear layer (Triton's ``rms_norm_quant`` and
``silu_and_mul_quant``) give the logits of the same model with each linear layer quantizing its own input,
bit for bit, for per-token and block FP8 (online quantization of a tiny Qwen3: transformers only)."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from atom_core.models import load_model
from atom_core.ops.dispatch import trace_backends
from tests.models import quant_checkpoints as qc
from tests.models.parity_harness import PagedRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16")
    qc.hf_model("qwen3", qc.ALIGNED).to(torch.bfloat16).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def logits(model) -> torch.Tensor:
    runner = PagedRunner(model, block_size=4, num_blocks=32, seed=1, device="cuda")
    return torch.cat(runner.step([(f"s{i}", p) for i, p in enumerate(PROMPTS)]))


@pytest.mark.parametrize("quantization", ["fp8", "fp8_block"])
def test_gpu_norms_and_silu_quantizing_in_triton_give_the_unfused_logits_bit_for_bit(bf16_checkpoint, quantization):
    model = load_model(bf16_checkpoint, dtype=torch.bfloat16, device="cuda", quantization=quantization)
    with trace_backends() as calls:
        fused = logits(model)
    assert {("rms_norm_quant", "triton"), ("silu_and_mul_quant", "triton")} <= set(calls)
    assert torch.equal(fused, logits(qc.unfused(model)))
