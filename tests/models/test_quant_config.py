"""QuantConfig: every format parsed from configs written by the tools that write them.

compressed-tensors configs come from ``ModelCompressor.update_config`` (what llm-compressor saves
into config.json), Quark configs from Quark's own safetensors exporters
(``QuarkSafetensorsExporter`` / ``CustomSafetensorsExporter._prepare_quantization_config``) over
``LLMTemplate`` configs, HF configs from transformers' ``FineGrainedFP8Config`` / ``Mxfp4Config``.
A test that edits a written dict by hand says so and why.
"""

import json
import tempfile
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from atom_core.models import get_model_class
from atom_core.models.base import DEFAULT_PACKED_MODULES_MAPPING
from atom_core.models.config import ModelConfig
from atom_core.models.layers.moe import expert_params_mapping, fused_expert_params_mapping
from atom_core.models.loader import load_weights
from atom_core.models.quantization import (
    FP8_BLOCK_128,
    FP8_KV_CACHE,
    FP8_PER_CHANNEL,
    FP8_PER_TENSOR,
    INT8_PER_CHANNEL,
    MXFP4_E2M1,
    UNQUANTIZED,
    ActivationScheme,
    LinearScheme,
    QuantMethod,
    UnsupportedQuantizationError,
    check_quantization_supported,
    parse_quant_config,
)

A = ActivationScheme
PACKED = DEFAULT_PACKED_MODULES_MAPPING
EXPERTS = expert_params_mapping(4)  # Qwen3-MoE style: experts.{e}.{gate,up,down}_proj
GPT_OSS_EXPERTS = fused_expert_params_mapping(bias=True) + [  # as GptOssForCausalLM builds it
    ("experts.gate_up_proj_blocks", "experts.w13_weight", None),
    ("experts.down_proj_blocks", "experts.w2_weight", None)]
QKV, O_PROJ, GATE_UP, DOWN = ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                              "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj")
MOE, ROUTER, HEAD = "model.layers.1.mlp.experts", "model.layers.1.mlp.gate", "lm_head"
FP8_BLOCK = LinearScheme(QuantMethod.FP8, FP8_BLOCK_128, A.DYNAMIC_PER_GROUP_128)
MXFP4 = LinearScheme(QuantMethod.MXFP4, MXFP4_E2M1, A.NONE)
PTPC = LinearScheme(QuantMethod.FP8, FP8_PER_CHANNEL, A.DYNAMIC_PER_TOKEN)
DEEPSEEK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def scheme(config, layer):
    """The layer's scheme as a model asks for it (both mappings passed for every layer)."""
    return config.scheme_for(layer, PACKED, expert_params_mapping=EXPERTS)


# --- Hugging Face fp8 / mxfp4 ---


def test_hf_fp8_block_config_quantizes_every_linear_but_the_excluded_ones_to_block_fp8():
    from transformers import FineGrainedFP8Config
    skip = ["lm_head", "model.layers.1.mlp.gate"]
    by_transformers = json.loads(FineGrainedFP8Config(modules_to_not_convert=skip).to_json_string())
    config = parse_quant_config({**DEEPSEEK_FP8, "modules_to_not_convert": skip})
    assert parse_quant_config(by_transformers) == config
    for layer in (QKV, O_PROJ, GATE_UP, DOWN, MOE):
        assert scheme(config, layer) == FP8_BLOCK
    assert scheme(config, HEAD) == UNQUANTIZED and scheme(config, ROUTER) == UNQUANTIZED
    assert config.kv_cache is None


@pytest.mark.parametrize("activation, expected", [("dynamic", A.DYNAMIC_PER_TENSOR), ("static", A.STATIC_PER_TENSOR)])
def test_hf_fp8_without_weight_block_size_is_per_tensor(activation, expected):
    config = parse_quant_config({"quant_method": "fp8", "activation_scheme": activation})
    assert scheme(config, QKV) == LinearScheme(QuantMethod.FP8, FP8_PER_TENSOR, expected)


