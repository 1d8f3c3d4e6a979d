"""AMD Quark quantization configs (``quant_method: "quark"``).

Quark's safetensors export writes ``QConfig.to_dict()`` plus ``"export"`` (its
``JsonExporterConfig``): ``global_quant_config``, ``layer_quant_config`` (fnmatch pattern ->
layer config), ``layer_type_quant_config`` (class name -> layer config), ``kv_cache_quant_config``
(pattern -> layer config whose ``output_tensors`` is the KV cache's), ``exclude`` (fnmatch
patterns or names), ``algo_config``, ``softmax_quant_spec``. A layer config holds
``weight``/``input_tensors``/``output_tensors``/``bias``, each a ``QTensorConfig.to_dict()``:
``dtype`` (``fp8_e4m3``, ``int8``, ``fp4``, ...), ``qscheme`` (``per_tensor``/``per_channel``/
``per_group``/``per_block``), ``is_dynamic``, ``ch_axis``, ``group_size``, ``block_size``,
``symmetric``, ``scale_format`` (``e8m0`` for OCP MX), ...

What maps to what:

- weights ``fp8_e4m3``: ``per_tensor`` -> ``FP8_PER_TENSOR``, ``per_channel`` (``ch_axis`` 0) ->
  ``FP8_PER_CHANNEL``, ``per_block`` ``[128, 128]`` -> ``FP8_BLOCK_128``; ``int8`` symmetric
  ``per_channel`` -> ``INT8_PER_CHANNEL``; ``fp4`` ``per_group`` 32 with ``e8m0`` scales ->
  ``MXFP4_E2M1`` (scheme ``mxfp4_weight_only``);
- inputs (same dtype family as the weights): ``per_tensor`` static / dynamic -> static / dynamic
  per-tensor; ``per_channel`` dynamic -> dynamic per-token (PTPC FP8: one scale per token);
  ``per_group`` 128 dynamic -> per-group-128; none -> weight-only;
- rules, in Quark's own order (``setup_config_per_layer``): ``exclude`` -> unquantized; a
  ``layer_quant_config`` key that is the layer's whole name (no ``*``, ``?`` or ``[``); the first
  matching ``layer_quant_config`` pattern; ``layer_type_quant_config["Linear"]``; else the global
  config (also the experts' default);
- ``kv_cache_quant_config`` with ``fp8_e4m3`` ``per_tensor`` static ``output_tensors`` -> FP8 KV
  cache (``k_proj``/``v_proj`` ``output_scale`` per layer); older exports say the same with
  ``output_tensors`` on the ``layer_quant_config`` patterns that ``export.kv_cache_group`` lists.
  Output quantization is accepted on those KV patterns only.

Refused by name: other dtypes (int4/uint4, fp8_e5m2, fp6, mx6/mx9, bfp16, legacy ``mx``), INT8
per-tensor weights (the ``int8`` template), FP4 groups other than 32 or scales other than e8m0
(amdfp4, nvfp4), MXFP4 or FP8 activations on MXFP4 weights (the W4A4 ``mxfp4`` template),
static per-channel activations, bias or output quantization, lists of specs (multi-stage),
dynamic weights, asymmetric FP8/INT8, ``layer_type_quant_config`` for classes other than
``Linear``, algorithms not baked into the weights (online rotations R3/R4/online R1, svdquant),
softmax (attention) quantization, ``fake_quantized`` exports.
"""

from __future__ import annotations

from atom_core.models.quantization.rules import LayerRule, ParsedRules, make_rule, string_list
from atom_core.models.quantization.schemes import (
    ACTIVATION_GROUP_SIZE,
    FP8_KV_CACHE,
    FP8_PER_CHANNEL,
    FP8_PER_TENSOR,
    INT8_PER_CHANNEL,
    MXFP4_E2M1,
    MXFP4_GROUP_SIZE,
    UNQUANTIZED,
    ActivationScheme,
    KVCacheScheme,
    LinearScheme,
    UnsupportedQuantizationError,
    WeightFormat,
    fp8_block_format,
    make_scheme,
)

# Algorithms whose effect Quark bakes into the exported weights: the checkpoint is an ordinary
# quantized one. Rotation is baked too unless it rotates activations online (R3, R4, online R1),
# which would need Hadamard transforms at run time that no layer performs.
_BAKED_ALGORITHMS = ("awq", "gptq", "gptaq", "qronos", "smooth", "autosmoothquant", "autoround", "rotation")
_ONLINE_ROTATION_KEYS = ("r3", "r4", "online_r1_rotation", "online_config")
_DTYPE_OF_METHOD = {"float8_e4m3fn": "fp8_e4m3", "int8": "int8", "float4_e2m1": "fp4"}


def _refuse(where: str, what: str, hint: str | None = None) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"{where}: not supported: {what}" + (f"; {hint}" if hint else ""))


