"""``QuantConfig``: a checkpoint's ``quantization_config`` parsed once, with per-layer rules.

``parse_quant_config(config_json["quantization_config"])`` reads the formats below (one parser
module each) and refuses, by name and before any weight is read, everything atom_core cannot
serve (``UnsupportedQuantizationError``, naming the file and key when given):

- ``quant_method: "fp8"`` (Hugging Face / DeepSeek): ``parse_hf``;
- ``quant_method: "mxfp4"`` (Hugging Face, gpt-oss): ``parse_hf``;
- ``quant_method: "compressed-tensors"`` (llm-compressor): ``parse_compressed_tensors``;
- ``quant_method: "quark"`` (AMD Quark): ``parse_quark``.

A model asks ``config.scheme_for(layer_name, packed_from=model.packed_modules_mapping,
expert_params_mapping=model.expert_params_mapping)`` for each linear layer: the rules are
applied to the checkpoint modules the layer is made of (``rules.checkpoint_modules``), so a rule
written for ``q_proj`` reaches the fused ``qkv_proj``, and one written for
``experts.3.gate_proj`` reaches the stacked experts; parts that disagree are refused by name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from atom_core.models.quantization.parse_compressed_tensors import parse_compressed_tensors
from atom_core.models.quantization.parse_hf import parse_hf_fp8, parse_hf_mxfp4
from atom_core.models.quantization.parse_quark import parse_quark
from atom_core.models.quantization.rules import LayerRule, canonical_rules, checkpoint_modules
from atom_core.models.quantization.schemes import (
    FP8_BLOCK_128,
    FP8_PER_CHANNEL,
    ActivationScheme,
    KVCacheScheme,
    LinearScheme,
    QuantMethod,
    UnsupportedQuantizationError,
    make_scheme,
)

# quant_method as written in config.json -> (canonical name, parser)
_PARSERS = {
    "fp8": ("fp8", parse_hf_fp8),
    "mxfp4": ("mxfp4", parse_hf_mxfp4),
    "compressed-tensors": ("compressed-tensors", parse_compressed_tensors),
    "compressed_tensors": ("compressed-tensors", parse_compressed_tensors),
    "quark": ("quark", parse_quark),
}
# Linear methods each kind of layer has (docs/models.md): MXFP4 only in the fused MoE, INT8 only dense.
_EXPERT_METHODS = (QuantMethod.UNQUANTIZED, QuantMethod.FP8, QuantMethod.MXFP4)
_DENSE_METHODS = (QuantMethod.UNQUANTIZED, QuantMethod.FP8, QuantMethod.INT8)
_EXAMPLES = 4  # part names shown per scheme when packed parts disagree


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization, per layer.

    ``quant_method``: the format (``"fp8"``, ``"mxfp4"``, ``"compressed-tensors"``, ``"quark"``).
    ``rules``: tried in order on a checkpoint module name, first match wins; ``default`` is the
    scheme of a dense module no rule matches, ``expert_default`` that of a MoE expert module (they
    differ for HF ``mxfp4``, which quantizes the experts only). ``kv_cache``: the KV cache's
    scheme when the checkpoint has one (per-layer ``k_scale``/``v_scale``), else None.
    ``source``: the file it was read from (for messages; not part of equality or ``hash``).
    ``online``: the weights are unquantized and quantized while loading (``online_quant_config``).
    """

    quant_method: str
    default: LinearScheme
    expert_default: LinearScheme
    rules: tuple[LayerRule, ...] = ()
    kv_cache: KVCacheScheme | None = None
    source: str | None = field(default=None, compare=False)
    online: bool = False
    # The model's name mappings (``bind``): ``scheme_for`` uses them when it is given none.
    packed_modules_mapping: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    expert_params_mapping: Sequence[tuple] | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict:
        """The parsed form, JSON-ready (what ``hash`` digests)."""
        out = {"quant_method": self.quant_method, "default": self.default.to_dict(),
               "expert_default": self.expert_default.to_dict(), "rules": [r.to_dict() for r in self.rules],
               "kv_cache": None if self.kv_cache is None else self.kv_cache.to_dict()}
        if self.online:
            out["online"] = True
        return out

    def bind(self, packed_modules_mapping: Mapping[str, Any] | None,
             expert_params_mapping: Sequence[tuple] | None = None) -> QuantConfig:
        """This config with a model's ``packed_modules_mapping`` / ``expert_params_mapping`` attached:
        the model's layers then ask ``scheme_for(prefix)`` with their parameter-name prefix alone
        (as vLLM attaches the model class's packed mapping to its quantization config)."""
        return replace(self, packed_modules_mapping=packed_modules_mapping,
                       expert_params_mapping=expert_params_mapping)

    @cached_property
    def hash(self) -> str:
        """sha256 (hex) of the canonical JSON of ``to_dict()``: equal for equal parsed configs,
        whatever the key order of the file (for caches keyed on the quantization)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @cached_property
    def _index(self) -> tuple[dict[str, int], list[tuple[int, LayerRule]]]:
        # Exact-name rules (ignore lists hold hundreds) are looked up in a dict; the others scanned.
        exact: dict[str, int] = {}
        others = []
        for i, rule in enumerate(self.rules):
            if rule.match == "exact":
                exact.setdefault(rule.pattern, i)
            else:
                others.append((i, rule))
        return exact, others

    def checkpoint_scheme(self, module_name: str, *, expert: bool = False) -> tuple[LinearScheme, str]:
        """The scheme of one checkpoint module and what decided it (a rule's origin or ``"default"``)."""
        exact, others = self._index
        first = exact.get(module_name, len(self.rules))
        for i, rule in others:
            if i > first:
                break
            if rule.matches(module_name):
                return rule.scheme, rule.origin
        if first < len(self.rules):
            return self.rules[first].scheme, self.rules[first].origin
        return (self.expert_default if expert else self.default), "default"

    def scheme_for(self, layer_name: str, packed_from: Mapping[str, Any] | None = None, *,
                   expert_params_mapping: Sequence[tuple] | None = None) -> LinearScheme:
        """The ``LinearScheme`` of model layer ``layer_name`` (e.g. ``model.layers.3.self_attn.qkv_proj``
        or ``model.layers.3.mlp.experts``).

        ``packed_from``: the model's ``packed_modules_mapping``; ``expert_params_mapping``: its
        expert mapping (both may be passed for every layer: a layer is an experts layer when the
        expert mapping has entries under its last name component). Raises
        ``UnsupportedQuantizationError`` naming the layer when its parts resolve to different
        schemes, and for MXFP4 weights outside the experts or INT8 weights inside them.
        """
        if packed_from is None:
            packed_from = self.packed_modules_mapping
        if expert_params_mapping is None:
            expert_params_mapping = self.expert_params_mapping
        parts, expert = checkpoint_modules(layer_name, packed_from, expert_params_mapping)
        resolved = [(part, *self.checkpoint_scheme(part, expert=expert)) for part in parts]
        schemes = list(dict.fromkeys(scheme for _, scheme, _ in resolved))
        if len(schemes) > 1:
            raise UnsupportedQuantizationError(self._disagreement(layer_name, resolved, schemes))
        scheme = schemes[0]
        allowed = _EXPERT_METHODS if expert else _DENSE_METHODS
        if scheme.method not in allowed:
            kind = "MoE experts" if expert else "dense linear"
            raise UnsupportedQuantizationError(
                f"{self._where()}: layer {layer_name!r} resolves to {scheme.describe()}, which no "
                f"{kind} layer serves ({kind} layers take: {', '.join(m.value for m in allowed)})")
        return scheme

    def _where(self) -> str:
        return f"{self.source}: quantization_config" if self.source else "quantization_config"

    def _disagreement(self, layer_name: str, resolved: list, schemes: list) -> str:
        head = layer_name.rpartition(".")[0]
        lines = []
        for scheme in schemes:
            names = [(p[len(head) + 1:] if head and p.startswith(head + ".") else p, origin)
                     for p, s, origin in resolved if s == scheme]
            shown = ", ".join(f"{n} ({o})" for n, o in names[:_EXAMPLES])
            more = f" and {len(names) - _EXAMPLES} more" if len(names) > _EXAMPLES else ""
            lines.append(f"{shown}{more} -> {scheme.describe()}")
        return (f"{self._where()}: layer {layer_name!r} is packed from checkpoint modules whose quantization "
                f"differs: {'; '.join(lines)}. A packed layer has one linear method: its parts must be "
                "quantized alike")


def parse_quant_config(quantization_config: dict | None, *, source_file: str | Path | None = None
                       ) -> QuantConfig | None:
    """The ``QuantConfig`` of ``config.json``'s ``quantization_config`` (None or ``{}``: None).

    ``source_file`` (the config.json path) is named in every error and kept as ``source``.
    Raises ``UnsupportedQuantizationError`` for an unknown ``quant_method`` and for every
    combination the parsers refuse, before any weight is read.
    """
    if quantization_config is None or quantization_config == {}:
        return None
    source = None if source_file is None else str(source_file)
    where = f"{source}: quantization_config" if source else "quantization_config"
    if not isinstance(quantization_config, dict):
        raise UnsupportedQuantizationError(
            f"{where} must be a JSON object, got {type(quantization_config).__name__}")
    method = quantization_config.get("quant_method")
    if method not in _PARSERS:
        raise UnsupportedQuantizationError(
            f"{where}: quant_method={method!r} is not supported (atom_core reads the 'fp8', 'mxfp4', "
            "'compressed-tensors' and 'quark' formats); use an unquantised copy of the checkpoint")
    name, parser = _PARSERS[method]
    parsed = parser(quantization_config, where)
    return QuantConfig(quant_method=name, default=parsed.default, expert_default=parsed.expert_default,
                       rules=canonical_rules(parsed.rules), kv_cache=parsed.kv_cache, source=source)


def check_quantization_supported(config: QuantConfig | None, architecture_class: type, *,
                                 source: str | Path | None = None) -> None:
    """Refuse a parsed checkpoint quantization that ``architecture_class`` does not load.

    An architecture lists the formats it loads in ``supported_quantization``: Llama, Qwen3, the MoE
    families and DeepSeek ``("fp8", "compressed-tensors", "quark")`` (dense layers get linear methods,
    ``linear_methods``; experts expert methods, ``expert_methods``; what a layer cannot serve is refused
    by name when the model is built), gpt-oss ``("mxfp4", "fp8")`` (its MXFP4 experts kept packed;
    online FP8).
    """
    if config is None:
        return
    supported = tuple(getattr(architecture_class, "supported_quantization", ()))
    if config.quant_method in supported:
        return
    where = source or config.source or "checkpoint"
    what = "online quantization to" if config.online else "the checkpoint is quantised"
    raise UnsupportedQuantizationError(
        f"{where}: {what} (quant_method={config.quant_method!r}), which "
        f"{architecture_class.__name__} does not load (it loads unquantised weights"
        f"{''.join(f', and {m}' for m in supported)}); use an unquantised copy, or "
        "load_format='dummy' for random weights of these shapes")


# load_model(quantization=...) -> (weight format, activation scheme) applied to every dense linear layer.
ONLINE_QUANTIZATION = {
    "fp8": (FP8_PER_CHANNEL, ActivationScheme.DYNAMIC_PER_TOKEN),
    "fp8_block": (FP8_BLOCK_128, ActivationScheme.DYNAMIC_PER_GROUP_128),
}


def online_quant_config(quantization: str) -> QuantConfig:
    """The ``QuantConfig`` of ``load_model(..., quantization=...)``: ``"fp8"`` (FP8 per-channel weights,
    dynamic per-token activations) or ``"fp8_block"`` (128 x 128 block weights, 1 x 128 activation
    groups), every linear layer and MoE expert, weights quantized while they are read (``online=True``)."""
    if quantization not in ONLINE_QUANTIZATION:
        raise UnsupportedQuantizationError(
            f"quantization={quantization!r} is not supported; choose one of {sorted(ONLINE_QUANTIZATION)} or None")
    weight, activation = ONLINE_QUANTIZATION[quantization]
    scheme = make_scheme(weight, activation, where=f"quantization={quantization!r}")
    return QuantConfig(quant_method="fp8", default=scheme, expert_default=scheme, online=True,
                       source=f"quantization={quantization!r}")