def test_hf_modules_to_not_convert_matches_names_as_transformers_does():
    from transformers.quantizers.quantizers_utils import should_convert_module
    if not should_convert_module("model.layers.11.mlp.up_proj", ["model.layers.1"]):
        pytest.skip("this transformers matches a pattern without a module boundary (layer.1 matching layer.11, as "
                    "5.17 does); the rule followed is its later one")
    patterns = ["model.layers.1", "model.layers.*.self_attn", "mlp.gate", "down_proj", "lm_head"]
    names = ["model.layers.1.mlp.down_proj", "model.layers.11.mlp.up_proj", "model.layers.0.self_attn.q_proj",
             "model.layers.2.mlp.gate", "model.layers.2.mlp.gate_proj", "lm_head", "model.layers.3.mlp.up_proj"]
    for pattern in patterns:
        config = parse_quant_config({**DEEPSEEK_FP8, "modules_to_not_convert": [pattern]})
        for name in names:
            excluded = config.checkpoint_scheme(name)[0] == UNQUANTIZED
            assert excluded == (not should_convert_module(name, [pattern])), (pattern, name)


def test_hf_mxfp4_quantizes_the_experts_only():
    from transformers import Mxfp4Config
    skip = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
            "model.layers.1.mlp.experts"]
    config = parse_quant_config(json.loads(json.dumps(Mxfp4Config(modules_to_not_convert=skip).to_dict())))
    gpt_oss_experts = "model.layers.0.mlp.experts"
    assert config.scheme_for(gpt_oss_experts, PACKED, expert_params_mapping=GPT_OSS_EXPERTS) == MXFP4
    assert scheme(config, "model.layers.2.mlp.experts") == MXFP4      # per-expert checkpoint names
    assert scheme(config, MOE) == UNQUANTIZED                         # layer 1's experts excluded
    for layer in (QKV, O_PROJ, GATE_UP, "model.layers.0.mlp.router", HEAD):
        assert scheme(config, layer) == UNQUANTIZED


# --- compressed-tensors ---


def _ct():
    """compressed-tensors' quantization module (a test dependency: the ``test`` extra)."""
    return pytest.importorskip("compressed_tensors.quantization")


def ct_preset(name, targets=("Linear",)):
    return _ct().preset_name_to_scheme(name, list(targets))


def ct_written(groups, *, ignore=(), kv_cache=None, fmt="float-quantized", status="compressed") -> dict:
    """``quantization_config`` exactly as compressed-tensors writes it into config.json."""
    qc = _ct().QuantizationConfig(config_groups=groups, ignore=list(ignore), kv_cache_scheme=kv_cache, format=fmt,
                                  quantization_status=status)
    from compressed_tensors.compressors import ModelCompressor
    with tempfile.TemporaryDirectory() as folder:
        ModelCompressor(quantization_config=qc).update_config(folder)
        return json.loads((Path(folder) / "config.json").read_text())["quantization_config"]


def ct_args(**kwargs):
    return _ct().QuantizationArgs(**kwargs)


def ct_scheme(weights=None, inputs=None, outputs=None, targets=("Linear",)):
    return _ct().QuantizationScheme(targets=list(targets), weights=weights, input_activations=inputs,
                                    output_activations=outputs)


@pytest.mark.parametrize("preset, fmt, expected", [
    ("FP8", "float-quantized", LinearScheme(QuantMethod.FP8, FP8_PER_TENSOR, A.STATIC_PER_TENSOR)),
    ("FP8_DYNAMIC", "float-quantized", PTPC),
    ("FP8_BLOCK", "float-quantized", FP8_BLOCK),
    ("W8A8", "int-quantized", LinearScheme(QuantMethod.INT8, INT8_PER_CHANNEL, A.DYNAMIC_PER_TOKEN)),
])
def test_compressed_tensors_preset_maps_to_its_scheme_and_ignored_layers_stay_unquantized(preset, fmt, expected):
    config = parse_quant_config(ct_written({"group_0": ct_preset(preset)}, ignore=["lm_head", "re:.*mlp.gate$"],
                                           fmt=fmt))
    for layer in (QKV, O_PROJ, GATE_UP, DOWN):
        assert scheme(config, layer) == expected
    assert scheme(config, HEAD) == UNQUANTIZED and scheme(config, ROUTER) == UNQUANTIZED
    if expected.method is QuantMethod.FP8:
        assert scheme(config, MOE) == expected
    assert config.quant_method == "compressed-tensors" and config.kv_cache is None


def test_compressed_tensors_name_targets_win_over_linear_whatever_the_group_order():
    int8 = LinearScheme(QuantMethod.INT8, INT8_PER_CHANNEL, A.DYNAMIC_PER_TOKEN)
    groups = {"group_0": ct_preset("W8A8"),
              "group_1": ct_preset("FP8_DYNAMIC", [r"re:.*self_attn\.(q|k|v|o)_proj$", DOWN])}
    config = parse_quant_config(ct_written(groups, fmt="mixed-precision"))
    assert scheme(config, QKV) == PTPC and scheme(config, O_PROJ) == PTPC and scheme(config, DOWN) == PTPC
    assert scheme(config, GATE_UP) == int8 and scheme(config, "model.layers.2.mlp.down_proj") == int8


