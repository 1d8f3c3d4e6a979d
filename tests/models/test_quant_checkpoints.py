"""Quantized checkpoints written by the real tools load, and compute what their dequantized weights do.

Each case is a tiny Llama or Qwen3 (2 layers) quantized by compressed-tensors, AMD Quark, or saved in
HF's fp8 block format (``quant_checkpoints`` says how each is produced), loaded with ``load_model``
(fp32, CPU, the torch backend) and compared with the same model loaded from its DEQUANTIZED weights
(``q * scale`` in fp32, no quantization config):

1. **Weights, exactly.** Every linear layer's effective weight (its stored FP8 / INT8 values times
   the scale its GEMM reads, after ``process_weights_after_loading``) equals the dequantized
   checkpoint's, bit for bit; every layer has the scheme its config's rules give it (overrides,
   exclusions: an excluded layer is an ``UnquantizedLinear`` with the stored float weight); a static
   layer's input scale is the largest of its parts'.
2. **Logits, within the activation-quantization bound.** The weights being equal, activation
   quantization is the only difference. One quantized activation element carries a rounding error of
   RMS ``delta`` times its scale: FP8 e4m3 keeps 3 mantissa bits, so the error is uniform within half
   a step of at most ``2**-3 |x|``: ``delta_fp8 = 2**-3 / sqrt(12) = 0.036`` (per-tensor, per-token and
   per-group scales alike: a scale only moves where the exponent falls); INT8's step is
   ``amax / 127`` of the row, and rows of these models have ``amax <= 4 rms``:
   ``delta_int8 = 4 / (127 sqrt(12)) = 0.0091``. Each of the ``G = 4 L = 8`` quantized GEMMs on the
   path (qkv, o, gate_up, down per layer) adds an independent error of about ``delta`` of its
   output's scale; independent errors add in quadrature along the residual stream, and norms,
   softmax and SwiGLU may amplify them, for which a factor 2 is allowed: the relative RMS error of the
   logits, ``||logits - logits_deq|| / ||logits_deq||``, must be at most ``2 sqrt(G) delta`` (0.20 for
   FP8, 0.051 for INT8). Measured: 0.055 - 0.068 (FP8), 0.017 (INT8): a third of the bar. It must
   also exceed ``delta / 10``: the activations really were quantized (fp32 noise is ~1e-6).
3. **KV scales.** The checkpoint's per-layer ``k_scale`` / ``v_scale`` (compressed-tensors
   ``self_attn.k_scale``, Quark ``self_attn.k_proj.output_scale``) land on the attention layers; an
   engine with an FP8 pool binds them.

Online quantization (``load_model(quantization=...)``) must equal the checkpoint that the same routine
(``quantize_weight``) quantized offline, bit for bit. MoE: quantized experts are refused by name, the
dense layers of a checkpoint that excludes the experts load quantized.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from atom_core import ops
from atom_core.models import load_model
from atom_core.models.layers.linear import _Linear
from atom_core.models.quantization import (
    FP8_BLOCK_128,
    FP8_PER_CHANNEL,
    FP8_PER_TENSOR,
    INT8_PER_CHANNEL,
    UNQUANTIZED,
    ActivationScheme,
    UnquantizedLinear,
    UnsupportedQuantizationError,
    quantize_weight,
)
from atom_core.models.quantization.schemes import make_scheme
from tests.models import quant_checkpoints as qc
from tests.models.parity_harness import (
    PagedRunner,
    random_tokens,
    single_thread_torch,  # noqa: F401  (autouse fixture)
)

A = ActivationScheme
FP8_DELTA = 2**-3 / math.sqrt(12)
INT8_DELTA = 4 / (127 * math.sqrt(12))
GEMMS = 4 * 2  # quantized GEMMs on the path: qkv, o, gate_up, down in each of 2 layers


def logits_bound(delta: float) -> float:
    return 2 * math.sqrt(GEMMS) * delta


STATIC_FP8 = make_scheme(FP8_PER_TENSOR, A.STATIC_PER_TENSOR, where="t")
PTPC_FP8 = make_scheme(FP8_PER_CHANNEL, A.DYNAMIC_PER_TOKEN, where="t")
BLOCK_FP8 = make_scheme(FP8_BLOCK_128, A.DYNAMIC_PER_GROUP_128, where="t")
W8A8 = make_scheme(INT8_PER_CHANNEL, A.DYNAMIC_PER_TOKEN, where="t")
PROMPT_LENGTHS = (1, 7, 13, 4)
VOCAB = 101


def prompts() -> list[list[int]]:
    return [random_tokens(n, VOCAB, seed=10 + i) for i, n in enumerate(PROMPT_LENGTHS)]


def calibration() -> torch.Tensor:
    """Static input scales are calibrated on the prompts the test runs (padded), so none saturates."""
    width = max(PROMPT_LENGTHS)
    return torch.tensor([p + [0] * (width - len(p)) for p in prompts()])


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    architecture: str
    sizes: dict
    build: Callable[[torch.nn.Module, Path], Path]
    scheme_of: Callable[[str], object]  # layer prefix -> the LinearScheme its rules give it
    delta: float
    kv_scales: str | None = None  # tensor names the checkpoint stores them under
    unquantized: tuple[str, ...] = field(default=())


def _excluding(default, excluded: tuple[str, ...], overrides: dict | None = None):
    def scheme_of(prefix: str):
        if prefix in excluded:
            return UNQUANTIZED
        for suffix, scheme in (overrides or {}).items():
            if prefix.endswith(suffix):
                return scheme
        return default
    return scheme_of


CASES = [
    Case("ct_fp8_static_kv", "llama", "LlamaForCausalLM", qc.ODD,
         lambda m, f: qc.ct_checkpoint(m, f, "FP8", architecture="LlamaForCausalLM", kv_cache=True,
                                       ignore=("lm_head", "model.layers.1.mlp.down_proj"), calib=calibration()),
         _excluding(STATIC_FP8, ("model.layers.1.mlp.down_proj",)), FP8_DELTA, kv_scales="k_scale"),
    Case("ct_fp8_dynamic", "qwen3", "Qwen3ForCausalLM", qc.ODD,
         lambda m, f: qc.ct_checkpoint(m, f, "FP8_DYNAMIC", architecture="Qwen3ForCausalLM"),
         _excluding(PTPC_FP8, ()), FP8_DELTA),
    Case("ct_fp8_block", "llama", "LlamaForCausalLM", qc.ALIGNED,
         lambda m, f: qc.ct_checkpoint(m, f, "FP8_BLOCK", architecture="LlamaForCausalLM"),
         _excluding(BLOCK_FP8, ()), FP8_DELTA),
    Case("ct_w8a8", "qwen3", "Qwen3ForCausalLM", qc.ODD,
         lambda m, f: qc.ct_checkpoint(m, f, "W8A8", architecture="Qwen3ForCausalLM",
                                       ignore=("lm_head", "re:.*layers.0.self_attn.o_proj$")),
         _excluding(W8A8, ("model.layers.0.self_attn.o_proj",)), INT8_DELTA),
    Case("hf_fp8_block", "qwen3", "Qwen3ForCausalLM", qc.ALIGNED,
         lambda m, f: qc.hf_fp8_block_checkpoint(m, f, architecture="Qwen3ForCausalLM",
                                                 ignore=("model.layers.0.mlp.down_proj",)),
         _excluding(BLOCK_FP8, ("model.layers.0.mlp.down_proj",)), FP8_DELTA),
    Case("quark_fp8_kv_override", "qwen3", "Qwen3ForCausalLM", qc.ODD,
         lambda m, f: qc.quark_checkpoint(m, f, "fp8", template="qwen3", architecture="Qwen3ForCausalLM",
                                          kv_cache=True, layer_config={"*down_proj": "ptpc_fp8"},
                                          exclude=["lm_head", "*layers.1.self_attn.o_proj"], calib=calibration()),
         _excluding(STATIC_FP8, ("model.layers.1.self_attn.o_proj",), {"down_proj": PTPC_FP8}), FP8_DELTA,
         kv_scales="proj.output_scale"),
    Case("quark_ptpc", "llama", "LlamaForCausalLM", qc.ODD,
         lambda m, f: qc.quark_checkpoint(m, f, "ptpc_fp8", template="llama", architecture="LlamaForCausalLM"),
         _excluding(PTPC_FP8, ()), FP8_DELTA),
]


@dataclass
class Loaded:
    case: Case
    path: Path
    quantized: torch.nn.Module
    dequantized: torch.nn.Module


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def loaded(request, tmp_path_factory) -> Loaded:
    case = request.param
    if case.name.startswith("quark"):
        pytest.importorskip("quark.torch")
    folder = tmp_path_factory.mktemp(case.name)
    path = case.build(qc.hf_model(case.family, case.sizes), folder / "quantized")
    deq = qc.dequantized_checkpoint(path, folder / "dequantized")
    return Loaded(case, path, load_model(path, dtype=torch.float32, device="cpu"),
                  load_model(deq, dtype=torch.float32, device="cpu"))


def linear_layers(model) -> dict[str, _Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, _Linear) and name.startswith("model.")}


def effective_weight(layer: _Linear) -> torch.Tensor:
    """What the layer's GEMM multiplies by: stored values times the scale ``apply`` reads."""
    if isinstance(layer.quant_method, UnquantizedLinear):
        return layer.weight.float()
    w, s = layer.weight.float(), layer._w_scale.float()
    if s.numel() == 1 or s.shape == (w.shape[0], 1):
        return w * s.reshape(-1, 1)
    return w * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]


