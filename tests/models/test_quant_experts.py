"""Quantized experts (``FusedMoE`` with an expert method) and quantized random-weight builds.

- ``FusedMoE`` alone: which splits each format refuses (named), per-tensor expert scales spread exactly
  over their rows, stacked FP8 refused, MXFP4 stacks cut by TP / EP into pieces whose partial sums add up
  to the single-rank layer, and the memory of a gpt-oss-20b-shaped layer (0.5 + 1/32 bytes per weight)
  and of the whole gpt-oss-20b (on the meta device: nothing allocated).
- ``build_model(..., quantization=...)`` / a config's ``quantization_config`` with dummy weights: the
  stored dtypes and shapes of every quantized layer, random values of the unquantized initializer's scale
  once dequantized, a forward through the paged KV cache that gives finite logits; DeepSeek's experts
  quantized while its MLA stays unquantized where the config excludes it, and MLA in FP8 (kv_b_proj
  dequantized at load) where it does not.

Checkpoints of each format against their dequantized models are in ``test_quant_checkpoints``.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atom_core import ops
from atom_core.models import build_model, load_model
from atom_core.models.layers.linear import _Linear
from atom_core.models.layers.moe import FusedMoE, mxfp4_expert_params_mapping
from atom_core.models.mxfp4 import dequantize_mxfp4
from atom_core.models.quantization import (
    FP8_PER_TENSOR,
    ActivationScheme,
    QuantConfig,
    UnsupportedQuantizationError,
    online_quant_config,
    parse_quant_config,
)
from atom_core.models.quantization.schemes import make_scheme
from tests.models.parity_harness import PagedRunner, random_tokens
from tests.models.test_model_memory import ARCHITECTURES
from tests.models.test_mxfp4 import random_mxfp4

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
# Every fused part (q | k | v, gate | up, experts' gate | up) whole 128-blocks.
ALIGNED = {"vocab_size": 101, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 64,
           "moe_intermediate_size": 128}
FP8 = torch.float8_e4m3fn


def _quant(quantization_config: dict) -> QuantConfig:
    """The parsed config bound to gpt-oss's expert mapping (which tells ``scheme_for`` a layer is experts)."""
    return parse_quant_config(quantization_config).bind(None, mxfp4_expert_params_mapping())


def _scheme_config(scheme) -> QuantConfig:
    return QuantConfig(quant_method="fp8", default=scheme, expert_default=scheme)


# ---- FusedMoE alone -----------------------------------------------------------------------------------

def test_block_experts_refuse_a_split_that_cuts_a_block_by_name():
    block = online_quant_config("fp8_block")
    FusedMoE(4, 256, 256, tp_rank=1, tp_size=2, quant_config=block, prefix="model.layers.3.mlp.experts")
    with pytest.raises(UnsupportedQuantizationError,
                       match=r"model.layers.3.mlp.experts: FP8 128 x 128 block scales cannot follow this split: .*"
                             r"intermediate size 384 gives 192 units per rank \(tp_size 2\)"):
        FusedMoE(4, 256, 384, tp_rank=0, tp_size=2, quant_config=block, prefix="model.layers.3.mlp.experts")
    with pytest.raises(UnsupportedQuantizationError, match="intermediate size 100 gives 100 units per rank"):
        FusedMoE(4, 256, 100, quant_config=block, prefix="experts")  # gate's last block would hold up rows
    FusedMoE(4, 256, 384, ep_rank=1, ep_size=2, quant_config=block, prefix="experts")  # EP: whole experts
    FusedMoE(4, 256, 100, quant_config=online_quant_config("fp8"), prefix="experts")  # per-channel: any split