def test_compressed_tensors_kv_cache_scheme_is_an_fp8_kv_cache_and_others_are_refused():
    fp8_kv = ct_args(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    config = parse_quant_config(ct_written({"group_0": ct_preset("FP8_DYNAMIC")}, kv_cache=fp8_kv))
    assert config.kv_cache == FP8_KV_CACHE
    for kv, message in ((ct_args(num_bits=8, type="float", strategy="attn_head"), "kv_cache_scheme.*'attn_head'"),
                        (ct_args(num_bits=8, type="int", strategy="tensor"), "8-bit int KV cache")):
        with pytest.raises(UnsupportedQuantizationError, match=message):
            parse_quant_config(ct_written({"group_0": ct_preset("FP8_DYNAMIC")}, kv_cache=kv))


def _static_per_channel_activations():
    """Hand-edited: compressed-tensors refuses to build channel-strategy activations, so the written
    FP8_DYNAMIC dict gets ``strategy: channel, dynamic: false`` inputs (what an older tool could write)."""
    written = ct_written({"group_0": ct_preset("FP8_DYNAMIC")})
    written["config_groups"]["group_0"]["input_activations"].update(strategy="channel", dynamic=False)
    return written


def _sparse():
    """Hand-edited: this compressed-tensors writes ``sparsity_config: {}`` always; older versions
    wrote the 2:4 sparsity format there."""
    return {**ct_written({"group_0": ct_preset("FP8_DYNAMIC")}), "sparsity_config": {"format": "sparse-24-bitmask"}}


FP8_WEIGHTS = dict(num_bits=8, type="float", strategy="channel")
CT_REFUSED = {
    "int4": (lambda: ct_written({"group_0": ct_preset("W4A16")}, fmt="pack-quantized"), "4-bit int weights"),
    "int8-asymmetric-weights": (lambda: ct_written({"group_0": ct_scheme(
        ct_args(num_bits=8, type="int", strategy="channel", symmetric=False),
        ct_args(num_bits=8, type="int", strategy="token", dynamic=True))}), "asymmetric 8-bit int weights"),
    "nvfp4": (lambda: ct_written({"group_0": ct_preset("NVFP4")}), "4-bit float weights"),
    "mxfp4": (lambda: ct_written({"group_0": ct_preset("MXFP4")}), "4-bit float weights"),
    "fp8-weight-only": (lambda: ct_written({"group_0": ct_scheme(ct_args(**FP8_WEIGHTS))}), "weight-only"),
    "int8-asymmetric-activations": (lambda: ct_written({"group_0": ct_scheme(
        ct_args(num_bits=8, type="int", strategy="channel"),
        ct_args(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=False))}),
        "asymmetric 8-bit int activations"),
    "int8-per-tensor-weights": (lambda: ct_written({"group_0": ct_scheme(
        ct_args(num_bits=8, type="int", strategy="tensor"),
        ct_args(num_bits=8, type="int", strategy="token", dynamic=True))}), "INT8 weights with strategy 'tensor'"),
    "fp8-group-weights": (lambda: ct_written({"group_0": ct_scheme(
        ct_args(num_bits=8, type="float", strategy="group", group_size=128),
        ct_args(num_bits=8, type="float", strategy="token", dynamic=True))}), "FP8 weights with strategy 'group'"),
    "block-64": (lambda: ct_written({"group_0": ct_scheme(
        ct_args(num_bits=8, type="float", strategy="block", block_structure=[64, 64]),
        ct_args(num_bits=8, type="float", strategy="group", group_size=64, dynamic=True))}), r"blocks of \[64, 64\]"),
    "block-with-per-token": (lambda: ct_written({"group_0": ct_scheme(
        ct_args(num_bits=8, type="float", strategy="block", block_structure=[128, 128]),
        ct_args(num_bits=8, type="float", strategy="token", dynamic=True))}),
        r"per-block \[128, 128\] weights with dynamic per token activations"),
    "static-per-channel-activations": (_static_per_channel_activations, "static channel activations"),
    "activation-group-64": (lambda: ct_written({"group_0": ct_scheme(
        ct_args(num_bits=8, type="float", strategy="block", block_structure=[128, 128]),
        ct_args(num_bits=8, type="float", strategy="group", group_size=64, dynamic=True))}),
        r"dynamic group activations \(group size 64\)"),
    "output-activations": (lambda: ct_written({"group_0": ct_scheme(
        ct_args(**FP8_WEIGHTS), ct_args(num_bits=8, type="float", strategy="token", dynamic=True),
        ct_args(num_bits=8, type="float"))}), "output activation quantization"),
    "class-target": (lambda: ct_written({"group_0": ct_preset("FP8_DYNAMIC", ["Qwen3MoeSparseMoeBlock"])}),
                     "'Qwen3MoeSparseMoeBlock' \\(a module class\\)"),
    "dense-format": (lambda: ct_written({"group_0": ct_preset("FP8_DYNAMIC")}, fmt="dense"), "format 'dense'"),
    "sparsity": (_sparse, "sparsity_config: not supported: sparsity"),
    "uncompressed-export": (lambda: ct_written({"group_0": ct_preset("FP8_DYNAMIC")}, status="frozen"),
                            "quantization_status: not supported: status 'frozen'.*saved uncompressed"),
}


@pytest.mark.parametrize("case", CT_REFUSED, ids=list(CT_REFUSED))
def test_compressed_tensors_unsupported_combination_is_refused_by_name_with_the_file(case):
    build, message = CT_REFUSED[case]
    with pytest.raises(UnsupportedQuantizationError, match=f"^ckpt/config.json: quantization_config.*{message}"):
        parse_quant_config(build(), source_file="ckpt/config.json")


# --- AMD Quark ---


@pytest.fixture(scope="session")
def quark():
    """Quark's template and exporters; the export dict is what its safetensors export writes."""
    pytest.importorskip("quark.torch")
    from quark.torch import LLMTemplate
    from quark.torch.export.api import CustomSafetensorsExporter, QuarkSafetensorsExporter
    from quark.torch.export.config.config import JsonExporterConfig
    from quark.torch.quantization.config import config as qcfg

    def export(qconfig, custom_mode=None, **json_overrides):
        # SafetensorsExporter.export: the KV group is recorded only when the KV cache is quantized.
        kv_group = qconfig.kv_cache_group if qconfig.kv_cache_quant_config else []
        json_config = JsonExporterConfig(kv_cache_group=kv_group, min_kv_scale=qconfig.min_kv_scale, **json_overrides)
        if custom_mode is None:
            return QuarkSafetensorsExporter._prepare_quantization_config(None, qconfig, json_config)
        exporter = types.SimpleNamespace(custom_mode=custom_mode)
        return CustomSafetensorsExporter._prepare_quantization_config(exporter, qconfig, json_config)

    return types.SimpleNamespace(template=LLMTemplate.get, export=export, config=qcfg)


def test_quark_fp8_template_with_fp8_kv_cache(quark):
    written = quark.export(quark.template("llama").get_config(scheme="fp8", kv_cache_scheme="fp8"))
    assert set(written["layer_quant_config"]) == {"*k_proj", "*v_proj"}  # the KV layers carry output scales
    config = parse_quant_config(written)
    static_fp8 = LinearScheme(QuantMethod.FP8, FP8_PER_TENSOR, A.STATIC_PER_TENSOR)
    for layer in (QKV, O_PROJ, GATE_UP, DOWN):
        assert scheme(config, layer) == static_fp8
    assert scheme(config, HEAD) == UNQUANTIZED and config.kv_cache == FP8_KV_CACHE
    # Hand-edited: an older export without kv_cache_quant_config names the KV layers in export.kv_cache_group.
    assert parse_quant_config({**written, "kv_cache_quant_config": {}}).kv_cache == FP8_KV_CACHE
    without_kv = parse_quant_config(quark.export(quark.template("llama").get_config(scheme="fp8")))
    assert without_kv.kv_cache is None and without_kv.default == static_fp8


def test_quark_fp8_export_mode_writes_hf_fp8_with_ignored_layers_and_kv_cache(quark):
    qconfig = quark.template("qwen3_moe").get_config(scheme="fp8", kv_cache_scheme="fp8")
    written = quark.export(qconfig, custom_mode="fp8")
    assert written["quant_method"] == "fp8" and written["ignored_layers"] == ["lm_head", "*.gate"]
    config = parse_quant_config(written)
    assert scheme(config, QKV) == LinearScheme(QuantMethod.FP8, FP8_PER_TENSOR, A.STATIC_PER_TENSOR)
    assert scheme(config, ROUTER) == UNQUANTIZED and scheme(config, HEAD) == UNQUANTIZED
    assert config.kv_cache == FP8_KV_CACHE


def test_quark_rules_apply_in_quark_order_exclude_then_patterns_then_type_then_global(quark):
    qconfig = quark.template("qwen3_moe").get_config(
        scheme="ptpc_fp8", layer_config={"*.experts.*": "mxfp4_weight_only", "*down_proj": "ptpc_fp8"},
        layer_type_config={nn.Linear: "fp8"})
    config = parse_quant_config(quark.export(qconfig))
    assert scheme(config, MOE) == MXFP4                         # first pattern, experts' down_proj included
    assert scheme(config, DOWN) == PTPC                         # pattern over type
    assert scheme(config, QKV) == LinearScheme(QuantMethod.FP8, FP8_PER_TENSOR, A.STATIC_PER_TENSOR)  # type
    assert scheme(config, ROUTER) == UNQUANTIZED                # exclude "*.gate" first


def test_quark_ptpc_and_block_fp8_as_quark_converts_hf_block_checkpoints(quark):
    config = parse_quant_config(quark.export(quark.template("qwen3").get_config(scheme="ptpc_fp8")))
    assert scheme(config, QKV) == PTPC and scheme(config, MOE) == PTPC
    from quark.torch.export.prequantized_config_converter import FP8LinearConfigConverter
    from quark.torch.quantization.config.type import Dtype
    converter = FP8LinearConfigConverter()
    layer = quark.config.QLayerConfig(
        weight=converter._build_weight_config(Dtype.fp8_e4m3, True, [128, 128]),
        input_tensors=converter._build_input_config(Dtype.fp8_e4m3, True, True, [128, 128]))
    config = parse_quant_config(quark.export(quark.config.QConfig(global_quant_config=layer, exclude=["lm_head"])))
    assert scheme(config, QKV) == FP8_BLOCK and scheme(config, HEAD) == UNQUANTIZED


QUARK_REFUSED = {
    "int8-per-tensor": (dict(scheme="int8"), "global_quant_config.weight: not supported: int8 weights per_tensor"),
    "mxfp4-w4a4": (dict(scheme="mxfp4"), "fp4 activations with MXFP4 weights"),
    "mxfp4-fp8": (dict(scheme="mxfp4_fp8"), "fp8_e4m3 activations with MXFP4 weights"),
    "int4": (dict(scheme="int4_wo_128"), "int4 weights"),
    "amdfp4": (dict(scheme="amdfp4"), "group_size 16 with 'e5m3' scales"),
    "nvfp4": (dict(scheme="nvfp4"), "a list of specs"),
    "attention-fp8": (dict(scheme="fp8", attention_scheme="fp8"), "softmax_quant_spec"),
}


@pytest.mark.parametrize("case", QUARK_REFUSED, ids=list(QUARK_REFUSED))
def test_quark_unsupported_scheme_is_refused_by_name(quark, case):
    kwargs, message = QUARK_REFUSED[case]
    written = quark.export(quark.template("llama").get_config(**kwargs))
    with pytest.raises(UnsupportedQuantizationError, match=f"^m/config.json: quantization_config.*{message}"):
        parse_quant_config(written, source_file="m/config.json")


def test_quark_e5m2_fake_quantized_export_online_rotation_and_output_quantization_are_refused(quark):
    e5m2 = quark.config.FP8E5M2PerTensorSpec().to_quantization_spec()
    with pytest.raises(UnsupportedQuantizationError, match="weight: not supported: fp8_e5m2 weights"):
        parse_quant_config(quark.export(quark.config.QConfig(
            global_quant_config=quark.config.QLayerConfig(weight=e5m2, input_tensors=e5m2))))
    fp8 = quark.template("llama").get_config(scheme="fp8")
    with pytest.raises(UnsupportedQuantizationError, match="weight_format: not supported: 'fake_quantized'"):
        parse_quant_config(quark.export(fp8, weight_format="fake_quantized"))
    fp8.algo_config = [quark.config.RotationConfig(scaling_layers={}, r4=True)]
    with pytest.raises(UnsupportedQuantizationError, match=r"online rotation \(r4\)"):
        parse_quant_config(quark.export(fp8))
    fp8.algo_config = [quark.config.RotationConfig(scaling_layers={}), quark.config.SmoothQuantConfig()]
    assert parse_quant_config(quark.export(fp8)) is not None  # offline rotation, smoothing: baked in
    spec = fp8.global_quant_config.weight
    fp8.global_quant_config = quark.config.QLayerConfig(weight=spec, input_tensors=spec, output_tensors=spec)
    with pytest.raises(UnsupportedQuantizationError, match="output quantization outside the KV cache layers"):
        parse_quant_config(quark.export(fp8))


# --- per-layer rules: packed layers and experts ---


def test_rules_written_for_the_parts_reach_the_packed_layer():
    targets = [r"re:.*\.q_proj$", r"re:.*\.k_proj$", r"re:.*\.v_proj$", r"re:.*\.(gate|up)_proj$"]
    config = parse_quant_config(ct_written({"group_0": ct_preset("FP8_DYNAMIC", targets)}))
    assert scheme(config, QKV) == PTPC and scheme(config, GATE_UP) == PTPC
    assert scheme(config, O_PROJ) == UNQUANTIZED and scheme(config, DOWN) == UNQUANTIZED
    split = {"qkv": [("q_proj", 4), ("k_proj", 2), ("v_proj", 2)]}  # checkpoint fuses what the model splits
    config = parse_quant_config(ct_written({"group_0": ct_preset("FP8_DYNAMIC", ["model.layers.0.attn.qkv"])}))
    assert config.scheme_for("model.layers.0.attn.k_proj", split) == PTPC
    assert config.scheme_for("model.layers.1.attn.k_proj", split) == UNQUANTIZED


def test_packed_parts_that_disagree_are_refused_naming_each_part(quark):
    written = quark.export(quark.template("llama").get_config(
        scheme="fp8", exclude_layers=["lm_head", "model.layers.0.self_attn.k_proj"]))
    config = parse_quant_config(written, source_file="m/config.json")
    with pytest.raises(UnsupportedQuantizationError,
                       match=r"^m/config.json: .*'model.layers.0.self_attn.qkv_proj'.*q_proj \(default\), "
                             r"v_proj \(default\) -> FP8.*k_proj \(exclude 'model.layers.0.self_attn.k_proj'\) "
                             r"-> unquantized"):
        scheme(config, QKV)
    assert scheme(config, "model.layers.1.self_attn.qkv_proj").method is QuantMethod.FP8


def test_one_excluded_expert_makes_its_experts_layer_refused():
    config = parse_quant_config(ct_written({"group_0": ct_preset("FP8_BLOCK")},
                                           ignore=["model.layers.1.mlp.experts.2.down_proj"]))
    with pytest.raises(UnsupportedQuantizationError, match=r"experts.0.gate_proj \(config_groups.group_0 target "
                                                           r"'Linear'\).* and 7 more -> FP8.*experts.2.down_proj"):
        scheme(config, MOE)
    assert scheme(config, "model.layers.2.mlp.experts") == FP8_BLOCK


def test_mxfp4_outside_the_experts_and_int8_inside_them_are_refused(quark):
    config = parse_quant_config(quark.export(quark.template("qwen3_moe").get_config(scheme="mxfp4_weight_only")))
    assert scheme(config, MOE) == MXFP4
    with pytest.raises(UnsupportedQuantizationError, match="'model.layers.0.self_attn.qkv_proj' resolves to MXFP4.*"
                                                           "no dense linear layer serves"):
        scheme(config, QKV)
    config = parse_quant_config(ct_written({"group_0": ct_preset("W8A8")}, fmt="int-quantized"))
    with pytest.raises(UnsupportedQuantizationError, match="experts' resolves to INT8.*no MoE experts layer"):
        scheme(config, MOE)


# --- refusals of the HF format and unknown methods, the hash, the loader hook ---


HF_REFUSED = {
    "e5m2": ({"fmt": "e5m2"}, r"fmt: FP8 format 'e5m2'"),
    "block-64": ({"weight_block_size": [64, 64]}, r"weight_block_size: FP8 weight blocks of \[64, 64\]"),
    "block-static": ({"activation_scheme": "static"}, "with static per tensor activations are not supported"),
    "scale-fmt": ({"scale_fmt": "e8m0"}, "scale_fmt: 'e8m0' is not supported; only 'float' or 'ue8m0'"),
    "weight-only": ({"activation_scheme": None}, r"activation_scheme: null \(FP8 weight-only\)"),
    "fp4-experts": ({"expert_dtype": "fp4"}, "expert_dtype: 'fp4'"),
    "embeddings": ({"modules_to_convert": ["model.embed_tokens"]}, "modules_to_convert"),
    "dynamic-kv": ({"kv_cache_scheme": "dynamic"}, "kv_cache_scheme: 'dynamic'"),
}


@pytest.mark.parametrize("case", HF_REFUSED, ids=list(HF_REFUSED))
def test_hf_fp8_unsupported_combination_is_refused_naming_file_and_key(case):
    change, message = HF_REFUSED[case]
    with pytest.raises(UnsupportedQuantizationError, match=f"^/ckpt/config.json: quantization_config.*{message}"):
        parse_quant_config({**DEEPSEEK_FP8, **change}, source_file=Path("/ckpt/config.json"))


def test_hf_fp8_ue8m0_scale_format_loads_as_the_float_scheme():
    """DeepSeek-V3.1 / V3.2's ``scale_fmt: "ue8m0"``: fp32 power-of-two weight scales read as stored,
    activations scaled in fp32 (see parse_hf)."""
    assert parse_quant_config({**DEEPSEEK_FP8, "scale_fmt": "ue8m0"}) == parse_quant_config(DEEPSEEK_FP8)


def test_unknown_quant_method_is_refused_naming_it_and_the_file():
    with pytest.raises(UnsupportedQuantizationError, match="^/ckpt/config.json: quantization_config: "
                                                           "quant_method='awq' is not supported.*unquantised"):
        parse_quant_config({"quant_method": "awq", "bits": 4}, source_file="/ckpt/config.json")
    assert parse_quant_config(None) is None and parse_quant_config({}) is None


def _reordered(value):
    """Every dict with its keys in reverse order, every list of strings reversed."""
    if isinstance(value, dict):
        return {k: _reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(reversed(value))
    return [_reordered(v) for v in value] if isinstance(value, list) else value


def test_hash_is_equal_for_key_and_list_reorderings_and_differs_for_any_change():
    written = ct_written({"group_0": ct_preset("FP8_DYNAMIC")}, ignore=["lm_head", "re:.*mlp.gate$", HEAD + "2"])
    config = parse_quant_config(written, source_file="a/config.json")
    again = parse_quant_config(_reordered(written), source_file="b/config.json")
    assert again == config and again.hash == config.hash and len(config.hash) == 64
    others = [parse_quant_config(ct_written({"group_0": ct_preset("FP8_DYNAMIC")}, ignore=["lm_head"])),
              parse_quant_config(ct_written({"group_0": ct_preset("FP8_BLOCK")}, ignore=["lm_head"])),
              parse_quant_config(ct_written({"group_0": ct_preset("FP8_DYNAMIC")}, ignore=["lm_head"], kv_cache=ct_args(
                  num_bits=8, type="float", strategy="tensor"))),
              parse_quant_config(DEEPSEEK_FP8)]
    assert len({c.hash for c in [config, *others]}) == 5


def test_hash_of_a_deepseek_fp8_config_is_pinned():
    # A change here is a change of the canonical parsed form: caches keyed on the hash go stale.
    assert parse_quant_config(DEEPSEEK_FP8).hash == "787327942648c1de7f1a1a509b4d38710c6a9c59bd6f49f84ea22e4d4f715757"


class _Plain(nn.Module):
    def __init__(self, quantization_config):
        super().__init__()
        self.config = ModelConfig.from_dict({"architectures": ["PlainForCausalLM"], "vocab_size": 8, "hidden_size": 4,
                                             "num_hidden_layers": 1, "num_attention_heads": 1,
                                             "quantization_config": quantization_config})
        self.proj = nn.Linear(4, 4)


def test_load_weights_refuses_a_quantized_checkpoint_before_reading_any_tensor(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)  # corrupt: reading it would fail differently
    with pytest.raises(UnsupportedQuantizationError, match="quant_method='fp8'.*_Plain does not load.*unquantised"):
        load_weights(_Plain(DEEPSEEK_FP8), tmp_path)
    with pytest.raises(UnsupportedQuantizationError, match="fmt: FP8 format 'e5m2'"):
        load_weights(_Plain({**DEEPSEEK_FP8, "fmt": "e5m2"}), tmp_path)
    loads_fp8 = type("LoadsFp8", (_Plain,), {"supported_quantization": ("fp8",)})
    with pytest.raises(ValueError, match="corrupt safetensors header"):  # parsed, supported: on to the shards
        load_weights(loads_fp8(DEEPSEEK_FP8), tmp_path)


def test_check_quantization_supported_follows_the_architecture_list():
    mxfp4 = parse_quant_config({"quant_method": "mxfp4"})
    check_quantization_supported(mxfp4, get_model_class("GptOssForCausalLM"))
    check_quantization_supported(None, get_model_class("LlamaForCausalLM"))
    with pytest.raises(UnsupportedQuantizationError, match="^m: .*quant_method='mxfp4'.*LlamaForCausalLM does not"):
        check_quantization_supported(mxfp4, get_model_class("LlamaForCausalLM"), source="m")


# --- each format's precedence, against the tool that wrote the checkpoint ---


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(16, 16, bias=False))


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, name, nn.Linear(16, 16, bias=False))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = _Attention(), _Mlp()


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer() for _ in range(3)])


