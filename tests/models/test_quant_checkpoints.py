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
(``quantize_weight``) quantized offline, bit for bit. MoE (Qwen3-MoE, Mixtral, GLM-4-MoE): FP8 block and
per-channel experts, with and without quantized dense layers, in compressed-tensors and HF fp8 checkpoints:
the experts' effective weights equal the dequantized checkpoint's, and the logits meet the same bar with G
counting the experts' GEMMs (see the MoE section); static-activation experts are refused by name.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import shutil
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
from atom_core.models.quantization.activation import QuantizedActivation
from atom_core.models.quantization.schemes import make_scheme
from atom_core.models.qwen3_moe import SoftmaxTopKMoE
from atom_core.ops.dispatch import trace_backends
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


FUSED_INPUT_QUANT = {A.DYNAMIC_PER_GROUP_128, A.DYNAMIC_PER_TOKEN}  # the schemes whose producers quantize


def check_fused_input_quantization(loaded: Loaded) -> None:
    """The norms before qkv_proj / a decoder layer's gate_up_proj and every gated MLP's SiLU quantize for the
    layer after them exactly where its scheme quantizes its input dynamically, so does the attention for
    a block-FP8 o_proj (Dh = 128: a group a head), and the logits equal those of the same model with each
    linear layer quantizing its own input, bit for bit (torch backend)."""
    layers = linear_layers(loaded.quantized)
    fused = {name for name, layer in layers.items() if layer.scheme.activation in FUSED_INPUT_QUANT}
    for name, layer in layers.items():
        assert (layer.input_quant is not None) == (name in fused), name
    o_inputs = {}  # o_proj's input, by layer: quantized by the attention where its groups are the heads
    hooks = [layers[name].register_forward_pre_hook(lambda m, args, name=name: o_inputs.setdefault(name, args[0]))
             for name in layers if name.endswith("self_attn.o_proj")]
    with trace_backends() as calls:
        fused_logits = model_logits(loaded.quantized)
    for hook in hooks:
        hook.remove()
    head_dim = loaded.quantized.config.head_dim
    for name, x in o_inputs.items():
        quant = layers[name].input_quant
        by_heads = quant is not None and quant.dtype == torch.float8_e4m3fn and quant.group_size == head_dim
        assert isinstance(x, QuantizedActivation) == by_heads, name
    names = [op for op, _ in calls]
    # a softmax top-k MoE block with fp8 experts: its norm quantizes for the experts and keeps the rows for the router
    fp8_moe_blocks = sum(isinstance(m, SoftmaxTopKMoE) and m.experts.weight_format in ("fp8_block", "fp8_channel")
                         for m in loaded.quantized.modules())
    want = {"rms_norm_quant": fp8_moe_blocks + sum(n.endswith(("self_attn.qkv_proj", "mlp.gate_up_proj"))  # one forward
                                                   and not n.endswith("shared_experts.gate_up_proj") for n in fused),
            "silu_and_mul_quant": sum(n.endswith("down_proj") for n in fused)}
    assert {op: names.count(op) for op in want} == want
    unfused_logits = model_logits(qc.unfused(copy.deepcopy(loaded.quantized)))
    assert torch.equal(fused_logits, unfused_logits)


def test_norms_and_silu_quantize_for_the_next_layer_and_the_logits_equal_the_unfused_path_bit_for_bit(loaded):
    check_fused_input_quantization(loaded)


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


@pytest.fixture(scope="module")
def static_fp8_kv_checkpoint(tmp_path_factory) -> Path:
    """compressed-tensors FP8 (static per-tensor activations: an ``input_scale`` per layer) with KV scales."""
    pytest.importorskip("compressed_tensors")
    folder = tmp_path_factory.mktemp("static_fp8_kv")
    return qc.ct_checkpoint(qc.hf_model("qwen3", qc.ALIGNED), folder / "q", "FP8", architecture="Qwen3ForCausalLM",
                            kv_cache=True)


def _edited_copy(source: Path, folder: Path, edit) -> Path:
    """A copy of checkpoint ``source`` whose tensors ``edit`` (a function of the name -> tensor dict) changed."""
    shutil.copytree(source, folder)
    tensors = stored(folder)
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("name, factor, message", [
    ("model.layers.1.mlp.down_proj.input_scale", 0.0, "1 of 1 input scales are <= 0"),
    ("model.layers.1.self_attn.o_proj.input_scale", -1.0, "1 of 1 input scales are <= 0"),
    ("model.layers.1.mlp.down_proj.weight_scale", -1.0, "1 of 1 weight scales are negative"),
])
def test_a_scale_that_would_make_nan_or_flip_signs_is_refused_naming_the_tensor(static_fp8_kv_checkpoint, tmp_path,
                                                                                 name, factor, message):
    def edit(tensors):
        tensors[name] = tensors[name] * factor

    bad = _edited_copy(static_fp8_kv_checkpoint, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=rf"^checkpoint tensor '{re.escape(name)}' in .*: {message}"):
        load_model(bad, dtype=torch.float32, device="cpu")