def model_logits(model) -> torch.Tensor:
    runner = PagedRunner(model, block_size=4, num_blocks=32, seed=1)
    with ops.use_backend("torch"):
        return torch.cat(runner.step([(f"s{i}", p) for i, p in enumerate(prompts())]))


def stored(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle)


def test_every_layer_has_its_rule_and_its_effective_weight_is_the_dequantized_one(loaded):
    deq_layers = linear_layers(loaded.dequantized)
    layers = linear_layers(loaded.quantized)
    assert set(layers) == set(deq_layers) and layers
    tensors = stored(loaded.path)
    for name, layer in layers.items():
        assert layer.prefix == name
        assert layer.scheme == loaded.case.scheme_of(name), name
        if not layer.scheme.is_quantized:
            assert layer.weight.dtype == torch.float32
        assert torch.equal(effective_weight(layer), deq_layers[name].weight), name
        if layer.scheme.activation is A.STATIC_PER_TENSOR:
            parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
            head, _, last = name.rpartition(".")
            scales = [tensors[f"{head}.{p}.input_scale"].reshape(()) for p in parts.get(last, (last,))]
            assert torch.equal(layer._a_scale, torch.stack(scales).max().reshape(1))


def test_logits_match_the_dequantized_model_within_the_activation_quantization_bound(loaded):
    actual, expected = model_logits(loaded.quantized), model_logits(loaded.dequantized)
    relative = ((actual - expected).norm() / expected.norm()).item()
    delta = loaded.case.delta
    assert delta / 10 < relative <= logits_bound(delta), \
        f"relative RMS logit error {relative:.4g}, bound {logits_bound(delta):.4g} (delta {delta:.4g})"