class _CausalLM(nn.Module):
    """The module names of a 3-layer Llama checkpoint (what the configs' targets are written against)."""

    def __init__(self):
        super().__init__()
        self.model, self.lm_head = _Model(), nn.Linear(16, 16, bias=False)


_LINEARS = [name for name, module in _CausalLM().named_modules() if isinstance(module, nn.Linear)]
_REGEXES = [r"re:.*self_attn\..*", r"re:.*proj$", r"re:.*layers\.1\..*", r"re:.*(q|k|v)_proj$", r"re:.*mlp\..*",
            r"re:model\.layers\.[02]\.mlp\.down_proj"]
_CT_PRESETS = {"W8A8": LinearScheme(QuantMethod.INT8, INT8_PER_CHANNEL, A.DYNAMIC_PER_TOKEN), "FP8_DYNAMIC": PTPC,
               "FP8": LinearScheme(QuantMethod.FP8, FP8_PER_TENSOR, A.STATIC_PER_TENSOR), "FP8_BLOCK": FP8_BLOCK}
_ct_targets = st.lists(st.one_of(st.sampled_from(_LINEARS), st.sampled_from(_REGEXES), st.just("Linear")),
                       min_size=1, max_size=3, unique=True)


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.tuples(st.sampled_from(sorted(_CT_PRESETS)), _ct_targets), min_size=1, max_size=3),
       ignore=st.lists(st.one_of(st.sampled_from(_LINEARS), st.sampled_from(_REGEXES)), max_size=2, unique=True))