def _spec(spec, where: str) -> dict | None:
    if spec is None:
        return None
    if isinstance(spec, list):
        raise _refuse(where, "a list of specs (multi-stage quantization)")
    if not isinstance(spec, dict) or "dtype" not in spec:
        raise UnsupportedQuantizationError(f"{where} must be a QTensorConfig object or null, got {spec!r}")
    if spec.get("is_scale_quant") or spec.get("mx_element_dtype") is not None:
        raise _refuse(where, "scale quantization / legacy MX element dtypes")
    return spec


def _weight(spec: dict, where: str) -> WeightFormat:
    dtype, qscheme = spec.get("dtype"), spec.get("qscheme")
    if spec.get("is_dynamic"):
        raise _refuse(where, "dynamic weight quantization")
    if dtype in ("fp8_e4m3", "int8") and spec.get("symmetric") is False:
        raise _refuse(where, f"asymmetric {dtype} weights (zero points)")
    if dtype == "fp8_e4m3":
        if qscheme == "per_tensor":
            return FP8_PER_TENSOR
        if qscheme == "per_channel" and spec.get("ch_axis") in (0, None):
            return FP8_PER_CHANNEL
        if qscheme == "per_block":
            return fp8_block_format(spec.get("block_size"), where=f"{where}.block_size")
        raise _refuse(where, f"fp8_e4m3 weights {qscheme} (ch_axis {spec.get('ch_axis')}, group_size "
                             f"{spec.get('group_size')})")
    if dtype == "int8":
        if qscheme == "per_channel" and spec.get("ch_axis") in (0, None):
            return INT8_PER_CHANNEL
        raise _refuse(where, f"int8 weights {qscheme}", "INT8 weights must be per_channel (ch_axis 0)")
    if dtype == "fp4":
        if (qscheme == "per_group" and spec.get("group_size") == MXFP4_GROUP_SIZE
                and spec.get("scale_format") == "e8m0" and spec.get("ch_axis") in (-1, 1, None)):
            return MXFP4_E2M1
        raise _refuse(where, f"fp4 weights {qscheme} group_size {spec.get('group_size')} with "
                             f"{spec.get('scale_format')!r} scales", "only MXFP4 (per_group 32, e8m0 scales)")
    raise _refuse(where, f"{dtype} weights", "weights must be fp8_e4m3, int8 or fp4 (MXFP4)")


def _input(spec: dict | None, weight: WeightFormat, where: str) -> ActivationScheme:
    if spec is None:
        return ActivationScheme.NONE
    dtype, qscheme, dynamic = spec.get("dtype"), spec.get("qscheme"), bool(spec.get("is_dynamic"))
    if weight == MXFP4_E2M1:
        raise _refuse(where, f"{dtype} activations with MXFP4 weights",
                      "MXFP4 is weight-only (Quark scheme 'mxfp4_weight_only')")
    if dtype != _DTYPE_OF_METHOD[weight.dtype]:
        raise _refuse(where, f"{dtype} activations with {weight.describe()} weights")
    if spec.get("symmetric") is False:
        raise _refuse(where, f"asymmetric {dtype} activations (zero points)")
    if qscheme == "per_tensor":
        return ActivationScheme.DYNAMIC_PER_TENSOR if dynamic else ActivationScheme.STATIC_PER_TENSOR
    if qscheme == "per_channel" and dynamic:  # one scale per token: Quark's "ptpc" inputs
        return ActivationScheme.DYNAMIC_PER_TOKEN
    if qscheme == "per_group" and dynamic and spec.get("group_size") == ACTIVATION_GROUP_SIZE:
        return ActivationScheme.DYNAMIC_PER_GROUP_128
    raise _refuse(where, f"{'dynamic' if dynamic else 'static'} {qscheme} {dtype} activations "
                         f"(group_size {spec.get('group_size')})")


def _kv_output(spec: dict | None, where: str) -> KVCacheScheme:
    if (spec is None or spec.get("dtype") != "fp8_e4m3" or spec.get("qscheme") != "per_tensor"
            or spec.get("is_dynamic")):
        raise _refuse(where, f"KV cache quantization {spec!r}", "only static fp8_e4m3 per_tensor (per layer)")
    return FP8_KV_CACHE


def _layer(cfg, where: str, *, kv_pattern: bool) -> LinearScheme:
    if not isinstance(cfg, dict):
        raise UnsupportedQuantizationError(f"{where} must be a layer config object, got {cfg!r}")
    weight = _spec(cfg.get("weight"), f"{where}.weight")
    inputs = _spec(cfg.get("input_tensors"), f"{where}.input_tensors")
    outputs = _spec(cfg.get("output_tensors"), f"{where}.output_tensors")
    if _spec(cfg.get("bias"), f"{where}.bias") is not None:
        raise _refuse(f"{where}.bias", "bias quantization")
    if outputs is not None:
        if not kv_pattern:
            raise _refuse(f"{where}.output_tensors", "output quantization outside the KV cache layers")
        _kv_output(outputs, f"{where}.output_tensors")
    if weight is None:
        if inputs is not None:
            raise _refuse(where, "activation-only quantization (input_tensors without weight)")
        return UNQUANTIZED
    fmt = _weight(weight, f"{where}.weight")
    return make_scheme(fmt, _input(inputs, fmt, f"{where}.input_tensors"), where=where)


