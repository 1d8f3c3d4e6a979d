"""Load ``*.safetensors`` checkpoints into a model through its parameters' ``weight_loader``s.

``load_weights(model, folder)`` reads each shard memory-mapped (``safetensors.safe_open``),
maps every checkpoint tensor name to the parameter(s) it fills and hands the full tensor to
``param.weight_loader(param, tensor[, shard_id])``, which cuts out the tensor-parallel shard.
``models.named_tensors.load_named_tensors(model, pairs)`` does the same for ``(checkpoint name, tensor)`` pairs
in memory (a trainer's ``state_dict().items()``: RL weight updates) with this module's ``_Loading``, copying into
the existing parameters in place.

Name mapping, in order:

1. ``model.checkpoint_renames(name)`` if the model defines it (returning None skips the tensor).
2. Skipped: rotary caches of old checkpoints (``*.rotary_emb.inv_freq`` and the like), and
   ``*.layers.{i}.*`` with ``i >= config.num_hidden_layers`` (extra layers such as MTP heads)
   unless ``load_extra_layers=True`` (``models.mtp.load_mtp_module`` loads DeepSeek's MTP layers that
   way, into a draft module whose ``checkpoint_renames`` keeps only them).
3. ``*.weight_scale_inv`` -> ``*.weight_scale`` (block-FP8 checkpoints store inverse-named scales).
4. ``lm_head.weight`` with ``config.tie_word_embeddings`` and no separate ``lm_head.weight``
   parameter is skipped (the head shares the embedding).
5. ``model.expert_params_mapping`` (MoE models), then ``model.stacked_expert_params_mapping`` (more
   triples the quantization rules do not read: transformers 5's in-memory expert stacks), lists of
   ``(checkpoint suffix, parameter suffix, shard_id)`` matched on whole dotted components at the end of the name:
   ``("experts.3.gate_proj.weight", "experts.w13_weight", (3, "w1"))`` loads
   ``...mlp.experts.3.gate_proj.weight`` into ``...mlp.experts.w13_weight`` with that shard id
   (see ``layers.moe``). A parameter counts as loaded once every non-None shard id the mapping
   lists for its suffix has arrived (or one tensor loaded it whole with ``shard_id=None``).
6. ``model.packed_modules_mapping``, matched on whole dotted name components:

   - ``{"q_proj": ("qkv_proj", "q")}``: the checkpoint's separate ``...q_proj.weight`` goes into
     the fused parameter ``...qkv_proj.weight`` with ``shard_id="q"``. A fused parameter counts
     as loaded once every shard id the mapping lists for it has arrived (or one tensor loaded
     it whole with ``shard_id=None``).
   - ``{"qkv": [("q_proj", 2048), ("k_proj", 512), ("v_proj", 512)]}`` (a list): the checkpoint
     holds one fused tensor that the model keeps as several parameters; it is cut along dim 0
     into consecutive blocks of those (full, unsharded) row counts and block i is loaded,
     whole, into ``...<target_i>.<suffix>``. Sizes depend on the config, so a model using this
     sets ``packed_modules_mapping`` per instance.

Checkpoint FP8 KV-cache scales go to the attention layers, not to parameters: ``...self_attn.k_scale``
/ ``v_scale`` (compressed-tensors) and ``...self_attn.k_proj.output_scale`` / ``v_proj.output_scale``
(AMD Quark) set ``checkpoint_k_scale`` / ``checkpoint_v_scale`` (fp32 [1]) of the ``PagedAttention``
(or MLA's ``MLAPagedAttention``, whose latent cache takes the k one) at ``...self_attn.attn``; the older
single ``...self_attn.kv_scale`` sets both (vLLM's reading of it). The runner binds them with an FP8 pool.
Names with no such attention layer are left unused; each scale must be one finite value > 0.

Quantized layers (``models.quantization.linear_methods``) own their scale parameters
(``weight_scale``, ``input_scale``) and load them through the same ``weight_loader``s; a scale a
weight's loader fills itself (online quantization: ``param.loaded_with = "weight"``) counts as
loaded with that weight.

MXFP4 tensors (``NAME_blocks`` uint8 codes with ``NAME_scales`` uint8 e8m0 scales beside it, gpt-oss's
released expert weights) are loaded as stored, each through the model's expert mapping into the packed
parameters of its MXFP4 experts (``layers.moe``); nothing is decoded (``models.mxfp4.dequantize_mxfp4``
is the reference decoder).

Parameters that no checkpoint tensor filled raise ValueError (``strict``) unless they match
one of ``model.expected_missing`` (``fnmatch`` patterns on the parameter name); checkpoint
tensors that fill nothing are logged and listed in the returned ``LoadReport``. Afterwards
``process_weights_after_loading()`` runs on every module that defines it.

What is refused, each error naming the file (and the tensor where there is one; the shard files, their
headers and their reads are ``models.checkpoint_files``):

- a shard whose header is corrupt or whose data is truncated: every shard's header is checked
  against its file size (dtype, shape, contiguous ``data_offsets`` covering the data exactly)
  before any tensor is read, and errors of the safetensors library are re-raised with the file;
- an index entry that names a missing shard, or leaves the folder: absolute, ``..``, or a link
  whose target lies outside the folder. In a Hugging Face cache snapshot
  (``.../models--org--name/snapshots/<rev>/``, shards linked to ``../../blobs/<hash>``) links may
  point anywhere inside that cache repository (``models--org--name``), not out of it;
- before any tensor is read (from the shard headers), a stored dtype that differs from its parameter's,
  unless both are floating point (a cast) and neither is FP8: FP8 values mean nothing without their
  scales, so they load only into an FP8 parameter of a quantized layer (a config that quantizes a layer
  the model keeps unquantized, an LM head or a router, is named as such), and an FP8 parameter takes
  only FP8 values, or, created with ``quantize_on_load`` (online quantization), floating-point values
  it quantizes itself; INT8 only into INT8; integer data (MXFP4 ``uint8`` codes and scales) only into a
  parameter of its dtype;
- with ``check_finite`` (the default), a tensor holding NaN or Inf;
- before any tensor is read, a ``quantization_config`` in the model's config that
  ``models.quantization.parse_quant_config`` refuses (named), or whose format the model's class
  does not list in ``supported_quantization`` (``check_quantization_supported``).

A stored ``lm_head.weight`` that a tied head skips is compared with the embedding it is tied to:
when they differ, a warning names it and the largest difference.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atom_core.models.checkpoint_files import (INDEX_FILE, TORCH_DTYPES, checkpoint_files, get_tensor, open_shard,
                                               read_safetensors_header, read_tensor, tensor_source)
from atom_core.models.checkpoint_scales import (check_quant_scales, kv_scale_target, set_kv_scale,
                                                warn_missing_kv_scales)
from atom_core.models.config import ModelConfig
from atom_core.models.layers.linear import default_weight_loader
from atom_core.models.quantization import check_quantization_supported, parse_quant_config

logger = logging.getLogger(__name__)

_FINITE_CHUNK = 1 << 22  # elements summed at a time by the NaN/Inf check (bounds its temporaries)
_ROTARY_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_TIED_REASON = "tied to the input embedding"


@dataclass
class LoadReport:
    """What ``load_weights`` (or ``load_named_tensors``) did; names are parameter names
    (``model.named_parameters``) or checkpoint names."""

    loaded: list[str] = field(default_factory=list)            # parameters fully loaded
    missing: list[str] = field(default_factory=list)           # parameters not (fully) loaded, not expected
    expected_missing: list[str] = field(default_factory=list)  # not loaded, matched by model.expected_missing
    unused: list[str] = field(default_factory=list)            # checkpoint tensors that matched no parameter
    skipped: dict[str, str] = field(default_factory=dict)      # checkpoint tensor -> why it was not loaded
    files_read: list[str] = field(default_factory=list)        # shard files whose tensor data was read
    kv_scales: list[str] = field(default_factory=list)         # checkpoint KV-scale tensors set on attention layers


@dataclass(frozen=True)
class _Target:
    param_name: str
    shard_id: Any = None
    rows: tuple[int, int] | None = None  # (start, size) along dim 0 of the checkpoint tensor


class _NameMapper:
    """Checkpoint tensor name -> the parameter targets it fills, or a reason to skip it."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], load_extra_layers: bool) -> None:
        self.params = params
        self.renames = getattr(model, "checkpoint_renames", None)
        config = getattr(model, "config", None)
        self.num_layers = None if load_extra_layers else getattr(config, "num_hidden_layers", None)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        self.patterns = {key: re.compile(rf"(?:^|\.)({re.escape(key)})(?:\.|$)") for key in self.packed}
        # Checkpoint name suffix -> (parameter suffix, shard id); parameter suffix -> shard ids it needs.
        self.experts: dict[str, tuple[str, Any]] = {}
        self.expert_required: dict[str, set] = {}
        self.expert_sources: dict[tuple[str, Any], str] = {}  # (parameter suffix, shard id) -> checkpoint suffix
        # (stacked_expert_params_mapping: more triples for the loader only, not for the quantization rules)
        for entry in [*(getattr(model, "expert_params_mapping", None) or []),
                      *(getattr(model, "stacked_expert_params_mapping", None) or [])]:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 3
                    and isinstance(entry[0], str) and isinstance(entry[1], str)):
                raise ValueError(f"expert_params_mapping entries must be (checkpoint suffix, parameter suffix, "
                                 f"shard_id), got {entry!r}")
            ckpt_suffix, param_suffix, shard_id = entry
            self.experts[ckpt_suffix] = (param_suffix, shard_id)
            needed = self.expert_required.setdefault(param_suffix, set())
            if shard_id is not None:
                needed.add(shard_id)
                self.expert_sources.setdefault((param_suffix, shard_id), ckpt_suffix)
        # Fused module name -> shard ids its parameters need before they count as loaded.
        self.required_shards: dict[str, set] = {}
        for key, value in self.packed.items():
            if isinstance(value, tuple):
                if len(value) != 2:
                    raise ValueError(f"packed_modules_mapping[{key!r}] must be (target, shard_id), got {value!r}")
                self.required_shards.setdefault(value[0], set()).add(value[1])
            elif not isinstance(value, list):
                raise ValueError(
                    f"packed_modules_mapping[{key!r}] must be a (target, shard_id) tuple or a list of "
                    f"(target, rows) pairs, got {value!r}"
                )

    def renamed(self, name: str) -> str:
        """``name`` after ``checkpoint_renames`` (only: no other step of ``map``)."""
        return name if self.renames is None else (self.renames(name) or name)

    def map(self, name: str) -> list[_Target] | str:
        if self.renames is not None:
            renamed = self.renames(name)
            if renamed is None:
                return "dropped by checkpoint_renames"
            name = renamed
        if name.endswith(_ROTARY_SUFFIXES):
            return "rotary cache (recomputed by the model)"
        m = _LAYER_INDEX.search(name)
        if m is not None and self.num_layers is not None and int(m.group(1)) >= self.num_layers:
            return f"layer {m.group(1)} >= num_hidden_layers={self.num_layers}"
        if name.endswith(".weight_scale_inv"):
            name = name[: -len("_inv")]
        if self.tied and name == "lm_head.weight" and name not in self.params:
            return _TIED_REASON
        if self.experts:
            parts = name.split(".")
            for i in range(len(parts)):
                hit = self.experts.get(".".join(parts[i:]))
                if hit is not None:
                    return [_Target(".".join(parts[:i] + [hit[0]]), hit[1])]
        for key, value in self.packed.items():
            m = self.patterns[key].search(name)
            if m is None:
                continue
            if isinstance(value, tuple):
                target = name[: m.start(1)] + value[0] + name[m.end(1):]
                if target not in self.params and name in self.params:
                    break  # this module is not fused in the model: load by its own name
                return [_Target(target, value[1])]
            targets, start = [], 0
            for sub_name, rows in value:
                targets.append(_Target(name[: m.start(1)] + sub_name + name[m.end(1):], None, (start, rows)))
                start += rows
            return targets
        return [_Target(name)]

    def checkpoint_names(self, param_name: str, shard_ids: set) -> list[str] | None:
        """The checkpoint names (after ``checkpoint_renames``) of the tensors that fill ``shard_ids`` of stacked
        expert parameter ``param_name``, in expert order; None for another parameter."""
        for param_suffix in self.expert_required:
            if param_name == param_suffix or param_name.endswith("." + param_suffix):
                prefix = param_name[: len(param_name) - len(param_suffix)]
                try:
                    ordered = sorted(shard_ids)  # (expert, projection)
                except TypeError:
                    ordered = sorted(shard_ids, key=str)
                sources = [self.expert_sources.get((param_suffix, shard)) for shard in ordered]
                return None if None in sources else [prefix + source for source in sources]
        return None

    def required(self, param_name: str) -> set:
        """Shard ids a fused parameter needs (empty for a plain parameter)."""
        for param_suffix, shard_ids in self.expert_required.items():
            if param_name == param_suffix or param_name.endswith("." + param_suffix):
                return shard_ids
        for module_name, shard_ids in self.required_shards.items():
            if re.search(rf"(?:^|\.){re.escape(module_name)}\.", param_name):
                return shard_ids
        return set()