def test_compressed_tensors_gives_each_layer_the_scheme_compressed_tensors_itself_applies(groups, ignore):
    ct = _ct()
    written = ct_written({f"group_{i}": ct_preset(preset, targets) for i, (preset, targets) in enumerate(groups)},
                         ignore=ignore, fmt="mixed-precision")
    model = _CausalLM()
    ct.apply_quantization_config(model, ct.QuantizationConfig.model_validate(written))
    def args(s):
        return s.weights.model_dump_json(), s.input_activations.model_dump_json()

    by_args = {args(ct_preset(p)): scheme for p, scheme in _CT_PRESETS.items()}
    config = parse_quant_config(written)
    for name in _LINEARS:
        applied = getattr(dict(model.named_modules())[name], "quantization_scheme", None)
        want = UNQUANTIZED if applied is None else by_args[args(applied)]
        assert config.checkpoint_scheme(name)[0] == want, name


_QUARK_GLOBS = ["*self_attn*", "*proj", "*layers.1.*", "*mlp*", "*q_proj", "model.layers.[02].*"]
_QUARK_SCHEMES = {("per_tensor", False): LinearScheme(QuantMethod.FP8, FP8_PER_TENSOR, A.STATIC_PER_TENSOR),
                  ("per_channel", True): PTPC}  # (weight qscheme, dynamic inputs) of the templates fp8, ptpc_fp8


@settings(max_examples=60, deadline=None)
@given(default=st.sampled_from(["fp8", "ptpc_fp8"]),
       layers=st.dictionaries(st.one_of(st.sampled_from(_LINEARS), st.sampled_from(_QUARK_GLOBS)),
                              st.sampled_from(["fp8", "ptpc_fp8"]), max_size=3),
       exclude=st.lists(st.one_of(st.sampled_from(_LINEARS), st.sampled_from(_QUARK_GLOBS)), max_size=2, unique=True))
def test_quark_gives_each_layer_the_scheme_quark_itself_applies(quark, default, layers, exclude):
    from quark.torch.quantization.model_transformation import setup_config_per_layer

    qconfig = quark.template("llama").get_config(scheme=default, layer_config=layers, exclude_layers=exclude)
    model = _CausalLM()
    applied: dict = {}
    setup_config_per_layer(qconfig, dict(model.named_modules()), applied)
    config = parse_quant_config(quark.export(qconfig))
    for name in _LINEARS:
        cfg = applied.get(name)
        want = UNQUANTIZED if cfg is None else _QUARK_SCHEMES[(cfg.weight.qscheme.value, cfg.input_tensors.is_dynamic)]
        assert config.checkpoint_scheme(name)[0] == want, name