def test_mxfp4_experts_refuse_a_split_that_cuts_a_scale_group_by_name():
    mxfp4 = _quant({"quant_method": "mxfp4"})
    with torch.device("meta"):
        layer = FusedMoE(32, 2880, 2880, activation="swiglu_clamped", tp_rank=1, tp_size=2, quant_config=mxfp4,
                         prefix="model.layers.0.mlp.experts")
    assert layer.weight_format == "mxfp4" and tuple(layer.w2_weight_scale.shape) == (32, 2880, 45)
    with pytest.raises(UnsupportedQuantizationError, match=r"model.layers.0.mlp.experts: MXFP4 experts need .* "
                                                           r"\(720 = 2880 / tp_size 4\) to be multiples of 32"), \
            torch.device("meta"):
        FusedMoE(32, 2880, 2880, activation="swiglu_clamped", tp_rank=0, tp_size=4, quant_config=mxfp4,
                 prefix="model.layers.0.mlp.experts")


def test_per_tensor_expert_scales_spread_exactly_over_their_rows():
    """FP8 per-tensor weights with dynamic activations (HF fp8 without blocks): each expert projection's
    one scale fills its rows of the per-channel scale the op reads; the stored values stay as they are."""
    scheme = make_scheme(FP8_PER_TENSOR, ActivationScheme.DYNAMIC_PER_TENSOR, where="t")
    layer = FusedMoE(2, 8, 6, tp_rank=1, tp_size=2, quant_config=_scheme_config(scheme), prefix="experts")
    assert layer.weight_format == "fp8_channel"
    gen = torch.Generator().manual_seed(0)
    for e in range(2):
        for proj, shape in (("w1", (6, 8)), ("w3", (6, 8)), ("w2", (8, 6))):
            weight = layer.w2_weight if proj == "w2" else layer.w13_weight
            scale = layer.w2_weight_scale if proj == "w2" else layer.w13_weight_scale
            values = torch.randn(shape, generator=gen).to(FP8)
            weight.weight_loader(weight, values, (e, proj))
            scale.weight_loader(scale, torch.tensor(0.5 + e + (proj == "w3")), (e, proj))
            if proj == "w2":
                assert torch.equal(layer.w2_weight[e], values[:, 3:])
    assert layer.w13_weight_scale[:, :, 0].tolist() == [[0.5] * 3 + [1.5] * 3, [1.5] * 3 + [2.5] * 3]
    assert layer.w2_weight_scale[:, :, 0].tolist() == [[0.5] * 8, [1.5] * 8]


def test_stacked_fp8_experts_are_refused_by_name():
    layer = FusedMoE(2, 128, 128, quant_config=_quant({"quant_method": "fp8", "weight_block_size": [128, 128]}),
                     prefix="model.layers.0.mlp.experts")
    with pytest.raises(UnsupportedQuantizationError, match=r"model.layers.0.mlp.experts: FP8 experts stored as one "
                                                           "stacked tensor are not supported"):
        layer.w13_weight.weight_loader(layer.w13_weight, torch.zeros(2, 256, 128, dtype=FP8))