_WHOLE = object()  # marker: a parameter loaded in one piece (shard_id None)


def _tied_parameter(model: nn.Module, params: dict[str, nn.Parameter]) -> str | None:
    """The name under which ``model.named_parameters()`` lists the tensor ``lm_head.weight`` shares
    (the input embedding when the head is tied), or None when there is no tied ``lm_head.weight``."""
    head = dict(model.named_parameters(remove_duplicate=False)).get("lm_head.weight")
    return next((name for name, param in params.items() if param is head and name != "lm_head.weight"), None)


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _check_dtype(param: nn.Parameter, dtype: torch.dtype, target: _Target, ckpt_name: str, file: Path | None,
                 model: nn.Module) -> None:
    """A stored dtype (the shard header's) other than the parameter's is cast only from float to float:
    integer or bool data in a float parameter (or the reverse) is a different quantity, not a precision
    change; so is FP8 data (it needs its scales) anywhere but an FP8 parameter, and anything but FP8 in an
    FP8 parameter, except one that quantizes on load (online quantization) from a float tensor."""
    if dtype == param.dtype:
        return
    fp8_tensor, fp8_param = dtype in _FP8_DTYPES, param.dtype in _FP8_DTYPES
    if fp8_param and getattr(param, "quantize_on_load", None) is not None:
        if dtype.is_floating_point and not fp8_tensor:
            return
        raise ValueError(f"checkpoint tensor {ckpt_name!r} {tensor_source(file)}: stored as {dtype}; online quantization "
                         f"of {target.param_name!r} reads an unquantized floating-point tensor")
    if fp8_tensor and not fp8_param:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} {tensor_source(file)}: stored as {dtype}, but parameter "
                         f"{target.param_name!r} is {param.dtype}: FP8 values load only into a quantized layer "
                         f"({_why_unquantized(model, ckpt_name)})")
    if dtype.is_floating_point and param.dtype.is_floating_point and not fp8_param:
        return
    raise ValueError(
        f"checkpoint tensor {ckpt_name!r} {tensor_source(file)}: stored as {dtype}, but parameter "
        f"{target.param_name!r} is {param.dtype}; "
        + ("an FP8 parameter takes FP8 values only: the checkpoint does not quantize this layer as the model does"
           if fp8_param else "only casts between non-FP8 floating-point dtypes are made")
    )