def _check_extras(qc: dict, where: str) -> None:
    export = qc.get("export") or {}
    if export.get("weight_format", "real_quantized") != "real_quantized":
        raise _refuse(f"{where}.export.weight_format", f"{export.get('weight_format')!r} (weights not stored "
                                                       "quantized)", "only 'real_quantized'")
    algos = qc.get("algo_config") or []
    for algo in algos if isinstance(algos, list) else [algos]:
        algo = algo if isinstance(algo, dict) else {"name": algo}
        name = algo.get("name")
        if name not in _BAKED_ALGORITHMS:
            raise _refuse(f"{where}.algo_config", f"algorithm {name!r}",
                          f"only {', '.join(_BAKED_ALGORITHMS)}, whose effect is baked into the weights")
        online = [key for key in _ONLINE_ROTATION_KEYS if name == "rotation" and algo.get(key)]
        if online:
            raise _refuse(f"{where}.algo_config", f"online rotation ({', '.join(online)})",
                          "rotations must be fused into the weights (r1/r2 offline)")
    if qc.get("softmax_quant_spec") is not None:
        raise _refuse(f"{where}.softmax_quant_spec", "attention (softmax) quantization")


def parse_quark(qc: dict, where: str) -> ParsedRules:
    """``ParsedRules`` of a Quark config (see the module docstring)."""
    _check_extras(qc, where)
    kv_configs = qc.get("kv_cache_quant_config") or {}
    if not isinstance(kv_configs, dict):
        raise UnsupportedQuantizationError(f"{where}.kv_cache_quant_config must be an object, got {kv_configs!r}")
    kv = None
    for pattern, cfg in kv_configs.items():
        cfg = cfg if isinstance(cfg, dict) else {}
        kv = _kv_output(_spec(cfg.get("output_tensors"), f"{where}.kv_cache_quant_config[{pattern!r}]"),
                        f"{where}.kv_cache_quant_config[{pattern!r}].output_tensors")
    if "global_quant_config" not in qc:
        raise UnsupportedQuantizationError(f"{where}: a quark config needs global_quant_config")
    default = _layer(qc["global_quant_config"], f"{where}.global_quant_config", kv_pattern=False)
    rules: list[LayerRule] = []
    for entry in string_list(qc.get("exclude"), f"{where}.exclude"):
        match, pattern = ("regex", entry[3:]) if entry.startswith("re:") else ("fnmatch", entry)
        rules.append(make_rule(match, pattern, UNQUANTIZED, origin=f"exclude {entry!r}", where=f"{where}.exclude"))
    layer_configs = qc.get("layer_quant_config") or {}
    type_configs = qc.get("layer_type_quant_config") or {}
    for key, value in (("layer_quant_config", layer_configs), ("layer_type_quant_config", type_configs)):
        if not isinstance(value, dict):
            raise UnsupportedQuantizationError(f"{where}.{key} must be an object, got {value!r}")
    # Older exports name the KV layers only in export.kv_cache_group (their output_tensors are the KV cache's).
    kv_patterns = set(kv_configs) | set(string_list((qc.get("export") or {}).get("kv_cache_group"),
                                                    f"{where}.export.kv_cache_group"))
    exact_rules, glob_rules = [], []
    for pattern, cfg in layer_configs.items():
        lwhere = f"{where}.layer_quant_config[{pattern!r}]"
        scheme = _layer(cfg, lwhere, kv_pattern=pattern in kv_patterns)
        if pattern in kv_patterns and isinstance(cfg, dict) and cfg.get("output_tensors") is not None:
            kv = FP8_KV_CACHE  # _layer checked it is static fp8_e4m3 per_tensor
        exact = not any(ch in pattern for ch in "*?[")  # a whole module name: Quark looks it up before any pattern
        (exact_rules if exact else glob_rules).append(
            make_rule("exact" if exact else "fnmatch", pattern, scheme, origin=f"layer_quant_config {pattern!r}",
                      where=lwhere))
    rules += exact_rules + glob_rules
    for type_name, cfg in type_configs.items():
        twhere = f"{where}.layer_type_quant_config[{type_name!r}]"
        if type_name != "Linear":
            raise _refuse(twhere, f"quantizing {type_name} layers", "only Linear layers are quantized")
        rules.append(make_rule("linear", "Linear", _layer(cfg, twhere, kv_pattern=False),
                               origin="layer_type_quant_config 'Linear'", where=twhere))
    return ParsedRules("quark", default, default, tuple(rules), kv)
