"""Model definitions, weight loading and the architecture registry.

``load_model(folder)`` builds the model named by ``config.json`` and fills it from the
folder's ``*.safetensors``; ``build_model(config)`` builds one with dummy or zero weights.
Both return the model in eval mode. Architecture files are imported only when a model of
that architecture is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from atom_core.models.config import ModelConfig, parse_dtype
from atom_core.models.dummy_weights import initialize_dummy_weights, initialize_zero_weights
from atom_core.models.loader import LoadReport, load_weights, process_weights_after_loading
from atom_core.models.registry import (
    get_model_class,
    register_model,
    resolve_architecture,
    supported_architectures,
)

__all__ = [
    "LoadReport",
    "ModelConfig",
    "build_model",
    "get_model_class",
    "load_model",
    "load_weights",
    "register_model",
    "supported_architectures",
]

_LOAD_FORMATS = ("auto", "safetensors", "dummy", "zeros")


def _default_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _default_dtype(config: ModelConfig, dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """Explicit dtype > (on a GPU) the checkpoint's torch_dtype, else bfloat16 > (on CPU) float32."""
    if dtype is not None:
        if isinstance(dtype, str):
            dtype = parse_dtype(dtype, what="dtype")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or a name like 'bfloat16', got {dtype!r}")
        return dtype
    if device.type == "cpu":
        return torch.float32
    return config.torch_dtype or torch.bfloat16


def _instantiate(config: ModelConfig, dtype: torch.dtype, device: torch.device, tp_rank: int = 0,
                 tp_size: int = 1, expert_parallel: bool = False) -> nn.Module:
    _, cls = resolve_architecture(config.architectures)
    # (a single-rank build passes no parallel arguments: a registered model need not take them)
    tp = {} if (tp_rank, tp_size) == (0, 1) else {"tp_rank": tp_rank, "tp_size": tp_size}
    if expert_parallel:
        tp["expert_parallel"] = True
    # Parameters created without an explicit device land on `device` (no CPU detour).
    with torch.device(device):
        return cls(config, dtype=dtype, device=device, **tp)


def _initialize(model: nn.Module, load_format: str, seed: int) -> None:
    if load_format == "dummy":
        initialize_dummy_weights(model, seed=seed)
    else:
        initialize_zero_weights(model)
    process_weights_after_loading(model)


def build_model(config: ModelConfig | dict[str, Any], *, dtype: torch.dtype | str | None = None,
                device: str | torch.device | None = None, load_format: str = "dummy",
                seed: int = 0, tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False) -> nn.Module:
    """A model of ``config``'s architecture with ``"dummy"`` (seeded normal(0, 0.02)) or ``"zeros"`` weights.

    ``config``: a ``ModelConfig`` or a config.json-style dict. ``device`` defaults to CUDA when
    available, else CPU; ``dtype`` to the config's ``torch_dtype`` on a GPU and float32 on CPU.
    ``tp_rank``/``tp_size``: this process's tensor-parallel shard (the default process group
    reduces across the ranks); ``expert_parallel``: a MoE model's experts are split across those
    ranks instead of each expert's intermediate dim.
    """
    if load_format not in ("dummy", "zeros"):
        raise ValueError(f"build_model: load_format must be 'dummy' or 'zeros', got {load_format!r}")
    if isinstance(config, dict):
        config = ModelConfig.from_dict(config)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig or a dict, got {type(config).__name__}")
    device = _default_device(device)
    model = _instantiate(config, _default_dtype(config, dtype, device), device, tp_rank, tp_size, expert_parallel)
    _initialize(model, load_format, seed)
    return model.eval()


def _check_quantization(config: ModelConfig, cls: type, folder: Path, load_format: str) -> None:
    """Refuse a checkpoint quantised in a way its architecture does not load (``quant_method`` in
    ``quantization_config``; ``cls.supported_quantization`` lists what it does: gpt-oss's MXFP4)."""
    quant = config.get("quantization_config")
    if not quant or load_format in ("dummy", "zeros"):
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    supported = getattr(cls, "supported_quantization", ())
    if method not in supported:
        raise ValueError(
            f"{folder}: the checkpoint is quantised (quant_method={method!r}), which "
            f"{cls.__name__} does not load (it loads unquantised weights"
            f"{''.join(f', and {m}' for m in supported)}); use an unquantised copy, or "
            "load_format='dummy' for random weights of these shapes"
        )


def load_model(path: str | Path, *, dtype: torch.dtype | str | None = None,
               device: str | torch.device | None = None, load_format: str = "auto", tp_rank: int = 0,
               tp_size: int = 1, expert_parallel: bool = False) -> nn.Module:
    """Build the model described by ``path/config.json`` and load its weights.

    ``load_format``: ``"auto"``/``"safetensors"`` read ``path/*.safetensors`` (see
    ``loader.load_weights``); ``"dummy"``/``"zeros"`` skip the shards. Defaults and
    ``tp_rank``/``tp_size``/``expert_parallel`` as in ``build_model`` (each rank keeps its shard of
    every tensor).
    Raises FileNotFoundError for a missing folder, config.json or shards and
    ValueError for an unsupported architecture.
    """
    if load_format not in _LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {load_format!r}")
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model folder {folder}")
    config = ModelConfig.from_file(folder / "config.json")
    _, cls = resolve_architecture(config.architectures)  # unsupported architecture: fail before anything is built
    _check_quantization(config, cls, folder, load_format)
    if load_format in ("auto", "safetensors") and not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(
            f"no *.safetensors files in {folder} (pass load_format='dummy' to build it with random weights)"
        )
    device = _default_device(device)
    model = _instantiate(config, _default_dtype(config, dtype, device), device, tp_rank, tp_size, expert_parallel)
    if load_format in ("dummy", "zeros"):
        _initialize(model, load_format, seed=0)
    else:
        load_weights(model, folder)
    return model.eval()