def _why_unquantized(model: nn.Module, ckpt_name: str) -> str:
    """Why the layer of checkpoint tensor ``ckpt_name`` is unquantized in ``model``, for the FP8 dtype error."""
    quant_config = getattr(model, "quant_config", None)
    if quant_config is None:
        return "the model was built without a quantization_config: load_model builds it from the checkpoint's"
    scheme, origin = quant_config.checkpoint_scheme(ckpt_name.rpartition(".")[0])
    if not scheme.is_quantized:
        return f"the checkpoint's quantization_config does not quantize this layer ({origin})"
    return (f"the checkpoint's quantization_config quantizes this layer ({origin}: {scheme.describe()}), but "
            f"{type(model).__name__} keeps it unquantized, as it does every embedding, LM head and MoE router; "
            "use a checkpoint whose config leaves this layer out (compressed-tensors' ignore, quark's exclude)")


def _load_one(param: nn.Parameter, tensor: torch.Tensor, target: _Target, ckpt_name: str,
              file: Path | None) -> None:
    if target.rows is not None:
        start, size = target.rows
        if tensor.shape[0] < start + size:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} {tensor_source(file, short=True)}: shape {tuple(tensor.shape)} has "
                f"fewer than {start + size} rows to split into {target.param_name!r}"
            )
        tensor = tensor.narrow(0, start, size)
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        if target.shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, target.shard_id)
    except ValueError as e:
        raise ValueError(
            f"checkpoint tensor {ckpt_name!r} {tensor_source(file, short=True)} -> parameter {target.param_name!r} "
            f"(shape {tuple(param.shape)}): {e}"
        ) from e


