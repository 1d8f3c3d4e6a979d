"""``(checkpoint name, tensor)`` pairs in memory copied into a model's parameters in place: new weights from a
trainer (RL), through the checkpoint loader's own name mapping and ``weight_loader``s (``models.loader._Loading``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from atom_core.models.loader import LoadReport, _Loading, process_weights_after_loading

__all__ = ["check_updatable", "load_named_tensors", "named_tensor_pair"]

_KV_SCALE_SKIPPED = "KV-cache scale: read when a model is loaded from its checkpoint, not updated"


def load_named_tensors(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       strict: bool = False, load_extra_layers: bool = False,
                       check_finite: bool = True) -> LoadReport:
    """Copy ``(checkpoint name, tensor)`` pairs into ``model``'s parameters, in place: new weights from a
    trainer (``hf_model.state_dict().items()``, or any iterable or generator of such pairs, e.g. one layer
    at a time), as vLLM's ``model.load_weights(weights)`` takes them in RL loops.

    Each tensor goes exactly where the same tensor read from a checkpoint file goes (``load_weights``'
    name mapping, packed q/k/v and gate/up shards, expert mappings, each parameter's ``weight_loader``
    with its tensor-parallel cut and, for an online-quantized model, its quantization), and is copied
    into the existing parameter: no ``Parameter`` is replaced and no buffer that
    ``process_weights_after_loading`` derives moves (CUDA graphs captured over the model keep reading
    the same addresses). Tensors may be on any device and of any floating dtype (cast as they are
    copied). The pairs are read one at a time (a generator's tensors are not all held at once).

    A partial update is allowed: parameters no tensor filled keep their values (``report.missing``
    lists them). ``strict``: a name that maps to no parameter raises ValueError naming it (otherwise it
    is listed in ``report.unused``); when not one name maps to a parameter, ValueError all the same (the
    update would silently be no update: a training wrapper's prefix, say, which the message names). A shape mismatch, a dtype that cannot be cast, or (``check_finite``)
    a NaN/Inf raises ValueError naming the tensor and the parameter. An error stops the load at that
    tensor: the ones before it are loaded (load the full set again). Names the model skips (rotary
    caches, a tied ``lm_head.weight``, extra layers) and KV-cache scales are listed in
    ``report.skipped``. ``process_weights_after_loading`` runs afterwards, as after ``load_weights``.

    Unquantized and online-quantized models (``quantization="fp8"`` / ``"fp8_block"``) only: a model
    built from a quantized checkpoint raises NotImplementedError (its parameters hold the stored format
    and some are converted once at load: MLA's ``kv_b_proj``).
    """
    check_updatable(model)
    loading = _Loading(model, load_extra_layers)
    params_before = {name: id(param) for name, param in loading.params.items()}
    routed = 0
    with torch.no_grad():
        for item in named_tensors:
            name, tensor = named_tensor_pair(item, "load_named_tensors")
            route = loading.route(name)
            if isinstance(route, tuple):
                loading.report.skipped[name] = _KV_SCALE_SKIPPED
                continue
            if route is None:
                if strict and name not in loading.report.skipped:  # (unused: it maps to no parameter)
                    raise ValueError(f"load_named_tensors(strict=True): tensor {name!r} matches no parameter of "
                                     f"{type(model).__name__} (after its name mapping){_prefix_hint(loading, name)}")
                continue
            tensor = tensor.detach()
            loading.check_dtype(name, route, tensor.dtype, None)
            loading.load(name, tensor, route, None, check_finite)
            routed += 1
        if not routed and loading.report.unused:  # every name unknown: a wrapper's prefix, most likely
            unused = loading.report.unused
            raise ValueError(f"load_named_tensors: none of the tensors matches a parameter of {type(model).__name__} "
                             f"({len(unused)} unused, the first {unused[0]!r}); nothing was loaded. Names are "
                             f"Hugging Face checkpoint names (model.layers.0.self_attn.q_proj.weight)"
                             f"{_prefix_hint(loading, unused[0])}")
        loading.account()
        _process_in_place(model)
    moved = [name for name, param in model.named_parameters() if params_before.get(name) != id(param)]
    if moved:  # (a module's process_weights_after_loading replaced it: not one this function supports)
        raise RuntimeError(f"load_named_tensors: parameters were replaced while loading: {moved[:5]}")
    return loading.report


_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "base_model.model.", "model.")


def _prefix_hint(loading: _Loading, name: str) -> str:
    """", without its 'P' prefix (...)" where dropping a leading prefix that training wrappers add (DDP's
    ``module.``, torch.compile's ``_orig_mod.``, FSDP's, PEFT's ``base_model.model.``) makes ``name`` one the
    model loads; else ""."""
    rest, dropped = name, ""
    for _ in range(4):
        prefix = next((p for p in _WRAPPER_PREFIXES if rest.startswith(p)), None)
        if prefix is None:
            return ""
        rest, dropped = rest[len(prefix):], dropped + prefix
        targets = loading.mapper.map(rest)
        if isinstance(targets, list) and all(t.param_name in loading.params for t in targets):
            return (f"; without its {dropped!r} prefix it is {rest!r}, which the model loads: strip the prefix "
                    "the training wrapper adds (DDP's module., torch.compile's _orig_mod., PEFT's "
                    "base_model.model.) before passing the names")
    return ""


def check_updatable(model: nn.Module) -> None:
    """Raise NotImplementedError when ``load_named_tensors`` cannot update ``model``: one built from a quantized
    checkpoint (a caller that must refuse before receiving any tensor asks first)."""
    quant_config = getattr(model, "quant_config", None)
    if quant_config is not None and not quant_config.online:
        raise NotImplementedError(
            f"load_named_tensors: {type(model).__name__} was built from a quantized checkpoint "
            f"({quant_config.quant_method}); updating it from tensors is not supported (its parameters hold "
            "the stored format and scales). Build the model unquantized, or with online quantization "
            "(quantization='fp8'), whose weights take unquantized tensors")


def named_tensor_pair(item: object, caller: str) -> tuple[str, torch.Tensor]:
    """``item`` as a ``(name, tensor)`` pair; TypeError naming ``caller`` and what ``item`` is otherwise."""
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) \
            and isinstance(item[1], torch.Tensor):
        return item[0], item[1]
    what = (f"a {type(item).__name__} of {len(item)}: ({', '.join(type(x).__name__ for x in item)})"
            if isinstance(item, (tuple, list)) else type(item).__name__)
    raise TypeError(f"{caller} takes (name, tensor) pairs, got {what}")


def _process_in_place(model: nn.Module) -> None:
    """``process_weights_after_loading``, keeping every buffer it had before at its address: a buffer that
    a hook derives anew (a fused layer's per-channel scale, say) is copied into the old tensor."""
    before = [(module, name, buffer) for module in model.modules()
              for name, buffer in module.named_buffers(recurse=False)]
    process_weights_after_loading(model)
    for module, name, old in before:
        new = getattr(module, name, None)
        if new is old or new is None or (new.data_ptr() == old.data_ptr() and new.shape == old.shape):
            continue
        if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
            raise RuntimeError(f"load_named_tensors: buffer {name!r} of {type(module).__name__} changed from "
                               f"{tuple(old.shape)} {old.dtype} to {tuple(new.shape)} {new.dtype} after the update")
        old.copy_(new)
        setattr(module, name, old)
