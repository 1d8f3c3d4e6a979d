"""Model classes keyed by the Hugging Face ``architectures`` name of ``config.json``.

Architecture modules are imported lazily: ``MODEL_MODULES`` names where each class lives, and
the module is imported the first time the class is asked for, so ``import atom_core.models``
does not import every model file. A class defined elsewhere (a user's own model) registers
itself with ``@register_model("MyArchForCausalLM")``, in the process that imports it; an installed
package reaches every process (worker ranks, the server's engine process, the CLI) through an entry
point of group ``atom_core.models``, named for the architecture, its value ``"module:ClassName"``
(in pyproject.toml: ``[project.entry-points."atom_core.models"]``, ``MyArchForCausalLM = "my_pkg.model:MyArch"``).
A class of one's own registered under a shipped architecture's name replaces the shipped class in that process
(a warning says so), whatever was loaded before; two classes of one's own under one name are refused.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points

# "Architecture": "module:ClassName" for the architectures shipped with atom_core.
MODEL_MODULES: dict[str, str] = {
    "LlamaForCausalLM": "atom_core.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "atom_core.models.llama:LlamaForCausalLM",  # Llama with a window on every layer
    "Qwen2ForCausalLM": "atom_core.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "atom_core.models.qwen3:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "atom_core.models.gemma2:Gemma2ForCausalLM",
    "Phi3ForCausalLM": "atom_core.models.phi3:Phi3ForCausalLM",
    "Qwen3MoeForCausalLM": "atom_core.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "atom_core.models.mixtral:MixtralForCausalLM",
    "Glm4MoeForCausalLM": "atom_core.models.glm4_moe:Glm4MoeForCausalLM",
    "GptOssForCausalLM": "atom_core.models.gpt_oss:GptOssForCausalLM",
    "DeepseekV2ForCausalLM": "atom_core.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "atom_core.models.deepseek_v2:DeepseekV3ForCausalLM",  # also Kimi-K2 (kimi_k2)
    "DeepseekV32ForCausalLM": "atom_core.models.deepseek_v32:DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM": "atom_core.models.deepseek_v32:GlmMoeDsaForCausalLM",  # GLM-5, GLM-5.1
}

ENTRY_POINT_GROUP = "atom_core.models"
logger = logging.getLogger(__name__)

_registered: dict[str, type] = {}


@functools.cache
def plugin_modules() -> dict[str, str]:
    """"Architecture": "module:ClassName" of the installed packages' ``atom_core.models`` entry points (read once)."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _same_class(a: type, b: type) -> bool:
    """One class definition, also when its file was imported under two module names (a script and pytest)."""
    if (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__):
        return True
    try:
        return a.__qualname__ == b.__qualname__ and inspect.getsourcefile(a) == inspect.getsourcefile(b) is not None
    except TypeError:  # a class without a source file (built-in, or made by exec)
        return False


_REGISTER_HINT = ("; a model class of your own registers with atom_core.models.register_model in the process that "
                  "imports it, or in every process through an atom_core.models entry point of its package "
                  "(docs/models.md, \"Adding an architecture\")")


def register_model(arch_name: str) -> Callable[[type], type]:
    """Class decorator: make ``get_model_class(arch_name)`` return the class.

    Registering a different class under a name another class of one's own holds raises ValueError
    (re-registering the same class, e.g. on module reload, is allowed); under a shipped architecture's name
    it replaces the shipped class (module docstring).
    """
    if not isinstance(arch_name, str) or not arch_name:
        raise ValueError(f"arch_name must be a non-empty string, got {arch_name!r}")

    def decorator(cls: type) -> type:
        old = _registered.get(arch_name)
        if old is not None and not _same_class(old, cls):
            if _is_shipped(arch_name, cls):  # its module imported after a class of one's own took the name
                return cls
            if not _is_shipped(arch_name, old):
                raise ValueError(
                    f"architecture {arch_name!r} is already registered to {old.__module__}.{old.__qualname__}"
                )
        if arch_name in MODEL_MODULES and not _is_shipped(arch_name, cls):
            logger.warning("architecture %r: %s.%s replaces atom_core's %s in this process", arch_name,
                           cls.__module__, cls.__qualname__, MODEL_MODULES[arch_name])
        _registered[arch_name] = cls
        return cls

    return decorator


def _is_shipped(arch_name: str, cls: type) -> bool:
    """Whether ``cls`` is the class atom_core ships for ``arch_name``."""
    return MODEL_MODULES.get(arch_name) == f"{cls.__module__}:{cls.__qualname__}"


def supported_architectures() -> list[str]:
    """Sorted names that ``get_model_class`` accepts (shipped and registered)."""
    return sorted(set(MODEL_MODULES) | set(_registered) | set(plugin_modules()))


def get_model_class(arch: str) -> type:
    """The model class for an ``architectures`` name; ValueError listing the supported ones if unknown."""
    if arch in _registered:
        return _registered[arch]
    target = MODEL_MODULES.get(arch) or plugin_modules().get(arch)
    if target is None:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(supported_architectures())}"
                         f"{_REGISTER_HINT}")
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    try:
        cls = getattr(module, class_name)
    except AttributeError as e:
        raise ImportError(f"{module_name} defines no {class_name} (listed for architecture {arch!r})") from e
    _registered.setdefault(arch, cls)
    return cls


def is_supported_architecture(name: str) -> bool:
    """Whether ``get_model_class(name)`` finds a class (shipped, registered or a plugin's), without importing it."""
    return name in _registered or name in MODEL_MODULES or name in plugin_modules()


def resolve_architecture(architectures: Iterable[str]) -> tuple[str, type]:
    """First name in ``architectures`` that is supported, with its class; ValueError if none is."""
    names = list(architectures)
    for name in names:
        if is_supported_architecture(name):
            return name, get_model_class(name)
    if not names:
        raise ValueError(
            f"config names no architecture ('architectures' is empty and model_type is not known); "
            f"supported: {', '.join(supported_architectures())}"
        )
    raise ValueError(
        f"unsupported architecture {names[0] if len(names) == 1 else names!r}; "
        f"supported: {', '.join(supported_architectures())}{_REGISTER_HINT}"
    )