def count_non_finite(tensor: torch.Tensor) -> int:
    """NaN and Inf elements of ``tensor`` (0 for non-float dtypes), read in chunks of ``_FINITE_CHUNK``.

    A chunk whose fp32 (fp64 for fp64 data) sum is finite holds no NaN/Inf; only a chunk whose sum
    is not (a NaN/Inf, or finite values that overflow the sum) is counted element by element.
    The sum reads the data once without a bool temporary, several times faster than ``isfinite``.
    """
    if not tensor.is_floating_point():
        return 0
    accumulate = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    bad = 0
    for chunk in tensor.reshape(-1).split(_FINITE_CHUNK):
        if chunk.element_size() == 1:  # float8: no CPU sum kernel
            chunk = chunk.float()
        if not math.isfinite(chunk.sum(dtype=accumulate).item()):
            bad += int(chunk.numel() - torch.isfinite(chunk).sum().item())
    return bad


def _check_finite(tensor: torch.Tensor, ckpt_name: str, file: Path | None) -> None:
    bad = count_non_finite(tensor)
    if bad:
        raise ValueError(
            f"checkpoint tensor {ckpt_name!r} {tensor_source(file)}: {bad} of {tensor.numel()} values are NaN or Inf "
            "(a corrupt or diverged checkpoint); check_finite=False loads it anyway"
        )