def test_a_per_channel_scale_of_the_wrong_shape_is_reported_with_its_stored_shape(bf16_checkpoint, tmp_path):
    quantized = _offline_copy(bf16_checkpoint, tmp_path / "q", "FP8_DYNAMIC", FP8_PER_CHANNEL)
    name = "model.layers.0.mlp.down_proj.weight_scale"

    def edit(tensors):
        tensors[name] = tensors[name][:1, 0].contiguous()  # one value, stored [1]

    bad = _edited_copy(quantized, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=rf"'{re.escape(name)}'.*checkpoint tensor has shape \(1,\), "
                                         rf"expected \(256, 1\)"):
        load_model(bad, dtype=torch.float32, device="cpu")


def test_a_zero_weight_scale_loads_with_a_warning_naming_the_tensor(static_fp8_kv_checkpoint, tmp_path, caplog):
    name = "model.layers.0.self_attn.o_proj.weight_scale"

    def edit(tensors):
        tensors[name] = torch.zeros_like(tensors[name])

    path = _edited_copy(static_fp8_kv_checkpoint, tmp_path / "zero", edit)
    with caplog.at_level(logging.WARNING, logger="atom_core.models.checkpoint_scales"):
        model = load_model(path, dtype=torch.float32, device="cpu")
    assert re.search(rf"'{re.escape(name)}' in .*: 1 of 1 weight scales are 0", caplog.text)
    assert torch.count_nonzero(model.model.layers[0].self_attn.o_proj.weight_scale) == 0


def test_a_declared_fp8_kv_cache_with_layers_missing_scales_is_warned_naming_them(static_fp8_kv_checkpoint, tmp_path,
                                                                                  caplog):
    with caplog.at_level(logging.WARNING, logger="atom_core.models.checkpoint_scales"):
        load_model(static_fp8_kv_checkpoint, dtype=torch.float32, device="cpu")
    assert "FP8 KV cache" not in caplog.text  # every layer has its scales
    caplog.clear()

    def edit(tensors):
        del tensors["model.layers.1.self_attn.k_scale"], tensors["model.layers.1.self_attn.v_scale"]

    path = _edited_copy(static_fp8_kv_checkpoint, tmp_path / "partial", edit)
    with caplog.at_level(logging.WARNING, logger="atom_core.models.checkpoint_scales"):
        model = load_model(path, dtype=torch.float32, device="cpu")
    assert "declares an FP8 KV cache, but 1 of 2 attention layers have no KV-cache scale (layers 1)" in caplog.text
    assert model.kv_cache_scales()[1] == (None, None) and model.kv_cache_scales()[0][0] is not None


def test_online_quantization_of_a_quantized_checkpoint_or_an_unknown_name_is_refused(bf16_checkpoint, tmp_path):
    quantized = _offline_copy(bf16_checkpoint, tmp_path / "q", "FP8_DYNAMIC", FP8_PER_CHANNEL)
    with pytest.raises(UnsupportedQuantizationError, match="already quantized.*compressed-tensors.*drop the quantization argument"):
        load_model(quantized, device="cpu", quantization="fp8")
    with pytest.raises(UnsupportedQuantizationError, match="quantization='int4' is not supported"):
        load_model(bf16_checkpoint, device="cpu", quantization="int4")


def test_fp8_tensors_load_only_into_fp8_layers(bf16_checkpoint, tmp_path):
    """A model built without the checkpoint's quantization (``build_model`` of its config minus
    ``quantization_config``) refuses its FP8 weights instead of casting them without their scales."""
    from atom_core.models import build_model, load_weights

    quantized = _offline_copy(bf16_checkpoint, tmp_path / "q", "FP8_DYNAMIC", FP8_PER_CHANNEL)
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    plain = build_model(config, device="cpu", load_format="zeros")
    with pytest.raises(ValueError, match=r"_proj.weight.*float8_e4m3fn.*FP8 values load only into a quantized layer"):
        load_weights(plain, quantized)


