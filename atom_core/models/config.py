"""ModelConfig: the fields of a Hugging Face ``config.json`` that the models read, parsed without transformers.

Common fields become typed attributes; every other key is kept in ``extra`` and is also
readable as an attribute (``cfg.moe_intermediate_size`` falls back to
``cfg.extra["moe_intermediate_size"]``).

Rotary embedding parameters come in two spellings, both accepted and normalised to the same
result (a file with both: ``rope_scaling``, as transformers reads it):

- published checkpoints: ``rope_theta`` plus ``rope_scaling`` (``{"type": "linear", ...}`` in
  older files, ``{"rope_type": ...}`` in newer ones);
- transformers 5: ``rope_parameters = {"rope_type": ..., "rope_theta": ..., ...}``, or one such
  dict per attention layer type (``{"full_attention": {...}, "sliding_attention": {...}}``).

Normalised: ``rope_theta`` (float) and ``rope_scaling`` (a dict with ``rope_type`` and the
scaling keys, without ``rope_theta``; ``None`` for plain RoPE), plus ``rope_by_layer_type``
(``{layer_type: {"rope_theta": float, "rope_scaling": dict | None}}``) when the file gives
per-layer-type parameters. ``rope_params(layer_type)`` returns the pair for a layer type.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from atom_core.cache.pool_sizing import host_memory_available_bytes
from atom_core.ops.reference.rope import ROPE_TYPES

logger = logging.getLogger(__name__)

# Defaults for keys a config.json may leave out, by model_type: transformers' (its config classes'
# defaults; tests/models/test_config.py checks each against them). Keys that are not ModelConfig
# fields (n_shared_experts, ...) land in ``extra`` when the file lacks them.
GENERIC_DEFAULTS: dict[str, Any] = {
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
}
_DEEPSEEK_V3_ROUTING = {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                        "norm_topk_prob": True, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8}
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "mistral": {"rope_theta": 10000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6},
    "qwen2": {"rope_theta": 10000.0, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "attention_bias": True},  # (no config key: Qwen2's q/k/v projections always have a bias)
    "qwen3": {"rope_theta": 10000.0, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "head_dim": 128},
    # (Gemma2 reads hidden_activation; hidden_act, which its configs also carry, mirrors it)
    "gemma2": {"rope_theta": 10000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": True, "head_dim": 256, "sliding_window": 4096,
               "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
               "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    # (Phi-3 has no attention_bias / mlp_bias keys: its projections never have a bias)
    "phi3": {"rope_theta": 10000.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "partial_rotary_factor": 1.0},
    "qwen3_moe": {"rope_theta": 10000.0, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                  "norm_topk_prob": False, "num_experts_per_tok": 8},
    "mixtral": {"rope_theta": 1e6, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "num_experts_per_tok": 2},
    "glm4_moe": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5,
                 "n_shared_experts": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
                 "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "use_qk_norm": False,
                 "num_experts_per_tok": 8},
    "gpt_oss": {"rope_theta": 150000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "attention_bias": True, "head_dim": 64, "sliding_window": 128, "num_experts_per_tok": 4,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}},
    "deepseek_v2": {"max_position_embeddings": 2048, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
                    "first_k_dense_replace": 0, "norm_topk_prob": False, "topk_method": "greedy"},
    "deepseek_v3": {"max_position_embeddings": 4096, "rope_interleave": True, **_DEEPSEEK_V3_ROUTING},
    "deepseek_v32": {"max_position_embeddings": 163840, **_DEEPSEEK_V3_ROUTING},
    # Kimi-K2's checkpoints are DeepseekV3ForCausalLM with their own model_type (and DeepseekV3Config's code)
    "kimi_k2": {"max_position_embeddings": 4096, "rope_interleave": True, **_DEEPSEEK_V3_ROUTING},
    "glm_moe_dsa": {"max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
                    **_DEEPSEEK_V3_ROUTING, "n_group": 1, "topk_group": 1},
}
# Architecture to assume when config.json has no "architectures" list (e.g. a bare
# PretrainedConfig.save_pretrained output).
ARCH_FOR_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_LAYER_TYPE_KEYS = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")
# ARCH_DEFAULTS keys that the parser applies itself (the others, when absent, go to ``extra``).
_FIELD_DEFAULTS = frozenset(GENERIC_DEFAULTS) | {"head_dim", "sliding_window", "rope_scaling"}
_NO_SLIDING_WINDOW = ("llama",)  # transformers' Llama ignores a sliding_window key
_WINDOW_ONLY_WHEN_USED = ("qwen2", "qwen3", "qwen3_moe")  # sliding_window applies only with use_sliding_window


def _default_layer_types(model_type: str, sliding_window: int | None, max_window_layers: Any,
                         num_layers: int) -> list[str]:
    """Each layer's attention when config.json gives no ``layer_types``, as transformers derives them."""
    if sliding_window is None or model_type in _NO_SLIDING_WINDOW:
        return ["full_attention"] * num_layers
    if model_type in ("gpt_oss", "gemma2"):  # sliding, full, sliding, ...
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if model_type in ("qwen2", "qwen3") or max_window_layers is not None:
        # Qwen2's rule: layers from max_window_layers (default 28) on use the window.
        first = 28 if max_window_layers is None else _as_int(max_window_layers, "max_window_layers", minimum=0)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers


def parse_dtype(value: Any, *, what: str = "dtype") -> torch.dtype | None:
    """``"bfloat16"``, ``"torch.float16"``, a ``torch.dtype`` or None -> ``torch.dtype | None``."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.removeprefix("torch.").lower()
        if key in _DTYPES:
            return _DTYPES[key]
        if key == "auto":
            return None
    raise ValueError(f"{what}: unsupported dtype {value!r}; expected 'auto' or one of {sorted(_DTYPES)}")


def normalize_rope_scaling(scaling: dict | None, *, what: str = "rope_scaling") -> tuple[float | None, dict | None]:
    """Split a rope dict into ``(rope_theta or None, scaling dict or None)``.

    The old key ``type`` becomes ``rope_type``; a dict that only says ``rope_type: default``
    becomes None (plain RoPE).
    """
    if scaling is None:
        return None, None
    if not isinstance(scaling, dict):
        raise ValueError(f"{what} must be a dict or null, got {type(scaling).__name__}")
    out = dict(scaling)
    theta = out.pop("rope_theta", None)
    old_type = out.pop("type", None)
    if "rope_type" not in out and old_type is not None:
        out["rope_type"] = old_type
    out.setdefault("rope_type", "default")
    if out["rope_type"] == "mrope":  # older Qwen2-VL spelling of plain RoPE with sections
        out["rope_type"] = "default"
    if theta is not None:
        theta = _as_float(theta, f"{what}.rope_theta")
    if out == {"rope_type": "default"}:
        out = None
    return theta, out


def _may_load(architectures) -> bool:
    """Whether some name of ``architectures`` is one atom_core loads (or none is given): the assumed-defaults
    warning is for those; a config of an architecture it refuses would only warn before the refusal."""
    from atom_core.models.registry import is_supported_architecture

    names = list(architectures or ())
    return not names or any(is_supported_architecture(name) for name in names)


def _as_float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _as_int(value: Any, what: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def _as_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false, got {value!r}")
    return value


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of a checkpoint. Build with ``from_dict`` or ``from_file``."""

    architectures: list[str]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int | None
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    sliding_window: int | None
    layer_types: list[str]
    bos_token_id: int | None
    eos_token_id: list[int]
    torch_dtype: torch.dtype | None
    rope_by_layer_type: dict[str, dict] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: fall back to the keys kept in ``extra``.
        if name.startswith("__") or name == "extra":
            raise AttributeError(name)
        extra = self.__dict__.get("extra", {})
        if name in extra:
            return extra[name]
        raise AttributeError(f"ModelConfig has no field or extra key {name!r}")

    def get(self, name: str, default: Any = None) -> Any:
        """A field or an ``extra`` key, or ``default`` when neither exists."""
        try:
            return getattr(self, name)
        except AttributeError:
            return default

    def rope_params(self, layer_type: str | None = None) -> tuple[float, dict | None]:
        """``(rope_theta, rope_scaling)`` for a layer type (the global pair when not per-type)."""
        if layer_type is not None and self.rope_by_layer_type and layer_type in self.rope_by_layer_type:
            entry = self.rope_by_layer_type[layer_type]
            return entry["rope_theta"], entry["rope_scaling"]
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Parse a ``config.json`` file (or a folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # bytes that are not UTF-8 text land here too
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from e

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Parse a config dict (the contents of config.json); unknown keys go to ``extra``."""
        if not isinstance(d, dict):
            raise TypeError(f"config must be a dict, got {type(d).__name__}")
        d = dict(d)
        used: set[str] = set()

        def take(key: str, default: Any = None) -> Any:
            used.add(key)
            return d.get(key, default)

        model_type = take("model_type") or ""
        if not isinstance(model_type, str):
            raise ValueError(f"model_type must be a string, got {model_type!r}")
        defaults = {**GENERIC_DEFAULTS, **ARCH_DEFAULTS.get(model_type, {})}
        # keys the file leaves out, filled from GENERIC_DEFAULTS for a family not in ARCH_DEFAULTS
        assumed: list[str] = []

        def take_or_default(key: str) -> Any:
            value = take(key)
            if value is None and model_type not in ARCH_DEFAULTS:
                assumed.append(key)
            return defaults[key] if value is None else value

        architectures = take("architectures") or []
        if isinstance(architectures, str):
            architectures = [architectures]
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise ValueError(f"architectures must be a list of strings, got {architectures!r}")
        if not architectures and model_type in ARCH_FOR_MODEL_TYPE:
            architectures = [ARCH_FOR_MODEL_TYPE[model_type]]

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if d.get(key) is None:
                raise ValueError(f"config is missing required key {key!r}")
        vocab_size = _as_int(take("vocab_size"), "vocab_size")
        hidden_size = _as_int(take("hidden_size"), "hidden_size")
        num_layers = _as_int(take("num_hidden_layers"), "num_hidden_layers")
        num_heads = _as_int(take("num_attention_heads"), "num_attention_heads")
        num_kv_heads = take("num_key_value_heads")
        num_kv_heads = num_heads if num_kv_heads is None else _as_int(num_kv_heads, "num_key_value_heads")
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        head_dim = take("head_dim") if "head_dim" in d else defaults.get("head_dim")
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(
                    f"head_dim is absent and hidden_size={hidden_size} is not divisible by "
                    f"num_attention_heads={num_heads}"
                )
            head_dim = hidden_size // num_heads
        head_dim = _as_int(head_dim, "head_dim")
        intermediate_size = take("intermediate_size")
        if intermediate_size is not None:
            intermediate_size = _as_int(intermediate_size, "intermediate_size")

        rope_theta, rope_scaling, rope_by_layer_type = cls._parse_rope(d, used, defaults)

        use_sliding_window = take("use_sliding_window")
        if use_sliding_window is None and model_type in _WINDOW_ONLY_WHEN_USED:
            use_sliding_window = False  # (transformers' default)
        sliding_window = take("sliding_window") if "sliding_window" in d else defaults.get("sliding_window")
        # Qwen2/Qwen3 configs carry a sliding_window value that only applies when use_sliding_window is true.
        if use_sliding_window is False:
            sliding_window = None
        if sliding_window is not None:
            sliding_window = _as_int(sliding_window, "sliding_window")
        layer_types = take("layer_types")
        if layer_types is None:
            layer_types = _default_layer_types(model_type, sliding_window, d.get("max_window_layers"), num_layers)
            if sliding_window is not None and model_type not in ARCH_DEFAULTS:
                assumed.append("layer_types")
        if (not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types)
                or len(layer_types) < num_layers):
            raise ValueError(
                f"layer_types must be a list of at least num_hidden_layers={num_layers} strings, got {layer_types!r}"
            )

        eos = take("eos_token_id")
        if eos is None:
            eos = []
        elif isinstance(eos, int) and not isinstance(eos, bool):
            eos = [eos]
        if not isinstance(eos, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
            raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
        bos = take("bos_token_id")
        if bos is not None:
            bos = _as_int(bos, "bos_token_id", minimum=0)
        # A special token id the embedding has no row for would fail (or never match) only at run time.
        for key, ids in (("eos_token_id", eos), ("bos_token_id", [] if bos is None else [bos])):
            outside = [i for i in ids if not 0 <= i < vocab_size]
            if outside:
                raise ValueError(f"{key} {outside[0]} is outside the vocabulary: token ids must lie in "
                                 f"[0, vocab_size={vocab_size})")

        dtype_value = take("torch_dtype")
        dtype_value = take("dtype") if dtype_value is None else dtype_value  # transformers 5 writes "dtype"

        hidden_act = take_or_default("hidden_act")
        if not isinstance(hidden_act, str):
            raise ValueError(f"hidden_act must be a string, got {hidden_act!r}")

        cfg = cls(
            architectures=list(architectures),
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=_as_int(take_or_default("max_position_embeddings"), "max_position_embeddings"),
            rms_norm_eps=_as_float(take_or_default("rms_norm_eps"), "rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_as_bool(take_or_default("tie_word_embeddings"), "tie_word_embeddings"),
            attention_bias=_as_bool(take_or_default("attention_bias"), "attention_bias"),
            mlp_bias=_as_bool(take_or_default("mlp_bias"), "mlp_bias"),
            hidden_act=hidden_act,
            sliding_window=sliding_window,
            layer_types=list(layer_types),
            bos_token_id=bos,
            eos_token_id=list(eos),
            torch_dtype=parse_dtype(dtype_value, what="torch_dtype"),
            rope_by_layer_type=rope_by_layer_type,
        )
        cfg.extra = {k: v for k, v in d.items() if k not in used}
        # transformers 5 moves partial_rotary_factor into the rope dict and its models read it there,
        # though a stale top-level copy may be saved beside it (GLM-4-MoE's default 0.5): the dict's
        # value wins. It is kept top-level, like older files.
        factors = {entry.pop("partial_rotary_factor")
                   for entry in [cfg.rope_scaling] + [e["rope_scaling"] for e in (rope_by_layer_type or {}).values()]
                   if entry is not None and "partial_rotary_factor" in entry}
        if len(factors) > 1:
            raise ValueError(f"partial_rotary_factor differs between layer types ({sorted(factors)}): not supported")
        if factors:
            cfg.extra["partial_rotary_factor"] = factors.pop()
        if cfg.rope_scaling == {"rope_type": "default"}:
            cfg.rope_scaling = None
        for entry in (rope_by_layer_type or {}).values():
            if entry["rope_scaling"] == {"rope_type": "default"}:
                entry["rope_scaling"] = None
        # transformers: the scaled types' pretraining length is a top-level original_max_position_embeddings
        # when the config has one (Phi-3's class always does: 4096 by default), else the dict's, else
        # max_position_embeddings; per-layer-type dicts never take the top-level key. Phi-3's config also reads
        # its older rope type names "su" and "yarn" as longrope.
        top_level = d.get("original_max_position_embeddings", 4096 if model_type == "phi3" else None)
        for scaling, per_layer_type in [(cfg.rope_scaling, False)] + [
                (e["rope_scaling"], True) for e in (rope_by_layer_type or {}).values()]:
            if scaling is None:
                continue
            if model_type == "phi3" and scaling.get("rope_type") in ("su", "yarn"):
                scaling["rope_type"] = "longrope"
            if scaling.get("rope_type") not in ("llama3", "yarn", "longrope"):
                continue
            if top_level is not None and not per_layer_type:
                scaling["original_max_position_embeddings"] = _as_int(top_level, "original_max_position_embeddings")
            else:
                scaling.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
        for scaling in [cfg.rope_scaling] + [e["rope_scaling"] for e in (rope_by_layer_type or {}).values()]:
            if scaling is not None and scaling["rope_type"] not in ROPE_TYPES:
                raise ValueError(f"model_type {model_type!r}: rope_type {scaling['rope_type']!r} is not implemented "
                                 f"(supported: {', '.join(ROPE_TYPES)})")
        if use_sliding_window is not None:
            cfg.extra["use_sliding_window"] = use_sliding_window
        for key, value in defaults.items():  # the family's defaults of keys that are not fields
            if key not in _FIELD_DEFAULTS and key not in d:
                cfg.extra.setdefault(key, copy.deepcopy(value))
        if assumed and model_type and _may_load(cfg.architectures):
            logger.warning("config.json of model_type %r, whose family's defaults atom_core does not know, leaves "
                           "out %s: taking %s (Llama's); if the family's defaults differ, add them to "
                           "atom_core.models.config.ARCH_DEFAULTS (or write them into config.json)",
                           model_type, ", ".join(assumed),
                           ", ".join(f"{k}={getattr(cfg, k, None) if k == 'layer_types' else defaults[k]!r}"
                                     for k in assumed))
        return cfg

    @staticmethod
    def _parse_rope(d: dict, used: set[str], defaults: dict) -> tuple[float, dict | None, dict | None]:
        """Normalise ``rope_theta``/``rope_scaling`` and ``rope_parameters`` (see the module docstring)."""
        used.update(("rope_theta", "rope_scaling", "rope_parameters"))
        top_theta = d.get("rope_theta")
        top_theta = None if top_theta is None else _as_float(top_theta, "rope_theta")
        theta_s, scaling = normalize_rope_scaling(d.get("rope_scaling"), what="rope_scaling")
        params = d.get("rope_parameters")
        by_type = None
        if params is not None and d.get("rope_scaling") is not None:
            # transformers: a rope_scaling dict replaces rope_parameters whole (rope_theta included: it then
            # comes from rope_scaling, the top-level key, or the family's default).
            logger.warning("config has both rope_scaling and rope_parameters: rope_scaling is used and "
                           "rope_parameters ignored, as transformers does (rope_theta %s)",
                           theta_s if theta_s is not None else top_theta if top_theta is not None else
                           f"{float(defaults['rope_theta'])} by default")
        elif params is not None:
            if not isinstance(params, dict):
                raise ValueError(f"rope_parameters must be a dict, got {type(params).__name__}")
            if params and all(isinstance(v, dict) for v in params.values()) and (
                    set(params) & set(_LAYER_TYPE_KEYS)):
                by_type = {}
                for layer_type, entry in params.items():
                    t, s = normalize_rope_scaling(entry, what=f"rope_parameters.{layer_type}")
                    if t is None:
                        t = top_theta if top_theta is not None else float(defaults["rope_theta"])
                    by_type[layer_type] = {"rope_theta": t, "rope_scaling": s}
                main = by_type.get("full_attention") or next(iter(by_type.values()))
                theta_p = main["rope_theta"]
                scaling_p = None if main["rope_scaling"] is None else dict(main["rope_scaling"])
            else:
                theta_p, scaling_p = normalize_rope_scaling(params, what="rope_parameters")
            theta_s, scaling = theta_p, scaling_p
        theta = theta_s if theta_s is not None else top_theta
        if theta is None:
            theta = float(defaults["rope_theta"])
        if d.get("rope_scaling") is None and params is None and defaults.get("rope_scaling") is not None:
            scaling = dict(defaults["rope_scaling"])  # the family's default scaling (gpt-oss: YaRN)
        return theta, scaling, by_type


# --- what a config costs in memory (checked by build_model / load_model before anything is built) ---


def cuda_memory_info(device: torch.device | str) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device: ``torch.cuda.mem_get_info`` after a garbage collection and
    ``torch.cuda.empty_cache()``. torch's allocator keeps the blocks of dropped tensors (a model or an engine
    built before this one) cached, and the driver counts them as used until they are given back; without
    this, a second model or KV pool that fits in this process would be refused or sized too small."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def available_memory_bytes(device: torch.device | str | None) -> int | None:
    """Bytes a new allocation on ``device`` can take now; None when unknown (then nothing is refused).

    CUDA: the device's free memory (:func:`cuda_memory_info`, the allocator's cache of dropped tensors
    counted as free); CPU (and None): the host's (``cache.pool_sizing.host_memory_available_bytes``);
    other devices (meta, ...): None.
    """
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        try:
            return int(cuda_memory_info(device)[0])
        except (RuntimeError, AssertionError, ValueError):  # no CUDA here: the build itself will say so
            return None
    return host_memory_available_bytes() if device.type == "cpu" else None


def memory_name(device: torch.device | str | None) -> str:
    """How errors name the memory of ``device``: "host memory" or "cuda:0 memory"."""
    device = torch.device("cpu" if device is None else device)
    return "host memory" if device.type == "cpu" else f"{device} memory"