def max_abs_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` over two tensors of one shape, in fp32, a chunk of ``_FINITE_CHUNK`` elements at a time
    (NaN when either holds one)."""
    worst = torch.zeros((), dtype=torch.float32)
    for x, y in zip(a.reshape(-1).split(_FINITE_CHUNK), b.reshape(-1).split(_FINITE_CHUNK)):
        if x.numel():
            worst = torch.maximum(worst, (x.float() - y.float()).abs().max())  # maximum keeps a NaN
    return worst.item()


def process_weights_after_loading(model: nn.Module) -> None:
    """Call ``process_weights_after_loading()`` on every module of ``model`` that defines it."""
    for module in model.modules():
        fn = getattr(module, "process_weights_after_loading", None)
        if callable(fn):
            fn()


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _warn_if_tied_head_differs(head_name: str, embedding_name: str, file_of: dict[str, Path]) -> str | None:
    """Compare a stored ``lm_head.weight`` that tying skips with the embedding the model uses in its
    place; log a warning and return what differs, or None when they are identical."""
    head = read_tensor(None, None, head_name, file_of[head_name])
    embedding = read_tensor(None, None, embedding_name, file_of[embedding_name])
    if head.shape != embedding.shape:
        difference = f"shape {tuple(head.shape)} vs {tuple(embedding.shape)}"
    elif torch.equal(head, embedding):
        return None
    else:
        difference = f"max |difference| {max_abs_difference(head, embedding):.6g}"
    logger.warning("tie_word_embeddings is true, but checkpoint tensor %r in %s differs from the input embedding "
                   "%r (%s); it is ignored and the embedding is used as the LM head", head_name,
                   file_of[head_name].name, embedding_name, difference)
    return difference


def _check_quantization(model: nn.Module, folder: Path) -> None:
    """Parse the model config's ``quantization_config`` (refusing unsupported combinations by name) and
    refuse a format the model's class does not load, before any tensor is read: an FP8 checkpoint
    cast into float parameters would load without its scales."""
    config = getattr(model, "config", None)
    raw = config.get("quantization_config") if isinstance(config, ModelConfig) else \
        getattr(config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict) and callable(getattr(raw, "to_dict", None)):
        raw = raw.to_dict()  # a transformers config object
    source = folder / "config.json"
    quant_config = parse_quant_config(raw, source_file=source if source.is_file() else None)
    check_quantization_supported(quant_config, type(model), source=folder)


class _Loading:
    """One load into ``model``, shared by ``load_weights`` (a folder) and ``load_named_tensors``: where each
    checkpoint name goes, the tensors loaded into their parameters, and the report."""

    def __init__(self, model: nn.Module, load_extra_layers: bool) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.mapper = _NameMapper(model, self.params, load_extra_layers)
        self.modules = dict(model.named_modules())
        self.report = LoadReport()
        self.loaded: dict[str, set] = {}        # parameter -> shard ids loaded (_WHOLE: in one piece)
        self.whole_source: dict[str, str] = {}  # parameter -> the checkpoint tensor loaded into it whole

    def route(self, name: str) -> list[_Target] | tuple[nn.Module, str] | None:
        """Where checkpoint tensor ``name`` goes: its parameter targets, or ``(attention layer, "k" | "v" |
        "kv")`` for a KV-cache scale; None when nowhere (recorded: ``report.skipped`` with why, or ``unused``)."""
        mapped = self.mapper.map(name)
        kv_scale = None if isinstance(mapped, str) else kv_scale_target(self.mapper.renamed(name), self.modules)
        if kv_scale is not None:
            return kv_scale
        if isinstance(mapped, str):
            self.report.skipped[name] = mapped
            return None
        if not all(t.param_name in self.params for t in mapped):
            self.report.unused.append(name)
            return None
        return mapped

    def check_dtype(self, name: str, targets: list[_Target], dtype: torch.dtype, file: Path | None) -> None:
        for t in targets:
            _check_dtype(self.params[t.param_name], dtype, t, name, file, self.model)

    def load(self, name: str, tensor: torch.Tensor, targets: list[_Target], file: Path | None,
             check_finite: bool) -> None:
        """``tensor`` into its targets (each parameter's ``weight_loader`` copies it in place)."""
        if check_finite:
            _check_finite(tensor, name, file)
        for target in targets:
            check_quant_scales(target.param_name, tensor, name, file)
            _load_one(self.params[target.param_name], tensor, target, name, file)
            self.loaded.setdefault(target.param_name, set()).add(_WHOLE if target.shard_id is None else target.shard_id)
            if target.shard_id is None and target.rows is None:
                self.whole_source.setdefault(target.param_name, name)

    def account(self) -> None:
        """Sort every parameter into ``report.loaded``, ``expected_missing`` or ``missing``."""
        report, mapper, loaded = self.report, self.mapper, self.loaded
        expected = getattr(self.model, "expected_missing", None) or set()
        for pname, param in self.params.items():
            got = loaded.get(pname, set())
            needed = mapper.required(pname)
            sibling = getattr(param, "loaded_with", None)  # filled by a sibling's loader (online quantization)
            if sibling is not None:
                got = loaded.get(f"{pname.rpartition('.')[0]}.{sibling}", set())
            if _WHOLE in got or (got and needed and needed <= got):
                report.loaded.append(pname)
            elif _matches(pname, expected):
                report.expected_missing.append(pname)
            elif got:
                names = mapper.checkpoint_names(pname, needed - got)
                report.missing.append(f"{pname} (shards {sorted(map(str, needed - got))} missing)" if names is None
                                      else f"{pname} (checkpoint tensors {', '.join(names)} missing)")
            else:
                report.missing.append(pname)
        if report.unused:
            logger.warning("%d checkpoint tensors matched no parameter and were not loaded: %s%s",
                           len(report.unused), ", ".join(report.unused[:10]),
                           " ..." if len(report.unused) > 10 else "")


def load_weights(model: nn.Module, path: str | Path, *, strict: bool = True,
                 load_extra_layers: bool = False, check_finite: bool = True) -> LoadReport:
    """Fill ``model``'s parameters from the ``*.safetensors`` files in folder ``path``.

    Only shards that hold at least one wanted tensor are opened for data (the others' headers
    are read and checked, nothing more). Each tensor is cast to its parameter's dtype and device
    by the parameter's ``weight_loader`` (float to float only). ``check_finite``: every floating
    tensor is checked for NaN/Inf as it is read (one more pass over memory-mapped data);
    ``check_finite=False`` skips that pass. Raises ValueError on a corrupt or truncated shard, a
    shape or dtype mismatch, a NaN/Inf (each naming the file and the checkpoint tensor), on an
    index entry outside the folder, and, when ``strict``, on parameters left unloaded.
    Returns a ``LoadReport``. (Tensors in memory, a trainer's: ``load_named_tensors``.)
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    _check_quantization(model, folder)
    loading = _Loading(model, load_extra_layers)
    report, params = loading.report, loading.params

    # Which file holds each tensor (the first shard that lists it). Every header is checked here,
    # so a corrupt or truncated shard is named before any tensor is loaded.
    file_of: dict[str, Path] = {}
    dtype_of: dict[str, str] = {}  # each tensor's stored dtype, from its shard's header
    for file, index_names in checkpoint_files(folder).items():
        header = read_safetensors_header(file)
        header_names = list(header)
        names = header_names if index_names is None else index_names
        if index_names is not None:
            absent = sorted(set(index_names) - set(header_names))
            if absent:
                raise ValueError(f"{INDEX_FILE} lists tensors that {file.name} does not hold: {absent[:5]}")
        for name in names:
            if name in file_of:
                logger.warning("tensor %r appears in more than one shard; keeping the first (%s skipped)",
                               name, file.name)
                continue
            file_of[name] = file
            dtype_of[name] = header[name]["dtype"]

    # Plan: into which parameters each tensor goes, grouped by file; every dtype checked before any tensor is read.
    plan: dict[Path, list[tuple[str, list[_Target]]]] = {}
    kv_scales: list[tuple[str, Path, nn.Module, str]] = []
    for name, file in file_of.items():
        route = loading.route(name)
        if isinstance(route, tuple):
            kv_scales.append((name, file, *route))
        elif route is not None:
            stored = TORCH_DTYPES.get(dtype_of[name])
            if stored is not None:
                loading.check_dtype(name, route, stored, file)
            plan.setdefault(file, []).append((name, route))
    tied_head = next((name for name, why in report.skipped.items() if why == _TIED_REASON), None)

    for file, entries in plan.items():
        report.files_read.append(str(file))
        with open_shard(file) as f:
            for name, targets in entries:
                loading.load(name, get_tensor(f, name, file), targets, file, check_finite)

    device = next((p.device for p in params.values()), torch.device("cpu"))
    for name, file, attn, which in kv_scales:
        set_kv_scale(attn, which, read_tensor(None, None, name, file), name, file, device)
        report.kv_scales.append(name)
    warn_missing_kv_scales(model)

    embedding = loading.whole_source.get(_tied_parameter(model, params) or "")
    if tied_head is not None and embedding is not None:
        difference = _warn_if_tied_head_differs(tied_head, embedding, file_of)
        if difference is not None:
            report.skipped[tied_head] += f" (and differs from it: {difference})"

    loading.account()
    if report.missing and strict:
        shown = ", ".join(report.missing[:20])
        more = f" (and {len(report.missing) - 20} more)" if len(report.missing) > 20 else ""
        raise ValueError(f"{len(report.missing)} parameters not found in checkpoint {folder}: {shown}{more}")
    process_weights_after_loading(model)
    return report
