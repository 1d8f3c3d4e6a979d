"""compressed-tensors quantization configs (llm-compressor; ``quant_method: "compressed-tensors"``).

``ModelCompressor.update_config`` writes ``QuantizationConfig.model_dump()`` into config.json:
``config_groups`` of schemes (``targets``, ``weights``, ``input_activations``,
``output_activations``, ``format``), ``ignore``, ``kv_cache_scheme``, ``format`` and bookkeeping
keys (``version``, ``quantization_status``, ``sparsity_config``, ``transform_config``, ...).
Each ``weights`` / ``input_activations`` entry is a ``QuantizationArgs``: ``num_bits``, ``type``
(``"float"``/``"int"``), ``symmetric``, ``strategy`` (``tensor``/``channel``/``group``/``block``/
``token``/...), ``group_size``, ``block_structure``, ``dynamic``.

What maps to what:

- weights ``float``/8 (FP8 e4m3): ``tensor`` -> ``FP8_PER_TENSOR``, ``channel`` ->
  ``FP8_PER_CHANNEL``, ``block`` ``[128, 128]`` -> ``FP8_BLOCK_128`` (presets FP8, FP8_DYNAMIC,
  FP8_BLOCK); ``int``/8 symmetric ``channel`` -> ``INT8_PER_CHANNEL`` (preset W8A8);
- activations: ``token`` dynamic -> per-token, ``tensor`` dynamic / static -> dynamic / static
  per-tensor, ``group`` 128 dynamic -> per-group-128; same type and bits as the weights;
- rules, in compressed-tensors' own order (``match_targets``, what decided how the checkpoint was
  stored): ``ignore`` (exact names, ``re:`` regexes) -> unquantized; then exact-name targets; then
  ``re:`` targets sorted by their text; then the class target ``"Linear"``. A target that several
  groups name takes the last group's scheme; the groups' order decides nothing else (vLLM tries the
  targets group by group, which can differ); a layer no target reaches stays unquantized;
- ``kv_cache_scheme`` ``float``/8 ``tensor`` static symmetric -> FP8 KV cache (``k_scale``/``v_scale``).

Refused by name: other bit widths (int4, NVFP4/MXFP4 packing), asymmetric, group or tensor-group
weights, INT8 per-tensor weights, weight-only FP8/INT8, static per-token or per-channel
activations, ``dynamic: "local"``, output activations, class targets other than ``Linear``,
sparsity, transforms, MoE sparsity, a ``dense`` (fake-quant) or packed format, a ``quantization_status``
other than ``compressed`` (an uncompressed export), per-head or dynamic or int8 KV caches.
"""

from __future__ import annotations

from atom_core.models.quantization.rules import LayerRule, ParsedRules, make_rule, string_list
from atom_core.models.quantization.schemes import (
    ACTIVATION_GROUP_SIZE,
    FP8_KV_CACHE,
    FP8_PER_CHANNEL,
    FP8_PER_TENSOR,
    INT8_PER_CHANNEL,
    UNQUANTIZED,
    ActivationScheme,
    KVCacheScheme,
    LinearScheme,
    UnsupportedQuantizationError,
    WeightFormat,
    fp8_block_format,
    make_scheme,
)

# Storage formats whose tensors hold the quantized values as they are (no packing, no fake-quant).
_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")
_FLOAT_SCALE_DTYPES = (None, "torch.float32", "torch.bfloat16", "torch.float16", "float32", "bfloat16", "float16")


def _refuse(where: str, what: str, hint: str | None = None) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"{where}: not supported: {what}" + (f"; {hint}" if hint else ""))


def _strategy(args: dict) -> str:
    """``strategy``, inferred from ``group_size`` as ``QuantizationArgs`` does when a file omits it."""
    strategy = args.get("strategy")
    if strategy is not None:
        return str(strategy).lower()
    group = args.get("group_size")
    return "tensor" if group is None else "channel" if group == -1 else "group"


