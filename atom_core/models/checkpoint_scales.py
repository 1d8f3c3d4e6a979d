"""The scales a checkpoint holds beside its quantized tensors, checked and placed as the loader reads them:
the FP8 KV-cache scales of the attention layers (compressed-tensors' ``k_scale`` / ``v_scale``, Quark's
``k_proj.output_scale``), the range of the linear layers' ``weight_scale`` / ``input_scale``, and the layers a
config that declares an FP8 KV cache leaves without theirs."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch
from torch import nn

from atom_core.models.checkpoint_files import tensor_source

logger = logging.getLogger(__name__)

__all__ = ["KV_SCALE_NAMES", "check_quant_scales", "kv_scale_target", "set_kv_scale", "warn_missing_kv_scales"]


# Checkpoint names of per-layer FP8 KV-cache scales -> (attention module prefix, "k" or "v"):
# compressed-tensors ``...self_attn.k_scale`` (older: one ``kv_scale`` for both), Quark
# ``...self_attn.k_proj.output_scale``.
KV_SCALE_NAMES = (re.compile(r"^(?P<attn>.+)\.(?P<kv>kv|k|v)_scale$"),
                   re.compile(r"^(?P<attn>.+)\.(?P<kv>[kv])_proj\.output_scale$"))


def kv_scale_target(name: str, modules: dict[str, nn.Module]) -> tuple[nn.Module, str] | None:
    """The attention layer (a module with ``checkpoint_k_scale``, at ``<attn>.attn``) and ``"k"``, ``"v"`` or
    ``"kv"`` (both) that checkpoint tensor ``name`` is a KV-cache scale of, or None."""
    for pattern in KV_SCALE_NAMES:
        m = pattern.match(name)
        if m is not None:
            attn = modules.get(m.group("attn") + ".attn")
            if attn is not None and hasattr(attn, "checkpoint_k_scale"):
                return attn, m.group("kv")
    return None


def set_kv_scale(attn: nn.Module, which: str, tensor: torch.Tensor, ckpt_name: str, file: Path,
                  device: torch.device) -> None:
    value = tensor.detach().float().reshape(-1)
    if value.numel() != 1 or not math.isfinite(value.item()) or value.item() <= 0:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} in {file}: a KV-cache scale must be one finite value "
                         f"> 0, got shape {tuple(tensor.shape)}" + (f" value {value.item()}" if value.numel() == 1 else ""))
    for one in ("k", "v") if which == "kv" else (which,):
        setattr(attn, f"checkpoint_{one}_scale", value.to(device))


# Parameters that hold quantization scales (``weight_scale``: the stored values' multipliers; ``input_scale``: a
# static activation scale, divided by): a checkpoint's must be > 0 (float dtypes only: e8m0 codes are bytes).
_WEIGHT_SCALE_SUFFIX = "weight_scale"
_INPUT_SCALE_SUFFIX = "input_scale"


def check_quant_scales(param_name: str, tensor: torch.Tensor, ckpt_name: str, file: Path | None) -> None:
    """A negative weight scale flips its values' sign and an input scale <= 0 makes the activations NaN or
    infinite: refused, naming the tensor. A zero weight scale is warned about (it zeroes its values: right
    only for an all-zero block, which some quantizers store that way)."""
    if not tensor.is_floating_point():
        return
    is_input = param_name.endswith(_INPUT_SCALE_SUFFIX)
    if not is_input and not param_name.endswith(_WEIGHT_SCALE_SUFFIX):
        return
    values = tensor.detach().float()
    bad = int((values <= 0).sum()) if is_input else int((values < 0).sum())
    if bad:
        raise ValueError(
            f"checkpoint tensor {ckpt_name!r} {tensor_source(file)}: {bad} of {values.numel()} "
            + ("input scales are <= 0 (a static activation scale divides the activations: it must be > 0)"
               if is_input else "weight scales are negative (a scale multiplies the stored values: it must be "
               ">= 0)") + f"; smallest {values.min().item()}")
    zeros = int((values == 0).sum()) if not is_input else 0
    if zeros:
        logger.warning("checkpoint tensor %r %s: %d of %d weight scales are 0 (their blocks or rows compute 0)",
                       ckpt_name, tensor_source(file), zeros, values.numel())


def warn_missing_kv_scales(model: nn.Module) -> None:
    """A config that declares an FP8 KV cache (``kv_cache_scheme``, quark's ``kv_cache_quant_config``) but
    leaves some attention layers without their KV-cache scales: warned, naming them (an FP8 pool uses 1.0
    there, vLLM's fallback)."""
    quant_config = getattr(model, "quant_config", None)
    if quant_config is None or quant_config.kv_cache is None or not hasattr(model, "kv_cache_scales"):
        return
    missing = [i for i, scales in enumerate(model.kv_cache_scales()) if any(s is None for s in scales)]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        logger.warning("the checkpoint's quantization_config declares an FP8 KV cache, but %d of %d attention "
                       "layers have no KV-cache scale (layers %s): an FP8 pool uses 1.0 there",
                       len(missing), len(model.kv_cache_scales()), shown)