def test_checkpoint_kv_scales_land_on_the_attention_layers(loaded):
    tensors = stored(loaded.path)
    for i, attn in enumerate(loaded.quantized._attention_layers):
        for kv in "kv":
            got = getattr(attn, f"checkpoint_{kv}_scale")
            if loaded.case.kv_scales is None:
                assert got is None
                continue
            suffix = f"{kv}_{loaded.case.kv_scales}" if loaded.case.kv_scales.startswith("proj") else \
                f"{kv}_scale"
            want = tensors[f"model.layers.{i}.self_attn.{suffix}"].float().reshape(1)
            assert got is not None and torch.equal(got, want) and got.dtype == torch.float32


def test_engine_with_an_fp8_pool_binds_the_checkpoint_kv_scales_and_generates(tmp_path):
    pytest.importorskip("quark.torch")
    from atom_core.engine import Engine, SamplingParams

    case = next(c for c in CASES if c.name == "quark_fp8_kv_override")
    path = case.build(qc.hf_model(case.family, case.sizes), tmp_path / "q")
    model = load_model(path, dtype=torch.float32, device="cpu")
    with ops.use_backend("torch"):
        engine = Engine(model, device="cpu", kv_cache_dtype="fp8", block_size=4, num_kv_blocks=64, max_model_len=64,
                        warmup=False)
        outs = engine.generate(prompts()[1:3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                               use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [5, 5]
    for attn in model._attention_layers:
        assert attn.k_cache.dtype == torch.float8_e4m3fn
        assert torch.equal(attn.k_scale, attn.checkpoint_k_scale) and torch.equal(attn.v_scale, attn.checkpoint_v_scale)
        assert attn.k_scale.item() != 1.0


# --- online quantization ----------------------------------------------------------------------------------

LINEAR_SUFFIXES = tuple(f".{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"))


def _offline_copy(bf16: Path, folder: Path, preset: str, weight_format) -> Path:
    """``bf16``'s linear weights quantized by ``quantize_weight`` (the online routine) and saved as a
    compressed-tensors checkpoint of ``preset`` (config written by compressed-tensors)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        preset_name_to_scheme,
    )

    folder.mkdir()
    out = {}
    for name, tensor in stored(bf16).items():
        if name.endswith(LINEAR_SUFFIXES):
            out[name], out[name[: -len("weight")] + "weight_scale"] = quantize_weight(tensor, weight_format)
        else:
            out[name] = tensor
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text((bf16 / "config.json").read_text())
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"],
                                format="float-quantized", quantization_status="compressed")
    ModelCompressor(quantization_config=config).update_config(str(folder))
    return folder


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bf16")
    model = qc.hf_model("qwen3", qc.ALIGNED).to(torch.bfloat16)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("quantization, preset, weight_format", [("fp8", "FP8_DYNAMIC", FP8_PER_CHANNEL),
                                                                  ("fp8_block", "FP8_BLOCK", FP8_BLOCK_128)])
def test_online_quantization_equals_the_checkpoint_quantized_offline_by_the_same_routine(
        bf16_checkpoint, tmp_path, quantization, preset, weight_format):
    online = load_model(bf16_checkpoint, dtype=torch.float32, device="cpu", quantization=quantization)
    offline = load_model(_offline_copy(bf16_checkpoint, tmp_path / "offline", preset, weight_format),
                         dtype=torch.float32, device="cpu")
    layers = linear_layers(online)
    assert all(layer.weight.dtype == torch.float8_e4m3fn and layer.scheme.weight == weight_format
               for layer in layers.values())
    offline_params = dict(offline.named_parameters())
    for name, param in online.named_parameters():
        assert param.dtype == offline_params[name].dtype and torch.equal(param, offline_params[name]), name
    assert torch.equal(model_logits(online), model_logits(offline))


def test_online_quantization_of_a_quantized_checkpoint_or_an_unknown_name_is_refused(bf16_checkpoint, tmp_path):
    quantized = _offline_copy(bf16_checkpoint, tmp_path / "q", "FP8_DYNAMIC", FP8_PER_CHANNEL)
    with pytest.raises(UnsupportedQuantizationError, match="already quantized.*compressed-tensors"):
        load_model(quantized, device="cpu", quantization="fp8")
    with pytest.raises(UnsupportedQuantizationError, match="quantization='int4' is not supported"):
        load_model(bf16_checkpoint, device="cpu", quantization="int4")


def test_fp8_tensors_load_only_into_fp8_layers(bf16_checkpoint, tmp_path):
    """A model built without the checkpoint's quantization (``build_model``) refuses its FP8 weights
    instead of casting them without their scales."""
    from atom_core.models import build_model, load_weights
    from atom_core.models.config import ModelConfig

    quantized = _offline_copy(bf16_checkpoint, tmp_path / "q", "FP8_DYNAMIC", FP8_PER_CHANNEL)
    plain = build_model(ModelConfig.from_file(quantized / "config.json"), device="cpu", load_format="zeros")
    with pytest.raises(ValueError, match=r"_proj.weight.*float8_e4m3fn.*FP8 values load only into a quantized layer"):
        load_weights(plain, quantized)


# --- MoE: dense layers quantized, experts refused -----------------------------------------------------------

def test_moe_checkpoint_with_quantized_experts_is_refused_by_name_and_loads_when_they_are_excluded(tmp_path):
    from tests.models import test_parity_qwen3_moe

    case = test_parity_qwen3_moe.CASES[1]  # layer 0 dense, layers 1-2 sparse
    model = qc.hf_model("qwen3_moe", case.overrides)
    refused = qc.ct_checkpoint(model, tmp_path / "refused", "FP8_DYNAMIC", architecture=case.architecture,
                               ignore=("lm_head", "re:.*mlp.gate$"))
    with pytest.raises(UnsupportedQuantizationError, match=r"layer 'model.layers.1.mlp.experts' is quantized MoE experts"):
        load_model(refused, device="cpu")
    # (compressed-tensors writes ``ignore`` as the Linear modules it skipped, so an ignore regex for the
    # experts, which transformers 5 does not hold as Linear modules, is lost: targets name the dense layers.)
    dense = (r"re:.*self_attn\.(q|k|v|o)_proj$", r"re:.*layers\.0\.mlp\.(gate|up|down)_proj$")
    path = qc.ct_checkpoint(model, tmp_path / "dense", "FP8_DYNAMIC", architecture=case.architecture,
                            targets=dense)
    quantized = load_model(path, dtype=torch.float32, device="cpu")
    dequantized = load_model(qc.dequantized_checkpoint(path, tmp_path / "deq"), dtype=torch.float32, device="cpu")
    layers = linear_layers(quantized)
    assert layers["model.layers.0.mlp.gate_up_proj"].scheme == PTPC_FP8
    assert layers["model.layers.2.self_attn.qkv_proj"].scheme == PTPC_FP8
    assert quantized.model.layers[1].mlp.experts.w13_weight.dtype == torch.float32
    actual, expected = model_logits(quantized), model_logits(dequantized)
    relative = ((actual - expected).norm() / expected.norm()).item()
    # 3 layers, 2 quantized GEMMs (qkv, o) in each plus the dense layer's 2: G = 8, as in the dense cases.
    assert FP8_DELTA / 10 < relative <= logits_bound(FP8_DELTA)
    with pytest.raises(UnsupportedQuantizationError, match=r"'model.layers.1.mlp.experts' is quantized MoE experts"):
        load_model(qc.dequantized_checkpoint(path, tmp_path / "deq2"), device="cpu", quantization="fp8")