def test_a_config_that_quantizes_the_lm_head_is_refused_naming_it_before_any_tensor_is_read(tmp_path, monkeypatch):
    """compressed-tensors with target Linear and no ignore list quantizes lm_head too (llm-compressor does, given
    a recipe without one); the model keeps its LM head unquantized."""
    from atom_core.models import loader

    folder = qc.ct_checkpoint(qc.hf_model("llama", qc.ODD), tmp_path / "ct", "FP8_DYNAMIC",
                              architecture="LlamaForCausalLM", ignore=())
    reads = []
    read = loader.get_tensor
    monkeypatch.setattr(loader, "get_tensor", lambda f, name, file: reads.append(name) or read(f, name, file))
    with pytest.raises(ValueError, match=r"'lm_head.weight'.*float8_e4m3fn.*quantizes this layer \(config_groups"
                                         r".*keeps it unquantized"):
        load_model(folder, device="cpu", dtype=torch.float32)
    assert reads == []


# --- MoE: quantized experts -------------------------------------------------------------------------------
#
# compressed-tensors quantizes the checkpoint's own expert projections (``quant_checkpoints.ct_tree_checkpoint``:
# transformers 5 holds experts as stacked 3-D parameters, which a tool targeting Linear modules never sees),
# with the router gates ignored as llm-compressor's MoE recipes do. The bar is the one derived above,
# 2 sqrt(G) delta, with G counting the quantized GEMMs on a token's path: per dense layer qkv, o, gate_up,
# down; per sparse layer the experts' gate_up and down (2, not 2 K: a token's K experts each add an
# independent error to a routing-weighted sum whose weights add up to at most 1, so their sum's RMS error is
# at most one expert's) and, with shared experts, their 2 more. Measured: 0.015 - 0.018 (experts only, bar
# 0.14), 0.061 - 0.118 (everything, bars 0.20 - 0.25).

