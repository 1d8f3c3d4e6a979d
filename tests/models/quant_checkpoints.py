"""Tiny quantized checkpoints written by the real tools, and their dequantized twins.

- compressed-tensors (``ct_checkpoint``): its quantization lifecycle on a tiny HF model:
  ``apply_quantization_config`` attaches the scheme's parameters, the scales come from
  ``calculate_qparams`` (the tool's own rule) on min/max observed here (weights per tensor / row /
  128 x 128 block; static input scales over the calibration tokens, through forward pre-hooks, the
  job llm-compressor's observers do), ``ModelCompressor`` quantizes and writes the tensors and
  ``config.json``. KV-cache scales: compressed-tensors 0.20 does not recognise transformers 5's
  attention (``forward(..., cache=...)``), so its KV hooks never attach; the config's
  ``kv_cache_scheme`` is the tool's, the per-layer ``self_attn.k_scale`` / ``v_scale`` tensors (the
  names ``initialize_attn_qparams`` gives them) are computed here: amax of the k_proj / v_proj
  outputs over the calibration tokens / 448, the k one times sqrt(2) (RoPE turns pairs, so a
  rotated component is at most sqrt(2) times the larger of its pair: no saturation).
- HF ``fp8`` with 128 x 128 blocks (``hf_fp8_block_checkpoint``): compressed-tensors' FP8_BLOCK
  tensors under HF's names (``weight_scale_inv``) and HF's config (the layouts are the same);
  ``deepseek_fp8_checkpoint`` does it for a DeepSeek-family checkpoint the way DeepSeek's FP8
  releases store theirs.
- AMD Quark (``quark_checkpoint``): ``ModelQuantizer`` with the model's ``LLMTemplate`` and
  ``export_safetensors`` (its calibration runs on the CPU in well under a second here).

``dequantized_checkpoint`` writes the same model with every quantized weight replaced by
``q.float() * scale`` (fp32) and no quantization config: the model the quantized one must match up
to activation quantization. It is written here from the stored tensors, independently of
atom_core's loaders.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.models.parity_harness import _HF_CLASSES, BASE_CONFIG, randomize_weights_

BLOCK = 128
FP8_MAX = 448.0
# Sizes for 128 x 128 blocks: every fused part (q | k | v, gate | up) whole blocks, also at TP 2.
ALIGNED = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 128}
# Sizes no block format takes: parts of 16 x 4 = 64 and 100 rows (per-tensor / per-channel / INT8).
ODD = {"hidden_size": 64, "intermediate_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16}


def hf_model(family: str, overrides: dict, *, seed: int = 0) -> torch.nn.Module:
    """A tiny HF model of ``family`` (llama / qwen3), fp32, randomised as the parity tests do."""
    import transformers

    config_name, model_name = _HF_CLASSES[family]
    config = getattr(transformers, config_name)(**copy.deepcopy({**BASE_CONFIG, **overrides}))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    randomize_weights_(model, seed)
    return model


def calibration_tokens(vocab_size: int, *, seed: int = 7, rows: int = 4, length: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))


def _set_architecture(folder: Path, architecture: str) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = [architecture]
    path.write_text(json.dumps(config, indent=2))


def _kv_amax(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, float]:
    """max |k_proj out| and max |v_proj out| per layer over ``tokens`` (names ``model.layers.{i}.self_attn.{k,v}``)."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            key = name[: -len("_proj")]
            hooks.append(module.register_forward_hook(
                lambda m, args, out, key=key: amax.__setitem__(key, max(amax.get(key, 0.0), out.abs().max().item()))))
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    return amax