@pytest.mark.parametrize("tp_size, ep_size", [(2, 1), (1, 2)])
def test_mxfp4_stacks_split_over_ranks_into_partial_sums_of_the_layer(tp_size, ep_size):
    """gpt-oss's stored blocks / scales, cut by TP (32-groups of each expert's intermediate units) or EP
    (whole experts): every rank's output with reduce_results=False sums to the single-rank output, and the
    single rank's decoded weights are the stored values."""
    num_experts, hidden, inter, tokens = 4, 64, 64, 9
    mxfp4 = _quant({"quant_method": "mxfp4"})
    stored = {}
    for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        blocks, scales, values = random_mxfp4((num_experts, rows), cols, seed=len(stored), exponents=(-4, -2))
        stored[name] = (blocks.reshape(num_experts, rows, cols // 32, 16), scales, values)
    biases = {"w13": torch.randn(num_experts, 2 * inter), "w2": torch.randn(num_experts, hidden)}
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = ops.topk_softmax(torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(2)), 2,
                                    renormalize=True, backend="torch")

    def layer(**ranks) -> FusedMoE:
        moe = FusedMoE(num_experts, hidden, inter, activation="swiglu_clamped", bias=True, reduce_results=False,
                       quant_config=mxfp4, prefix="experts", **ranks)
        for name in ("w13", "w2"):
            blocks, scales, _ = stored[name]
            for suffix, tensor in (("weight", blocks), ("weight_scale", scales), ("bias", biases[name])):
                param = getattr(moe, f"{name}_{suffix}")
                param.weight_loader(param, tensor)
        return moe

    whole = layer()
    for name in ("w13", "w2"):
        w, s = getattr(whole, f"{name}_weight"), getattr(whole, f"{name}_weight_scale")
        decoded = dequantize_mxfp4(w.view(*w.shape[:2], -1, 16), s, torch.float64)
        assert w.dtype == torch.uint8 and torch.equal(decoded, stored[name][2])
    with ops.use_backend("torch"):
        expected = whole(x, weights, ids)
        total = sum(layer(tp_rank=t, tp_size=tp_size, ep_rank=p, ep_size=ep_size)(x, weights, ids)
                    for t in range(tp_size) for p in range(ep_size))
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_gpt_oss_20b_experts_take_half_a_byte_and_a_scale_per_weight_and_the_model_fits_14_gb():
    """Built on the meta device (nothing allocated) from the released config (MXFP4 experts, bf16 rest)."""
    config = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    model = build_model(config, device="meta", dtype=torch.bfloat16, load_format="zeros")
    experts = model.model.layers[0].mlp.experts
    assert experts.weight_format == "mxfp4"
    e, h, i = 32, 2880, 2880
    weight_bytes = sum(p.numel() * p.element_size() for n, p in experts.named_parameters() if "bias" not in n)
    assert weight_bytes == e * 3 * h * i * (0.5 + 1 / 32)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 13e9 < total <= 14e9, f"{total / 1e9:.2f} GB"


# ---- random-weight quantized builds ---------------------------------------------------------------------

def _forward_logits(model) -> torch.Tensor:
    runner = PagedRunner(model, block_size=4, num_blocks=16, seed=1)
    with ops.use_backend("torch"):
        outs = runner.step([("a", random_tokens(5, 101, seed=3)), ("b", random_tokens(3, 101, seed=4))])
        outs += runner.step([("a", [7]), ("b", [9])])
    return torch.cat(outs)


def _dequantized_std(layer: _Linear) -> float:
    w, s = layer.weight.float(), layer.weight_scale.float()
    if s.shape == (w.shape[0], 1):
        return (w * s).std().item()
    return (w * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]).std().item()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe_step2_mlp_only", "glm4_moe_dense_first_shared"])