EXPERTS_ONLY = (r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$",)
# Layer 0 dense, layers 1-2 sparse (4 experts, top 2): every part of every layer whole 128-blocks.
QWEN3_MOE = {**qc.ALIGNED, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
             "num_hidden_layers": 3, "mlp_only_layers": [0], "norm_topk_prob": True}
MIXTRAL = {**qc.ALIGNED, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128}
# Layer 0 dense, layer 1 sparse with a shared expert; 2 groups of 4 experts.
GLM4_MOE = {**qc.ALIGNED, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}


@dataclass(frozen=True)
class MoECase:
    name: str
    family: str
    architecture: str
    sizes: dict
    preset: str                  # compressed-tensors preset
    targets: tuple[str, ...]     # what it quantizes (EXPERTS_ONLY: the dense layers stay unquantized)
    expert_format: str
    gemms: int                   # G of the bound
    hf_fp8: bool = False         # rewritten as an HF fp8 block checkpoint (weight_scale_inv)


MOE_CASES = [
    MoECase("qwen3_moe_fp8_dynamic", "qwen3_moe", "Qwen3MoeForCausalLM", QWEN3_MOE, "FP8_DYNAMIC", ("Linear",),
            "fp8_channel", 3 * 4),
    MoECase("qwen3_moe_fp8_dynamic_experts_only", "qwen3_moe", "Qwen3MoeForCausalLM", QWEN3_MOE, "FP8_DYNAMIC",
            EXPERTS_ONLY, "fp8_channel", 2 * 2),
    MoECase("qwen3_moe_fp8_block", "qwen3_moe", "Qwen3MoeForCausalLM", QWEN3_MOE, "FP8_BLOCK", ("Linear",),
            "fp8_block", 3 * 4),
    MoECase("qwen3_moe_fp8_block_experts_only", "qwen3_moe", "Qwen3MoeForCausalLM", QWEN3_MOE, "FP8_BLOCK",
            EXPERTS_ONLY, "fp8_block", 2 * 2),
    MoECase("mixtral_hf_fp8_block", "mixtral", "MixtralForCausalLM", MIXTRAL, "FP8_BLOCK", ("Linear",),
            "fp8_block", 2 * 4, hf_fp8=True),
    MoECase("glm4_moe_shared_fp8_dynamic", "glm4_moe", "Glm4MoeForCausalLM", GLM4_MOE, "FP8_DYNAMIC", ("Linear",),
            "fp8_channel", 4 + 6),
]


@pytest.fixture(scope="module", params=MOE_CASES, ids=[c.name for c in MOE_CASES])
def moe_loaded(request, tmp_path_factory) -> Loaded:
    from tests.models.moe_parity import build_moe_pair
    from tests.models.parity_harness import ParityCase

    case = request.param
    folder = tmp_path_factory.mktemp(case.name)
    pair = build_moe_pair(ParityCase(case.name, case.family, case.architecture, case.sizes), folder / "fp32")
    path = qc.ct_tree_checkpoint(pair.path, folder / "quantized", case.preset, targets=case.targets)
    if case.hf_fp8:
        config = json.loads((path / "config.json").read_text())
        qc.as_hf_fp8_block(path, not_convert=tuple(config["quantization_config"]["ignore"]))
    deq = qc.dequantized_checkpoint(path, folder / "dequantized")
    return Loaded(case, path, load_model(path, dtype=torch.float32, device="cpu"),
                  load_model(deq, dtype=torch.float32, device="cpu"))


def effective_experts(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) the fused-MoE op multiplies by: stored values times their scales, each expert."""
    from atom_core.ops.reference.moe import dequantize_weight

    return tuple(torch.stack([dequantize_weight(w[e], scale[e], experts.weight_format) for e in range(w.shape[0])])
                 for w, scale in ((experts.w13_weight, experts.w13_weight_scale),
                                  (experts.w2_weight, experts.w2_weight_scale)))


def test_quantized_experts_keep_the_stored_fp8_and_their_effective_weights_are_the_dequantized_ones(moe_loaded):
    from atom_core.models.layers.moe import FusedMoE

    case = moe_loaded.case
    deq = dict(moe_loaded.dequantized.named_modules())
    experts = {name: m for name, m in moe_loaded.quantized.named_modules() if isinstance(m, FusedMoE)}
    assert experts
    for name, layer in experts.items():
        assert layer.weight_format == case.expert_format, name
        assert layer.w13_weight.dtype == layer.w2_weight.dtype == torch.float8_e4m3fn
        w13, w2 = effective_experts(layer)
        assert torch.equal(w13, deq[name].w13_weight) and torch.equal(w2, deq[name].w2_weight), name
    dense = {name: layer.scheme.is_quantized for name, layer in linear_layers(moe_loaded.quantized).items()
             if not name.endswith(".mlp.gate")}  # (routers: unquantized by construction)
    assert all(dense.values()) if case.targets == ("Linear",) else not any(dense.values())


def test_moe_logits_match_the_dequantized_model_within_the_activation_quantization_bound(moe_loaded):
    actual, expected = model_logits(moe_loaded.quantized), model_logits(moe_loaded.dequantized)
    relative = ((actual - expected).norm() / expected.norm()).item()
    bound = 2 * math.sqrt(moe_loaded.case.gemms) * FP8_DELTA
    assert FP8_DELTA / 10 < relative <= bound, f"relative RMS logit error {relative:.4g}, bound {bound:.4g}"


def test_moe_models_norms_and_silu_quantize_for_the_next_layer_and_the_logits_equal_the_unfused_path(moe_loaded):
    check_fused_input_quantization(moe_loaded)


def test_experts_with_static_activation_scales_are_refused_by_name(tmp_path):
    """The fused MoE quantizes its activations itself: a static input scale has nowhere to go."""
    from tests.models.moe_parity import build_moe_pair
    from tests.models.parity_harness import ParityCase

    case = MOE_CASES[1]
    pair = build_moe_pair(ParityCase(case.name, case.family, case.architecture, case.sizes), tmp_path / "fp32")
    path = qc.ct_tree_checkpoint(pair.path, tmp_path / "q", "FP8_DYNAMIC", targets=EXPERTS_ONLY)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(
        dynamic=False, strategy="tensor")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError,
                       match=re.escape(f"{path / 'config.json'}: layer 'model.layers.1.mlp.experts': MoE experts "
                                       "quantized as FP8 e4m3 per-channel weights, static per tensor activations "
                                       "are not served")):
        load_model(path, device="cpu")


def test_online_fp8_quantizes_the_experts_too(tmp_path):
    """``quantization="fp8_block"`` on an unquantized MoE checkpoint: experts and dense layers in FP8, each
    expert's stored values the ``quantize_weight`` of its unquantized weights."""
    from tests.models.moe_parity import build_moe_pair
    from tests.models.parity_harness import ParityCase

    case = MOE_CASES[0]
    pair = build_moe_pair(ParityCase(case.name, case.family, case.architecture, case.sizes), tmp_path / "fp32")
    model = load_model(pair.path, dtype=torch.float32, device="cpu", quantization="fp8_block")
    experts = model.model.layers[1].mlp.experts
    assert experts.weight_format == "fp8_block"
    assert all(layer.scheme == BLOCK_FP8 for name, layer in linear_layers(model).items() if not name.endswith(".gate"))
    hf = pair.hf_model.model.layers[1].mlp.experts
    for e in (0, 3):
        q, scale = quantize_weight(hf.gate_up_proj[e], FP8_BLOCK_128)  # HF's [gate; up] rows: this layout
        assert torch.equal(experts.w13_weight[e].float(), q.float()) and torch.equal(experts.w13_weight_scale[e], scale)
        q, scale = quantize_weight(hf.down_proj[e], FP8_BLOCK_128)
        assert torch.equal(experts.w2_weight[e].float(), q.float()) and torch.equal(experts.w2_weight_scale[e], scale)