def _set_weight_scales(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Each module compressed-tensors attached a scheme to gets its weight scale from ``calculate_qparams``
    (the tool's rule) on the min / max of its weight per tensor, row or 128 x 128 block (what
    llm-compressor's observers compute); quantization is disabled so calibration sees the unquantized
    model. Returns those modules by name."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
    from compressed_tensors.quantization.utils import calculate_qparams

    out = []
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        disable_quantization(module)
        w, args = module.weight.data, scheme.weights
        if args.strategy == QuantizationStrategy.TENSOR:
            lo, hi = w.amin(), w.amax()
        elif args.strategy == QuantizationStrategy.CHANNEL:
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:  # block
            rows, cols = w.shape
            tiles = torch.nn.functional.pad(w, (0, -cols % BLOCK, 0, -rows % BLOCK)).view(
                -(-rows // BLOCK), BLOCK, -(-cols // BLOCK), BLOCK)
            lo, hi = tiles.amin((1, 3)), tiles.amax((1, 3))
        scale, _ = calculate_qparams(lo, hi, args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        out.append((name, module))
    return out


def ct_checkpoint(model: torch.nn.Module, folder: Path, preset: str, *, architecture: str,
                  ignore: tuple[str, ...] = ("lm_head",), kv_cache: bool = False,
                  calib: torch.Tensor | None = None, targets: tuple[str, ...] = ("Linear",)) -> Path:
    """``model`` (left unchanged) quantized with compressed-tensors' ``preset`` (FP8, FP8_DYNAMIC,
    FP8_BLOCK, W8A8) for ``targets`` and saved to ``folder`` (see the module docstring)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(model)
    calib = calibration_tokens(model.config.vocab_size) if calib is None else calib
    kv_amax = _kv_amax(model, calib) if kv_cache else {}
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, list(targets))},
                                ignore=list(ignore))
    apply_quantization_config(model, config, show_progress=False)
    input_amax: dict[str, float] = {}
    hooks = []
    for name, module in _set_weight_scales(model):
        scheme = module.quantization_scheme
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, name=name: input_amax.__setitem__(
                    name, max(input_amax.get(name, 0.0), args[0].abs().max().item()))))
    if hooks:
        with torch.no_grad():
            model(calib)
        for hook in hooks:
            hook.remove()
        for name, module in model.named_modules():
            if name in input_amax:
                amax = torch.tensor(input_amax[name])
                scale, _ = calculate_qparams(-amax, amax, module.quantization_scheme.input_activations)
                module.input_scale.data = scale.reshape(module.input_scale.shape)
    fmt = "int-quantized" if preset.startswith("W8A8") else "float-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    kv_args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    if kv_cache:
        compressor.quantization_config.kv_cache_scheme = kv_args
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    _set_architecture(folder, architecture)
    if kv_amax:
        path = folder / "model.safetensors"
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
        for key, amax in kv_amax.items():  # key: model.layers.{i}.self_attn.{k,v}
            margin = math.sqrt(2.0) if key.endswith(".k") else 1.0
            tensors[f"{key}_scale"] = torch.tensor([amax * margin / FP8_MAX], dtype=torch.float32)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def checkpoint_tree(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose ``state_dict`` names are the checkpoint's: every 2-D ``*.weight`` (but the
    embedding's) an ``nn.Linear`` (with its ``.bias`` when stored), every other tensor a parameter of the
    module it names. transformers 5 keeps a MoE layer's experts as stacked 3-D parameters, which a
    quantization tool targeting ``Linear`` modules never sees; in this tree each stored expert projection
    (``mlp.experts.{e}.gate_proj``) is the ``nn.Linear`` it is in the released checkpoints' own models,
    so compressed-tensors quantizes experts exactly as it quantizes any linear layer."""
    root = torch.nn.Module()

    def module_at(path: list[str]) -> torch.nn.Module:
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        return module

    linear = {name for name, t in tensors.items()
              if name.endswith(".weight") and t.dim() == 2 and not name.endswith("embed_tokens.weight")}
    for name in sorted(linear):
        *path, leaf, _ = name.split(".")
        bias = tensors.get(name[: -len("weight")] + "bias")
        weight = tensors[name].float()
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        layer.weight.data = weight.clone()
        if bias is not None:
            layer.bias.data = bias.float().clone()
        module_at(path).add_module(leaf, layer)
    for name, tensor in tensors.items():
        if name in linear or (name.endswith(".bias") and name[: -len("bias")] + "weight" in linear):
            continue
        *path, leaf = name.split(".")
        module_at(path).register_parameter(leaf, torch.nn.Parameter(tensor.float().clone(), requires_grad=False))
    return root


def ct_tree_checkpoint(unquantized: Path, folder: Path, preset: str, *, targets: tuple[str, ...] = ("Linear",),
                       ignore: tuple[str, ...] = ("lm_head", r"re:.*(mlp|block_sparse_moe)\.gate$")) -> Path:
    """The fp32 checkpoint in folder ``unquantized`` quantized by compressed-tensors (``preset``: FP8_DYNAMIC
    or FP8_BLOCK, dynamic activations: no calibration data) through ``checkpoint_tree``: the tool attaches
    the scheme to the ``targets`` minus ``ignore`` (by default the LM head and the MoE routers, as
    llm-compressor's MoE recipes leave them), scales come from ``_set_weight_scales``,
    ``ModelCompressor`` quantizes the tensors and writes ``quantization_config`` into config.json."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    folder.mkdir(parents=True, exist_ok=True)
    with safe_open(str(unquantized / "model.safetensors"), "pt") as f:
        tree = checkpoint_tree({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (a safe_open handle)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, list(targets))},
                                ignore=list(ignore))
    apply_quantization_config(tree, config, show_progress=False)
    assert _set_weight_scales(tree), "no module was targeted"
    compressor = ModelCompressor.from_pretrained_model(tree, quantization_format="float-quantized")
    compressor.compress_model(tree)
    save_file({k: v.contiguous() for k, v in tree.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text((unquantized / "config.json").read_text())
    compressor.update_config(str(folder))
    return folder


def as_hf_fp8_block(ct_block: Path, *, not_convert: tuple[str, ...]) -> Path:
    """A compressed-tensors FP8_BLOCK checkpoint rewritten in place the way HF / DeepSeek fp8 checkpoints are
    stored: ``weight_scale_inv`` beside each FP8 weight and ``quant_method: "fp8"`` with 128 x 128 blocks,
    ``modules_to_not_convert`` naming the unquantized modules."""
    path = ct_block / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {(k + "_inv" if k.endswith(".weight_scale") else k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((ct_block / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": list(not_convert)}
    (ct_block / "config.json").write_text(json.dumps(config, indent=2))
    return ct_block


# Stored unquantized in DeepSeek's FP8 releases, with no rule saying so (their config has no
# modules_to_not_convert): the MoE routers, the LM head and DSA's indexer.weights_proj.
DEEPSEEK_UNQUANTIZED = ("lm_head", r"re:.*mlp\.gate$", r"re:.*indexer\.weights_proj$")


def deepseek_fp8_checkpoint(unquantized: Path, folder: Path, *, not_convert: tuple[str, ...] = ()) -> Path:
    """The fp32 DeepSeek-family checkpoint in ``unquantized`` stored the way DeepSeek-V3/R1's (and V3.2's) FP8
    releases are: every linear layer (MLA's q_a / q_b / q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, DSA's
    wq_b / wk, dense MLPs, shared and routed experts) 128 x 128 block FP8 with ``weight_scale_inv`` beside it,
    ``quant_method: "fp8"``; the routers, LM head and ``indexer.weights_proj`` unquantized without a rule
    (``DEEPSEEK_UNQUANTIZED``), and the modules ``not_convert`` names (full checkpoint names) unquantized and
    listed in ``modules_to_not_convert``. The tensors are compressed-tensors' FP8_BLOCK ones
    (``ct_tree_checkpoint``), renamed (``as_hf_fp8_block``)."""
    ct_tree_checkpoint(unquantized, folder, "FP8_BLOCK", ignore=(*DEEPSEEK_UNQUANTIZED, *not_convert))
    return as_hf_fp8_block(folder, not_convert=not_convert)


def hf_fp8_block_checkpoint(model: torch.nn.Module, folder: Path, *, architecture: str,
                            ignore: tuple[str, ...] = ()) -> Path:
    """compressed-tensors' FP8_BLOCK tensors saved the way HF / DeepSeek fp8 checkpoints store them:
    ``weight_scale_inv`` beside each FP8 weight, ``quantization_config`` of ``quant_method: "fp8"``."""
    ct_checkpoint(model, folder, "FP8_BLOCK", architecture=architecture, ignore=("lm_head", *ignore))
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {(k + "_inv" if k.endswith(".weight_scale") else k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": list(ignore)}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def quark_checkpoint(model: torch.nn.Module, folder: Path, scheme: str, *, template: str, architecture: str,
                     kv_cache: bool = False, layer_config: dict | None = None, exclude: list[str] | None = None,
                     calib: torch.Tensor | None = None) -> Path:
    """``model`` (left unchanged) quantized by AMD Quark (``LLMTemplate.get(template).get_config(scheme)``,
    ``ModelQuantizer``) and exported with ``export_safetensors`` to ``folder``."""
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors

    model = copy.deepcopy(model)
    calib = calibration_tokens(model.config.vocab_size) if calib is None else calib
    kwargs = {"exclude_layers": exclude} if exclude is not None else {}
    qconfig = LLMTemplate.get(template).get_config(scheme=scheme, kv_cache_scheme="fp8" if kv_cache else None,
                                                   layer_config=layer_config, **kwargs)
    quantized = ModelQuantizer(qconfig).quantize_model(model, [calib])
    export_safetensors(quantized, str(folder))
    _set_architecture(folder, architecture)
    return folder


def _dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in fp32 for a per-tensor (one value), per-channel ([N] / [N, 1]) or block
    ([ceil(N/128), ceil(K/128)]) scale."""
    rows, cols = weight.shape
    w, s = weight.float(), scale.float()
    if s.numel() == 1:
        return w * s.reshape(())
    if s.shape in ((rows,), (rows, 1)):
        return w * s.reshape(rows, 1)
    full = s.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return w * full


def dequantized_checkpoint(quantized: Path, folder: Path) -> Path:
    """The model of ``quantized`` with fp32 weights ``q * scale`` and no quantization config (scales,
    input / output / KV scales dropped)."""
    folder.mkdir(parents=True, exist_ok=True)
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
    out = {}
    for name, tensor in stored.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale", ".output_scale", ".k_scale",
                          ".v_scale", "_zero_point")):
            continue
        if tensor.dtype in (torch.float8_e4m3fn, torch.int8):
            scale = stored.get(name + "_scale", stored.get(name + "_scale_inv"))
            assert scale is not None, f"{name} is quantized but has no scale"
            tensor = _dequantize(tensor, scale)
        out[name] = tensor.float().contiguous()
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder



def attention_kv_cache_scales(model: torch.nn.Module, calib: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-layer FP8 KV-cache scales of an HF model as compressed-tensors' ``kv_cache_scheme`` (8-bit float,
    ``tensor`` strategy, static, symmetric) defines them: ``calculate_qparams`` (the tool's rule: amax / 448) on
    the min / max of the key and value states the attention writes to its cache over the calibration tokens,
    stored as ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (fp32 [1], the names
    ``initialize_attn_qparams`` gives them). The states are read from HF's own cache after a forward: for
    DeepSeek's MLA the expanded, rotated keys ``[k_nope, k_pe]`` per head and the values (what its HF
    attention caches; vLLM then writes the latent cache with the k scale)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    calib = calibration_tokens(model.config.vocab_size) if calib is None else calib
    with torch.no_grad():
        out = model(calib, use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]  # (transformers 5 renamed it)
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    out = {}
    for i, layer in enumerate(cache.layers):
        for kv, states in (("k", layer.keys), ("v", layer.values)):
            scale, _ = calculate_qparams(states.amin().reshape(1), states.amax().reshape(1), args)
            out[f"model.layers.{i}.self_attn.{kv}_scale"] = scale.float().reshape(1)
    return out


def with_kv_cache_scales(folder: Path, scales: dict[str, torch.Tensor]) -> Path:
    """The compressed-tensors checkpoint in ``folder`` given per-layer KV-cache ``scales`` (tensor name ->
    fp32 [1]) and the ``kv_cache_scheme`` compressed-tensors writes with them, in place."""
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
    save_file({**tensors, **scales}, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def unfused(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every producer's quantization for the next linear layer turned off (in place): each
    linear layer then quantizes its own input (``models.quantization.activation``)."""
    from atom_core.models.base import PreNormDecoderLayer
    from atom_core.models.layers.mlp import GatedMLP
    from atom_core.models.llama import LlamaAttention

    for module in model.modules():
        if isinstance(module, PreNormDecoderLayer):
            module._attn_quant = module._mlp_quant = None
        if isinstance(module, GatedMLP):
            module._down_quant = None
        if isinstance(module, LlamaAttention):
            module._quantized_out = False
    return model