def _kind(args: dict) -> str:
    return f"{args.get('num_bits', 8)}-bit {args.get('type', 'int')}"


def _weights(args: dict, where: str) -> WeightFormat:
    if not isinstance(args, dict):
        raise UnsupportedQuantizationError(f"{where} must be an object, got {args!r}")
    kind, strategy = _kind(args), _strategy(args)
    if kind not in ("8-bit float", "8-bit int"):
        raise _refuse(where, f"{kind} weights (strategy {strategy!r})",
                      "weights must be 8-bit float (FP8 e4m3) or 8-bit int (INT8)")
    if args.get("dynamic", False):
        raise _refuse(where, "dynamic weight quantization")
    if not args.get("symmetric", True):
        raise _refuse(where, f"asymmetric {kind} weights (zero points)")
    if args.get("actorder") not in (None, False, "weight", "static"):
        raise _refuse(where, f"actorder={args.get('actorder')!r} (a g_idx permutation)")
    if args.get("scale_dtype") not in _FLOAT_SCALE_DTYPES:
        raise _refuse(where, f"scale_dtype {args.get('scale_dtype')!r}")
    if kind == "8-bit float":
        if strategy == "tensor":
            return FP8_PER_TENSOR
        if strategy == "channel":
            return FP8_PER_CHANNEL
        if strategy == "block":
            return fp8_block_format(args.get("block_structure"), where=f"{where}.block_structure")
        raise _refuse(where, f"FP8 weights with strategy {strategy!r} (group size {args.get('group_size')})")
    if strategy == "channel":
        return INT8_PER_CHANNEL
    raise _refuse(where, f"INT8 weights with strategy {strategy!r}", "INT8 weights must be per-channel")


def _activations(args: dict | None, weight: WeightFormat, where: str) -> ActivationScheme:
    if args is None:
        return ActivationScheme.NONE
    if not isinstance(args, dict):
        raise UnsupportedQuantizationError(f"{where} must be an object or null, got {args!r}")
    kind, strategy, dynamic = _kind(args), _strategy(args), args.get("dynamic", False)
    wanted = "8-bit float" if weight.dtype == "float8_e4m3fn" else "8-bit int"
    if kind != wanted:
        raise _refuse(where, f"{kind} activations with {weight.describe()} weights")
    if not args.get("symmetric", True):
        raise _refuse(where, f"asymmetric {kind} activations (zero points)")
    if dynamic not in (True, False):
        raise _refuse(where, f"dynamic={dynamic!r} activations")
    if strategy == "token" and dynamic:
        return ActivationScheme.DYNAMIC_PER_TOKEN
    if strategy == "tensor":
        return ActivationScheme.DYNAMIC_PER_TENSOR if dynamic else ActivationScheme.STATIC_PER_TENSOR
    if strategy == "group" and dynamic and args.get("group_size") == ACTIVATION_GROUP_SIZE:
        return ActivationScheme.DYNAMIC_PER_GROUP_128
    static = "dynamic" if dynamic else "static"
    raise _refuse(where, f"{static} {strategy} activations (group size {args.get('group_size')})")


def _scheme(group: dict, where: str) -> LinearScheme:
    if group.get("output_activations") is not None:
        raise _refuse(f"{where}.output_activations", "output activation quantization")
    if group.get("format") not in (None, *_FORMATS):
        raise _refuse(f"{where}.format", f"format {group.get('format')!r}")
    weights, inputs = group.get("weights"), group.get("input_activations")
    if weights is None:
        if inputs is not None:
            raise _refuse(where, "activation-only quantization (input_activations without weights)")
        return UNQUANTIZED
    weight = _weights(weights, f"{where}.weights")
    activation = _activations(inputs, weight, f"{where}.input_activations")
    return make_scheme(weight, activation, where=where)


