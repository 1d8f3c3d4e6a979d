"""Per-layer rules of a quantization config, and the checkpoint modules a model layer is made of.

A rule says "checkpoint modules whose name matches ``pattern`` get ``scheme``"; a config's rules
are tried in order and the first that matches wins (exclusions first, then the format's own
precedence; see each parser). Names are checkpoint module names (Hugging Face's:
``model.layers.3.self_attn.q_proj``, ``model.layers.3.mlp.experts.7.gate_proj``), which is what
every config's patterns are written against.

Match kinds, each the semantics of the tool that writes it:

- ``"linear"``: every linear layer (compressed-tensors' target ``"Linear"``, quark's
  ``layer_type_quant_config["Linear"]``); the layers asked about are all linear;
- ``"exact"``: the whole name (compressed-tensors' plain targets and ``ignore`` entries);
- ``"regex"``: ``re.match`` from the start of the name (compressed-tensors' ``re:`` entries);
- ``"fnmatch"``: ``fnmatch.fnmatchcase`` (quark's ``layer_quant_config`` keys and ``exclude``);
- ``"hf_module"``: a Hugging Face ``modules_to_not_convert`` entry: transformers'
  ``should_convert_module`` rule (a regex from the start up to a dotted boundary, so
  ``model.layers.1`` covers ``model.layers.1.mlp`` but not ``model.layers.11``, or a name suffix),
  or an ``fnmatch`` pattern (quark writes its ``exclude`` into the HF-style ``ignored_layers``).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from atom_core.models.quantization.schemes import KVCacheScheme, LinearScheme, UnsupportedQuantizationError

MATCH_KINDS = ("linear", "exact", "regex", "fnmatch", "hf_module")
_HF_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"  # transformers' module boundary after a modules_to_not_convert key


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern | None:
    try:
        return re.compile(pattern)
    except re.error:
        return None


def _hf_module_matches(name: str, pattern: str) -> bool:
    if name.endswith(pattern) or fnmatch.fnmatchcase(name, pattern):
        return True
    bounded = _compiled(rf"(?:{pattern}){_HF_BOUNDARY}")
    return bounded is not None and bounded.match(name) is not None


@dataclass(frozen=True)
class LayerRule:
    """Checkpoint modules matching ``pattern`` (by ``match``, one of ``MATCH_KINDS``) get ``scheme``.

    ``origin`` says where the rule came from (``"ignore 'lm_head'"``) for error messages; it takes
    no part in equality or the config hash."""

    match: str
    pattern: str
    scheme: LinearScheme
    origin: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.match not in MATCH_KINDS:
            raise ValueError(f"LayerRule.match must be one of {MATCH_KINDS}, got {self.match!r}")
        if self.match == "regex" and _compiled(self.pattern) is None:
            raise ValueError(f"{self.origin or 'LayerRule'}: {self.pattern!r} is not a valid regular expression")

    def matches(self, name: str) -> bool:
        if self.match == "linear":
            return True
        if self.match == "exact":
            return name == self.pattern
        if self.match == "regex":
            return _compiled(self.pattern).match(name) is not None
        if self.match == "fnmatch":
            return fnmatch.fnmatchcase(name, self.pattern)
        return _hf_module_matches(name, self.pattern)

    def to_dict(self) -> dict:
        return {"match": self.match, "pattern": self.pattern, "scheme": self.scheme.to_dict()}


class ParsedRules(NamedTuple):
    """What a format parser returns: ``QuantConfig``'s fields (see ``config.QuantConfig``)."""

    quant_method: str
    default: LinearScheme
    expert_default: LinearScheme
    rules: tuple[LayerRule, ...]
    kv_cache: KVCacheScheme | None


def canonical_rules(rules: Sequence[LayerRule]) -> tuple[LayerRule, ...]:
    """``rules`` with each run of adjacent rules of one scheme sorted and deduplicated.

    First match wins, so the order inside such a run never changes a layer's scheme; sorting it
    makes configs that list the same ignore entries or targets in another order equal (and hash
    equal)."""
    out: list[LayerRule] = []
    run: list[LayerRule] = []
    for rule in list(rules) + [None]:
        if run and (rule is None or rule.scheme != run[0].scheme):
            seen = set()
            for r in sorted(run, key=lambda r: (r.match, r.pattern)):
                if (r.match, r.pattern) not in seen:
                    seen.add((r.match, r.pattern))
                    out.append(r)
            run = []
        if rule is not None:
            run.append(rule)
    return tuple(out)


def checkpoint_modules(layer_name: str, packed_modules_mapping: Mapping[str, Any] | None = None,
                       expert_params_mapping: Sequence[tuple] | None = None) -> tuple[tuple[str, ...], bool]:
    """The checkpoint module names whose tensors model layer ``layer_name`` holds, and whether it is
    a MoE experts layer.

    - experts: ``expert_params_mapping`` entries ``(checkpoint suffix, parameter suffix, shard_id)``
      whose suffix starts with the layer's last name component: ``experts.3.gate_proj.weight`` under
      ``model.layers.0.mlp.experts`` is module ``model.layers.0.mlp.experts.3.gate_proj``; a stacked
      checkpoint (GPT-OSS ``experts.gate_up_proj``) is the experts module itself;
    - packed: ``packed_modules_mapping`` ``{"q_proj": ("qkv_proj", "q"), ...}`` gives the parts of a
      fused layer (``...qkv_proj`` -> ``...q_proj``, ``...k_proj``, ``...v_proj``); a list value
      ``{"qkv": [("q_proj", rows), ...]}`` makes ``...q_proj`` come from checkpoint module ``...qkv``;
    - otherwise the layer itself.
    """
    head, _, last = layer_name.rpartition(".")
    head = head + "." if head else ""
    experts: list[str] = []
    for entry in expert_params_mapping or ():
        suffix = entry[0]
        if suffix.split(".", 1)[0] == last and "." in suffix:
            module = head + suffix.rpartition(".")[0]
            if module not in experts:
                experts.append(module)
    if experts:
        return tuple(experts), True
    mapping = packed_modules_mapping or {}
    parts = [head + key for key, value in mapping.items() if isinstance(value, tuple) and value[0] == last]
    if parts:
        return tuple(parts), False
    for key, value in mapping.items():
        if isinstance(value, list) and any(sub == last for sub, _ in value):
            return (head + key,), False
    return (layer_name,), False


def string_list(value: Any, where: str) -> list[str]:
    """``value`` as a list of strings (None: empty), or ``UnsupportedQuantizationError`` naming ``where``."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UnsupportedQuantizationError(f"{where} must be a list of strings, got {value!r}")
    return value


def make_rule(match: str, pattern: str, scheme: LinearScheme, *, origin: str, where: str) -> LayerRule:
    """``LayerRule(match, pattern, scheme, origin)``; an invalid regex is refused naming ``where``."""
    if match in ("regex", "fnmatch", "exact") and not pattern:
        raise UnsupportedQuantizationError(f"{where}: empty pattern in {origin}")
    if match == "regex" and _compiled(pattern) is None:
        raise UnsupportedQuantizationError(f"{where}: {origin} is not a valid regular expression")
    return LayerRule(match, pattern, scheme, origin=origin)
