"""Hugging Face's ``fp8`` and ``mxfp4`` quantization configs.

``fp8`` (transformers' ``FineGrainedFP8Config``, DeepSeek-V3/Qwen3-FP8 releases, and the
vLLM-style files AMD Quark writes in its "fp8" export mode)::

    {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
     "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

- with ``weight_block_size`` ``[128, 128]``: ``FP8_BLOCK_128`` weights (``weight_scale_inv``
  [ceil(N/128), ceil(K/128)] beside each) and dynamic per-group-128 activations; other block
  shapes and static activations with blocks are refused;
- without it (absent or null): ``FP8_PER_TENSOR`` weights, activations dynamic per-tensor
  (``"dynamic"``) or static per-tensor (``"static"``, ``input_scale`` in the checkpoint);
- every linear layer is quantized except those ``modules_to_not_convert`` (or its alias
  ``ignored_layers``) names (``rules.LayerRule`` kind ``"hf_module"``);
- ``kv_cache_scheme: "static"`` (Quark's fp8 export): an FP8 KV cache with per-layer scales.

``scale_fmt: "ue8m0"`` (DeepSeek-V3.1 / V3.2: trained with power-of-two scales) loads as the same
scheme: the stored ``weight_scale_inv`` are fp32 (powers of two) and are read exactly; activations get
fp32 per-group scales (amax / 448) rather than that amax rounded up to a power of two, i.e. at most
one bit finer, as vLLM computes them on Hopper-class GPUs (the power-of-two form is a DeepGEMM layout
for Blackwell).

Refused by name: ``fmt`` other than ``e4m3``, ``activation_scheme`` null (FP8 weight-only) or
unknown, ``scale_fmt`` other than ``float`` / ``ue8m0``, ``expert_dtype: "fp4"`` (DeepSeek-V4), a
non-empty ``modules_to_convert`` (quantized embeddings), a dynamic KV cache. ``dequantize`` is a
loading preference of transformers and is ignored.

``mxfp4`` (transformers' ``Mxfp4Config``, the gpt-oss releases)::

    {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", ...]}

quantizes the MoE experts only (``MXFP4_E2M1`` weight-only; transformers replaces only the
experts modules), minus those ``modules_to_not_convert`` names; dense layers stay unquantized.
"""

from __future__ import annotations

from atom_core.models.quantization.rules import LayerRule, ParsedRules, make_rule, string_list
from atom_core.models.quantization.schemes import (
    FP8_KV_CACHE,
    FP8_PER_TENSOR,
    MXFP4_E2M1,
    UNQUANTIZED,
    ActivationScheme,
    UnsupportedQuantizationError,
    fp8_block_format,
    make_scheme,
)


def _skip_rules(qc: dict, where: str) -> tuple[LayerRule, ...]:
    """``modules_to_not_convert`` and ``ignored_layers`` (transformers reads the latter as an alias)."""
    rules = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        for pattern in string_list(qc.get(key), f"{where}.{key}"):
            rules.append(make_rule("hf_module", pattern, UNQUANTIZED, origin=f"{key} {pattern!r}", where=where))
    return tuple(rules)


def parse_hf_fp8(qc: dict, where: str) -> ParsedRules:
    """``ParsedRules`` of an HF ``fp8`` config (see the module docstring); ``where`` prefixes errors."""
    fmt = qc.get("fmt") or "e4m3"
    if fmt != "e4m3":
        raise UnsupportedQuantizationError(f"{where}.fmt: FP8 format {fmt!r} is not supported; only 'e4m3'")
    for key, allowed in (("scale_fmt", (None, "float", "ue8m0")), ("expert_dtype", (None, "fp8"))):
        if qc.get(key) not in allowed:
            raise UnsupportedQuantizationError(
                f"{where}.{key}: {qc.get(key)!r} is not supported; only {' or '.join(map(repr, allowed[1:]))}")
    if qc.get("modules_to_convert"):
        raise UnsupportedQuantizationError(
            f"{where}.modules_to_convert: quantizing modules beyond the linear layers "
            f"({qc['modules_to_convert']!r}) is not supported")
    activation = qc.get("activation_scheme", "dynamic")
    if activation is None:
        raise UnsupportedQuantizationError(
            f"{where}.activation_scheme: null (FP8 weight-only) is not supported; FP8 weights take "
            "'dynamic' or 'static' activations")
    activation = activation.lower() if isinstance(activation, str) else activation
    if activation not in ("dynamic", "static"):
        raise UnsupportedQuantizationError(
            f"{where}.activation_scheme: {activation!r} is not supported; 'dynamic' or 'static'")
    block = qc.get("weight_block_size")
    if block is None:
        weight = FP8_PER_TENSOR
        act = ActivationScheme.DYNAMIC_PER_TENSOR if activation == "dynamic" else ActivationScheme.STATIC_PER_TENSOR
    else:
        weight = fp8_block_format(block, where=f"{where}.weight_block_size")
        act = ActivationScheme.DYNAMIC_PER_GROUP_128 if activation == "dynamic" else ActivationScheme.STATIC_PER_TENSOR
    scheme = make_scheme(weight, act, where=where)
    kv = qc.get("kv_cache_scheme")
    if kv not in (None, "static"):
        raise UnsupportedQuantizationError(
            f"{where}.kv_cache_scheme: {kv!r} is not supported; only 'static' (per-layer k_scale/v_scale)")
    return ParsedRules("fp8", scheme, scheme, _skip_rules(qc, where), None if kv is None else FP8_KV_CACHE)


def parse_hf_mxfp4(qc: dict, where: str) -> ParsedRules:
    """``ParsedRules`` of an HF ``mxfp4`` config: MXFP4 experts, everything else unquantized."""
    experts = make_scheme(MXFP4_E2M1, ActivationScheme.NONE, where=where)
    return ParsedRules("mxfp4", UNQUANTIZED, experts, _skip_rules(qc, where), None)