def _kv_cache(args: dict | None, where: str) -> KVCacheScheme | None:
    if args is None:
        return None
    if not isinstance(args, dict):
        raise UnsupportedQuantizationError(f"{where} must be an object or null, got {args!r}")
    kind, strategy = _kind(args), _strategy(args)
    if kind != "8-bit float":
        raise _refuse(where, f"a {kind} KV cache", "only FP8 e4m3")
    if strategy != "tensor" or args.get("dynamic", False) or not args.get("symmetric", True):
        raise _refuse(where, f"KV cache scales with strategy {strategy!r}, dynamic={args.get('dynamic')!r}, "
                             f"symmetric={args.get('symmetric')!r}", "only static symmetric per-tensor (per layer)")
    return FP8_KV_CACHE


def _target_rule(target: str, scheme: LinearScheme, origin: str, where: str) -> LayerRule:
    if target == "Linear":
        return make_rule("linear", target, scheme, origin=origin, where=where)
    if target.startswith("re:"):
        return make_rule("regex", target[3:], scheme, origin=origin, where=where)
    if "." not in target and target[:1].isupper():  # a module class name: only Linear is understood
        raise _refuse(where, f"target {target!r} (a module class)", "the only class target is 'Linear'")
    return make_rule("exact", target, scheme, origin=origin, where=where)


def parse_compressed_tensors(qc: dict, where: str) -> ParsedRules:
    """``ParsedRules`` of a compressed-tensors config (see the module docstring)."""
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms (rotations)"),
                      ("moe_sparsity_config", "MoE expert sparsity")):
        if qc.get(key):
            raise _refuse(f"{where}.{key}", what)
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise UnsupportedQuantizationError(f"{where}.config_groups must be an object, got {groups!r}")
    by_target: dict[str, LayerRule] = {}  # a target named by several groups: the last group's (as compressed-tensors)
    for name, group in groups.items():
        gwhere = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise UnsupportedQuantizationError(
                f"{gwhere} must be a scheme object, got {group!r} (save the config with compressed-tensors "
                "to expand preset names)")
        scheme = _scheme(group, gwhere)
        targets = string_list(group.get("targets"), f"{gwhere}.targets")
        for target in targets:
            by_target[target] = _target_rule(target, scheme, f"config_groups.{name} target {target!r}",
                                             f"{gwhere}.targets")
    # compressed-tensors' precedence (match_targets): exact names, then regexes in the sorted order of their
    # target strings, then the class target; the groups' order does not enter.
    class_rules = [rule for rule in by_target.values() if rule.match == "linear"]
    name_rules = [by_target[target] for target in sorted(by_target, key=lambda t: ("re:" in t, t))
                  if by_target[target].match != "linear"]
    quantized = any(r.scheme.is_quantized for r in name_rules + class_rules)
    if quantized and qc.get("format") not in (None, "mixed-precision", *_FORMATS):
        raise _refuse(f"{where}.format", f"format {qc.get('format')!r} (weights not stored as plain quantized values)",
                      f"expected one of {list(_FORMATS)}")
    status = qc.get("quantization_status")
    if quantized and status not in (None, "compressed"):
        raise _refuse(f"{where}.quantization_status", f"status {status!r} (the weights were saved uncompressed: "
                      "float values beside their scales, a fake-quant export)",
                      "save the model compressed (quantization_status 'compressed'), or load its float weights "
                      "without this quantization_config")
    ignore = []
    for entry in string_list(qc.get("ignore"), f"{where}.ignore"):
        match, pattern = ("regex", entry[3:]) if entry.startswith("re:") else ("exact", entry)
        ignore.append(make_rule(match, pattern, UNQUANTIZED, origin=f"ignore {entry!r}", where=f"{where}.ignore"))
    kv = _kv_cache(qc.get("kv_cache_scheme"), f"{where}.kv_cache_scheme")
    return ParsedRules("compressed-tensors", UNQUANTIZED, UNQUANTIZED, tuple(ignore + name_rules + class_rules), kv)