@pytest.mark.parametrize("quantization", ["fp8", "fp8_block"])
def test_dummy_quantized_build_stores_fp8_everywhere_and_runs(arch, quantization):
    config = {**ARCHITECTURES[arch], **ALIGNED, "num_hidden_layers": 4, "mlp_only_layers": []}
    model = build_model(config, device="cpu", quantization=quantization)
    linears = [m for n, m in model.named_modules() if isinstance(m, _Linear) and not n.endswith(".gate")]
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert linears and (experts or arch == "llama")
    block = quantization == "fp8_block"
    for layer in linears:
        assert layer.weight.dtype == FP8 and layer.weight_scale.dtype == torch.float32
        rows, cols = layer.weight.shape
        assert tuple(layer.weight_scale.shape) == ((rows // 128, cols // 128) if block else (rows, 1))
        assert 0.017 < _dequantized_std(layer) < 0.023  # normal(0, 0.02), quantized
    for layer in experts:
        assert layer.weight_format == ("fp8_block" if block else "fp8_channel")
        assert layer.w13_weight.dtype == layer.w2_weight.dtype == FP8
        e, two_i, h = layer.w13_weight.shape
        assert tuple(layer.w13_weight_scale.shape) == ((e, two_i // 128, h // 128) if block else (e, two_i, 1))
    logits = _forward_logits(model)
    assert logits.shape == (10, 101) and torch.isfinite(logits).all() and logits.std() > 0


def test_dummy_gpt_oss_with_an_mxfp4_config_builds_packed_random_experts_and_runs():
    config = {**ARCHITECTURES["gpt_oss"], **ALIGNED, "intermediate_size": 64,
              "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    model = build_model(config, device="cpu")
    experts = model.model.layers[0].mlp.experts
    assert experts.weight_format == "mxfp4"
    assert experts.w13_weight.dtype == torch.uint8 and tuple(experts.w13_weight.shape) == (4, 128, 128)
    assert tuple(experts.w13_weight_scale.shape) == (4, 128, 8) and tuple(experts.w2_weight.shape) == (4, 256, 32)
    decoded = dequantize_mxfp4(experts.w13_weight.view(4, 128, 8, 16), experts.w13_weight_scale, torch.float32)
    assert 0.015 < decoded.std().item() < 0.03 and len(torch.unique(experts.w13_weight)) > 200
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # excluded: unquantized
    assert torch.isfinite(_forward_logits(model)).all()


def test_load_model_dummy_builds_the_online_quantization_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**ARCHITECTURES["qwen3_moe_step2_mlp_only"], **ALIGNED}))
    model = load_model(tmp_path, device="cpu", load_format="dummy", quantization="fp8_block")
    assert model.model.layers[1].mlp.experts.weight_format == "fp8_block"
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8


DEEPSEEK_V3 = {**ARCHITECTURES["deepseek_v3_mla_q_lora"], **ALIGNED, "moe_intermediate_size": 128,
               "num_hidden_layers": 2, "kv_lora_rank": 128, "q_lora_rank": 128, "qk_nope_head_dim": 32,
               "qk_rope_head_dim": 32, "v_head_dim": 32}
HF_FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def test_deepseek_experts_and_mlps_quantize_while_mla_stays_unquantized():
    config = {**DEEPSEEK_V3, "quantization_config": {**HF_FP8_BLOCK,
                                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    model = build_model(config, device="cpu")
    dense, sparse = model.model.layers
    assert sparse.mlp.experts.weight_format == "fp8_block"
    assert sparse.mlp.shared_experts.gate_up_proj.weight.dtype == dense.mlp.down_proj.weight.dtype == FP8
    assert dense.self_attn.kv_b_proj.weight.dtype == torch.float32
    assert torch.isfinite(_forward_logits(model)).all()


def test_deepseek_quantized_mla_builds_in_fp8_with_kv_b_proj_dequantized_and_online_leaves_kv_b_proj():
    """The released FP8 config quantizes MLA's projections too (tests/models/test_quant_deepseek.py checks
    real checkpoints): random weights are built quantized; kv_b_proj is drawn in FP8, then dequantized into
    w_kv_b and its FP8 tensors freed. Online quantization leaves kv_b_proj in the model dtype."""
    model = build_model({**DEEPSEEK_V3, "quantization_config": HF_FP8_BLOCK}, device="cpu")
    attn = model.model.layers[0].self_attn
    assert model.model.layers[1].mlp.experts.weight_format == "fp8_block"
    assert attn.q_a_proj.weight.dtype == attn.o_proj.weight.dtype == FP8
    assert attn.kv_b_proj.scheme.is_quantized and not list(attn.kv_b_proj.parameters())
    assert attn.w_kv_b.dtype == torch.float32
    assert torch.isfinite(_forward_logits(model)).all()
    online = build_model(DEEPSEEK_V3, device="cpu", load_format="zeros", quantization="fp8")
    assert online.model.layers[1].mlp.experts.weight_format == "fp8_channel"
    assert online.model.layers[0].self_attn.o_proj.weight.dtype == FP8
    assert online.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float32


def test_engine_from_pretrained_passes_quantization_to_load_model(tmp_path):
    from atom_core.engine import Engine, SamplingParams

    (tmp_path / "config.json").write_text(json.dumps({**ARCHITECTURES["qwen3_moe_step2_mlp_only"], **ALIGNED}))
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(tmp_path, device="cpu", load_format="dummy", quantization="fp8_block",
                                        block_size=4, num_kv_blocks=16, max_model_len=32, warmup=False)
        outs = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                               use_tqdm=False)
    assert engine.model.model.layers[1].mlp.experts.weight_format == "fp8_block"
    assert len(outs[0].token_ids) == 3
