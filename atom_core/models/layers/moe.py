"""Mixture-of-experts as a module: stacked expert weights, their sharding, their checkpoint mapping.

``FusedMoE`` holds every expert of one layer as two stacked tensors, as ``ops.fused_experts`` /
``ops.fused_experts_quant`` want them (the rows ``nn.Linear`` would store, one block per expert):

    w13_weight [E_r, 2 I_r, H]    gate and up projections
    w2_weight  [E_r, H, I_r]      down projection
    w13_bias   [E_r, 2 I_r]       optional (GPT-OSS)
    w2_bias    [E_r, H]           optional (GPT-OSS)

and, for quantized experts (``quant_config`` / ``prefix``: the expert method of the layer's scheme,
``models.quantization.expert_methods``), the weights in FP8 or packed MXFP4 with their scales
``w13_weight_scale`` / ``w2_weight_scale`` (shapes in that module's table).

The gate/up rows come in one of two layouts, fixed by the activation:
``"silu"`` keeps halves (rows ``[0, I)`` gate, ``[I, 2I)`` up, like ``silu_and_mul``);
``"swiglu_clamped"`` interleaves them (row ``2j`` gate j, row ``2j + 1`` up j, GPT-OSS's layout).
Scales follow their rows (an FP8 block-scale row covers 128 stacked rows).

Routing is not part of the module: the architecture's MoE block computes
``(topk_weights [T, K], topk_ids [T, K])`` with an ``ops`` routing function and calls
``experts(hidden, topk_weights, topk_ids)``.

**Sharding** (``moe_shard``). ``tp_size`` ranks split every expert's intermediate dim I (rank t
holds ``I_r = I / tp_size`` consecutive units, like the column/row-parallel MLP), and
``ep_size`` ranks split the experts (rank p holds ``E_r = E / ep_size`` consecutive experts).
Both may be > 1; every rank then returns a partial sum over its experts and its I-slice, and the
sum over all ``tp_size * ep_size`` ranks is the layer's output (``ops.all_reduce`` over ``group``, the
process group of those ranks, when ``reduce_results``; never the default group, ``models.parallel``). A token's choice of an expert held elsewhere
becomes id -1 locally (``fused_experts`` skips it). That is ``ep_comm="all_reduce"``; with
``ep_comm="all_to_all"`` (whole experts only: ``tp_size`` 1) each rank instead sends a slice of the tokens
to the ranks holding their experts and takes the outputs back (``layers.expert_exchange``). ``w2_bias`` is added by TP rank 0 only, so it
appears once per expert in the sum. Quantized experts: FP8 block scales are cut with their
128-blocks (a split whose I_r is not whole blocks is refused when the layer is built, naming it);
per-channel scales with their rows (down's whole on every rank); MXFP4 codes and e8m0 scales by
32-groups (I_r a multiple of 32); expert parallelism moves whole experts with their scales.

**Checkpoint mapping** (``expert_params_mapping``, ``fused_expert_params_mapping``). The loader
maps checkpoint tensors onto these parameters with triples ``(checkpoint suffix, parameter
suffix, shard_id)``; the parameter's ``weight_loader(param, tensor, shard_id)`` takes the FULL
tensor and cuts this rank's piece. Shard ids:

- ``(e, "w1")`` / ``(e, "w3")`` / ``(e, "w2")``: expert e's gate ``[I, H]`` / up ``[I, H]`` /
  down ``[H, I]`` as ``nn.Linear`` stores them (biases: ``[I]``, ``[I]``, ``[H]``; FP8 scales:
  ``[ceil(I/128), ceil(H/128)]`` blocks, ``[I, 1]`` or ``[I]`` per channel, one value per tensor);
  experts another EP rank holds are ignored;
- ``None``: the whole stack in this module's own layout (``[E, 2I, H]``, ``[E, H, I]``,
  ``[E, 2I]``, ``[E, H]``; MXFP4 codes ``[E, N, K/2]`` or as gpt-oss stores them ``[E, N, K/32, 16]``,
  scales ``[E, N, K/32]``);
- ``"transposed"``: the whole weight stack with its last two dims swapped (``[E, H, 2I]``,
  ``[E, I, H]``: GPT-OSS's ``x @ W`` layout).

Online quantization (``quantize_on_load`` on the weights): per-expert and stacked unquantized tensors
are quantized as they are read, this rank's piece at a time (per-channel scales of the down projection
over the full row, as offline quantization makes them).
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from atom_core.models.layers.expert_exchange import EXCHANGES, all_to_all_experts
from atom_core.models.layers.linear import check_shape, copy_into
from atom_core.models.layers.sharding import check_tp
from atom_core.models.parallel import (
    ParallelContext,
    check_group,
    ep_comm_of,
    reduce_over,
    require_group,
)
from atom_core.models.quantization.activation import QuantizedActivation
from atom_core.models.quantization.config import QuantConfig
from atom_core.models.quantization.expert_methods import ExpertMethod, expert_method_for
from atom_core.models.quantization.linear_methods import quantize_weight
from atom_core.models.quantization.schemes import (
    UNQUANTIZED,
    UnsupportedQuantizationError,
)

ACTIVATION_LAYOUTS = {"silu": "halves", "swiglu_clamped": "interleaved"}
EXPERT_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down (Mixtral's names, used as shard ids everywhere)


@dataclass(frozen=True)
class MoEShard:
    """One rank's part of a MoE layer: which experts, which slice of each expert's intermediate dim."""

    expert_start: int         # first global expert id held here
    num_local_experts: int    # E_r
    intermediate_start: int   # first intermediate unit held here
    intermediate_size: int    # I_r

    def holds_expert(self, expert_id: int) -> bool:
        return self.expert_start <= expert_id < self.expert_start + self.num_local_experts


def moe_shard(num_experts: int, intermediate_size: int, *, tp_rank: int = 0, tp_size: int = 1,
              ep_rank: int = 0, ep_size: int = 1) -> MoEShard:
    """The experts ``[p E/P, (p+1) E/P)`` of EP rank p and the intermediate units ``[t I/R, (t+1) I/R)``
    of TP rank t. Raises ValueError when E is not divisible by ``ep_size`` or I by ``tp_size``."""
    for name, value in (("num_experts", num_experts), ("intermediate_size", intermediate_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    check_tp(tp_rank, tp_size)
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"ep_size must be an int >= 1, got {ep_size!r}")
    if not isinstance(ep_rank, int) or isinstance(ep_rank, bool) or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank must be an int in [0, {ep_size}), got {ep_rank!r}")
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    experts_per_rank = num_experts // ep_size
    if intermediate_size % tp_size:
        raise ValueError(f"the experts' intermediate size, {intermediate_size}, is not divisible by tp_size={tp_size}; "
                         "with expert_parallel the ranks split the experts instead")
    inter_per_rank = intermediate_size // tp_size
    return MoEShard(expert_start=ep_rank * experts_per_rank, num_local_experts=experts_per_rank,
                    intermediate_start=tp_rank * inter_per_rank, intermediate_size=inter_per_rank)


def moe_ranks(tp_rank: int, tp_size: int, expert_parallel: bool | str, tp_group=None) -> dict:
    """``FusedMoE``'s rank arguments in a model split over ``tp_size`` ranks (``tp_group``): by default every
    rank holds every expert's slice of I (tensor parallel); with ``expert_parallel`` (True / ``"all_reduce"``
    or ``"all_to_all"``, ``models.parallel``) each rank holds ``E / tp_size`` whole experts (expert parallel
    over the same ranks), combined by that exchange (``ep_comm``). Either way the layer communicates over
    ``tp_group``. Attention and dense layers stay tensor-parallel."""
    ep_comm = ep_comm_of(expert_parallel)
    if ep_comm is not None:
        return {"tp_rank": 0, "tp_size": 1, "ep_rank": tp_rank, "ep_size": tp_size, "group": tp_group,
                "ep_comm": ep_comm}
    return {"tp_rank": tp_rank, "tp_size": tp_size, "group": tp_group}


def moe_ranks_of(parallel: ParallelContext) -> dict:
    """``FusedMoE``'s rank keyword arguments in a model built over ``parallel``: :func:`moe_ranks` of its TP
    group, or with ``dp_attention`` the experts split over its DP group, each rank's own tokens exchanged
    (``tokens_replicated=False``, ``models.parallel``)."""
    if parallel.dp_attention:
        return {"tp_rank": 0, "tp_size": 1, "ep_rank": parallel.ep_rank, "ep_size": parallel.ep_size,
                "group": parallel.ep_group, "ep_comm": "all_to_all", "tokens_replicated": False}
    return moe_ranks(parallel.tp_rank, parallel.tp_size, parallel.expert_parallel, parallel.tp_group)


def expert_params_mapping(num_experts: int, *, gate: str = "gate_proj", up: str = "up_proj",
                          down: str = "down_proj", prefix: str = "experts",
                          bias: bool = False, scales: bool = False) -> list[tuple[str, str, Any]]:
    """Loader triples for checkpoints with one tensor per expert and projection.

    ``prefix.{e}.{gate}.weight -> prefix.w13_weight, shard (e, "w1")``, up -> ``(e, "w3")``,
    down -> ``prefix.w2_weight, (e, "w2")``; with ``bias`` the ``.bias`` tensors likewise; with
    ``scales`` the FP8 ``.weight_scale`` tensors (``weight_scale_inv`` is renamed so by the loader)
    into ``prefix.w13_weight_scale`` / ``w2_weight_scale`` (used when the experts are quantized).
    Qwen3-MoE / GLM-4-MoE: the defaults; Mixtral: ``gate="w1", up="w3", down="w2"``.
    """
    suffixes = ("weight", "bias") if bias else ("weight",)
    suffixes += ("weight_scale",) if scales else ()
    mapping = []
    for e in range(num_experts):
        for ckpt_name, fused, proj in ((gate, "w13", "w1"), (up, "w13", "w3"), (down, "w2", "w2")):
            for suffix in suffixes:
                mapping.append((f"{prefix}.{e}.{ckpt_name}.{suffix}", f"{prefix}.{fused}_{suffix}", (e, proj)))
    return mapping


def fused_expert_params_mapping(*, prefix: str = "experts", gate_up: str = "gate_up_proj",
                                down: str = "down_proj", transposed: bool = True,
                                bias: bool = False) -> list[tuple[str, str, Any]]:
    """Loader triples for checkpoints that already stack the experts (GPT-OSS: ``gate_up_proj``
    ``[E, H, 2I]`` interleaved, ``down_proj`` ``[E, I, H]``, biases ``gate_up_proj_bias`` ``[E, 2I]``,
    ``down_proj_bias`` ``[E, H]``). ``transposed=False``: weights in this module's own layout."""
    weight_shard = "transposed" if transposed else None
    mapping = [(f"{prefix}.{gate_up}", f"{prefix}.w13_weight", weight_shard),
               (f"{prefix}.{down}", f"{prefix}.w2_weight", weight_shard)]
    if bias:
        mapping += [(f"{prefix}.{gate_up}_bias", f"{prefix}.w13_bias", None),
                    (f"{prefix}.{down}_bias", f"{prefix}.w2_bias", None)]
    return mapping


def stacked_expert_params_mapping(*, prefix: str = "experts") -> list[tuple[str, str, Any]]:
    """Loader triples for the expert stacks transformers 5 keeps in memory (what a trainer's ``state_dict()``
    holds; its files keep one tensor per expert): ``{prefix}.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up
    rows) and ``{prefix}.down_proj`` ``[E, H, I]``, this module's own layout (shard id None). A model sets them
    as ``stacked_expert_params_mapping``, which the loader reads after ``expert_params_mapping`` and the
    quantization rules do not (no checkpoint file names these modules)."""
    return fused_expert_params_mapping(prefix=prefix, transposed=False)


def mxfp4_expert_params_mapping(*, prefix: str = "experts", gate_up: str = "gate_up_proj",
                                down: str = "down_proj") -> list[tuple[str, str, Any]]:
    """Loader triples for gpt-oss's MXFP4 experts, kept packed: ``{gate_up}_blocks`` ``[E, 2I, H/32, 16]``
    and ``{gate_up}_scales`` ``[E, 2I, H/32]`` (rows = output features, interleaved gate/up: this module's
    layout, no transpose), ``{down}_blocks`` ``[E, H, I/32, 16]``, ``{down}_scales`` ``[E, H, I/32]``."""
    return [(f"{prefix}.{gate_up}_blocks", f"{prefix}.w13_weight", None),
            (f"{prefix}.{gate_up}_scales", f"{prefix}.w13_weight_scale", None),
            (f"{prefix}.{down}_blocks", f"{prefix}.w2_weight", None),
            (f"{prefix}.{down}_scales", f"{prefix}.w2_weight_scale", None)]


class FusedMoE(nn.Module):
    """``out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])`` over this rank's experts.

    Args:
        num_experts: E, all experts of the layer (global).
        hidden_size: H.
        intermediate_size: I, each expert's full intermediate size.
        activation: ``"silu"`` (SwiGLU, gate/up halves) or ``"swiglu_clamped"`` (GPT-OSS, interleaved).
        bias: create ``w13_bias`` and ``w2_bias``.
        tp_rank, tp_size: split of I; ep_rank, ep_size: split of the experts (see the module docstring).
        reduce_results: all-reduce the partial sums when more than one rank holds the layer (all-to-all: gather
            the ranks' rows; False: this rank's partial sum either way).
        group: the process group of the ``tp_size * ep_size`` ranks holding the layer (the sum runs over it);
            None for one rank (or a shard that never reduces). With ``ep_comm="all_to_all"`` this process
            must be rank ``ep_rank`` of it (it holds the experts the group's rank ``ep_rank`` is sent).
        ep_comm: how expert-parallel ranks combine (``ep_size > 1``): ``"all_reduce"`` (every rank runs its
            experts on all T tokens, one all-reduce sums) or ``"all_to_all"`` (tokens dispatched to the ranks
            holding their experts and the outputs sent back: ``layers.expert_exchange``; needs ``tp_size`` 1).
            ``ep_exchange`` (an attribute, ``"auto"``): that module's ``padded`` / ``exact`` choice.
        tokens_replicated: with ``ep_comm="all_to_all"``, whether every rank of ``group`` holds the same tokens
            (True: TP ranks) or its own (False: DP attention; the exact exchange by default, as the ranks' T
            differ).
        quant_config, prefix: the model's ``QuantConfig`` and the layer's checkpoint name
            (``model.layers.{i}.mlp.experts``): ``quant_config.scheme_for(prefix)`` picks the expert
            method (None: unquantized). A scheme or split the fused MoE cannot serve is refused here,
            naming ``prefix``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 activation: str = "silu", bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 ep_rank: int = 0, ep_size: int = 1, reduce_results: bool = True,
                 dtype: torch.dtype | None = None, quant_config: QuantConfig | None = None,
                 prefix: str = "", group=None, ep_comm: str = "all_reduce", tokens_replicated: bool = True) -> None:
        super().__init__()
        if activation not in ACTIVATION_LAYOUTS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATION_LAYOUTS)}, got {activation!r}")
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
            raise ValueError(f"hidden_size must be an int >= 1, got {hidden_size!r}")
        self.shard = moe_shard(num_experts, intermediate_size, tp_rank=tp_rank, tp_size=tp_size,
                               ep_rank=ep_rank, ep_size=ep_size)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.layout = ACTIVATION_LAYOUTS[activation]
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.reduce_results = reduce_results
        self.prefix = prefix
        where = prefix or "FusedMoE"
        if ep_comm not in ("all_reduce", "all_to_all"):
            raise ValueError(f"ep_comm must be 'all_reduce' or 'all_to_all', got {ep_comm!r}")
        if ep_comm == "all_to_all" and tp_size > 1:
            raise ValueError(f"{where}: ep_comm='all_to_all' sends tokens to whole experts, but tp_size={tp_size} "
                             "splits each expert's intermediate dim")
        if not tokens_replicated and ep_comm != "all_to_all":
            raise ValueError(f"{where}: tokens_replicated=False (each rank's own tokens: DP attention) needs "
                             f"ep_comm='all_to_all', got {ep_comm!r}")
        self.ep_comm = ep_comm
        self.tokens_replicated = tokens_replicated
        # all-to-all: "auto", "padded" or "exact" (layers.expert_exchange); ranks with tokens of their own pass
        # different T, which only the exact exchange takes (padded needs one T on every rank)
        self.ep_exchange = "auto" if tokens_replicated else "exact"
        # (a sum is order-free: the group's size is checked, not which rank holds which piece; an all-to-all
        # sends a token's row to the group rank holding its expert, so there the rank must match)
        a2a = ep_comm == "all_to_all" and ep_size > 1
        check_group(group, ep_rank if a2a else 0, tp_size * ep_size, f"FusedMoE {prefix}".rstrip(), check_rank=a2a)
        self.group = group  # a torch.distributed ProcessGroup of the tp_size * ep_size ranks, or None
        scheme = UNQUANTIZED if quant_config is None else quant_config.scheme_for(prefix)
        online = quant_config is not None and quant_config.online
        self.quant_method: ExpertMethod = expert_method_for(scheme, online=online, where=where)
        self.quant_method.check_split(self, where)
        dtype = dtype or torch.get_default_dtype()
        e_r, i_r = self.shard.num_local_experts, self.shard.intermediate_size
        self.quant_method.create_weights(self, e_r, hidden_size, i_r, dtype, self._param)
        # what forward's hidden_quant may hold (the norm before the block quantizes: models.quantization.activation)
        self.input_quant = self.quant_method.input_quant(self)
        if bias:
            self.w13_bias = self._param((e_r, 2 * i_r), dtype, "w13_bias")
            self.w2_bias = self._param((e_r, hidden_size), dtype, "w2_bias")
        else:
            self.register_parameter("w13_bias", None)
            self.register_parameter("w2_bias", None)

    @property
    def weight_format(self) -> str | None:
        """``"fp8_block"``, ``"fp8_channel"``, ``"mxfp4"`` or None (unquantized experts)."""
        return self.quant_method.weight_format

    def _param(self, shape: tuple[int, ...], dtype: torch.dtype, name: str, row_unit: int = 1,
               col_unit: int | None = 1) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        param.label = f"FusedMoE.{name}"
        param.weight_loader = self.weight_loader
        param.moe_role = name  # which tensor: the loader below dispatches on it
        param.row_unit, param.col_unit = row_unit, col_unit  # see models.quantization.expert_methods
        return param

    def _scale_of(self, param: nn.Parameter) -> nn.Parameter:
        return self.w2_weight_scale if param.moe_role.startswith("w2") else self.w13_weight_scale

    # ---- loading --------------------------------------------------------------------------

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's piece of a checkpoint tensor into ``param`` (see the module docstring for shard ids)."""
        role = param.moe_role
        if shard_id is None or shard_id == "transposed":
            if shard_id == "transposed":
                if not role.endswith("_weight"):
                    raise ValueError(f"{param.label}: shard_id 'transposed' applies to weights, not biases")
                if loaded_weight.dim() != 3:
                    raise ValueError(f"{param.label}: a transposed stack must be 3-D, got shape "
                                     f"{tuple(loaded_weight.shape)}")
                loaded_weight = loaded_weight.transpose(1, 2)
            self._load_stack(param, loaded_weight)
            return
        if (not isinstance(shard_id, tuple) or len(shard_id) != 2 or isinstance(shard_id[0], bool)
                or not isinstance(shard_id[0], int) or shard_id[1] not in EXPERT_PROJECTIONS):
            raise ValueError(f"{param.label}: shard_id must be None, 'transposed' or (expert, 'w1'|'w3'|'w2'), "
                             f"got {shard_id!r}")
        expert, proj = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"{param.label}: expert {expert} out of range [0, {self.num_experts})")
        if (proj == "w2") != role.startswith("w2"):
            raise ValueError(f"{param.label}: shard_id {shard_id!r} does not fill this tensor")
        if not self.shard.holds_expert(expert):
            return  # another EP rank's expert
        self._load_expert(param, loaded_weight, expert - self.shard.expert_start, proj)

    def _gate_up_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's gate/up rows (dim 1) of a full ``[E_r, 2I, ...]`` stack, in this module's layout."""
        start, size, inter = self.shard.intermediate_start, self.shard.intermediate_size, self.intermediate_size
        if self.layout == "interleaved":  # unit j is rows 2j, 2j + 1: a TP slice is contiguous
            return full.narrow(1, 2 * start, 2 * size)
        return torch.cat([full.narrow(1, start, size), full.narrow(1, inter + start, size)], dim=1)

    def _stored(self, param: nn.Parameter, rows: int, cols: int) -> tuple[int, int]:
        """(rows, cols) ``param`` stores for a logical [rows, cols] matrix (see ``row_unit`` / ``col_unit``)."""
        col_unit = param.col_unit
        return -(-rows // param.row_unit), 1 if col_unit is None else -(-cols // col_unit)

    def _as_scale_rows(self, param: nn.Parameter, loaded: torch.Tensor, rows: int) -> torch.Tensor:
        """A per-channel scale stored ``[N]`` (Quark) as ``[N, 1]``; a per-tensor one (one value) spread over
        the N rows (exact: each row keeps the projection's scale)."""
        if param.col_unit is not None or not param.moe_role.endswith("_scale"):
            return loaded
        if loaded.numel() == 1 and rows != 1:
            return loaded.reshape(1, 1).expand(rows, 1)
        return loaded.unsqueeze(-1) if loaded.dim() == 1 else loaded

    def _load_stack(self, param: nn.Parameter, full: torch.Tensor) -> None:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        role = param.moe_role
        if role.endswith("_bias"):
            check_shape(param.label, full, {"w13_bias": (e, 2 * i), "w2_bias": (e, h)}[role])
            mine = full.narrow(0, self.shard.expert_start, self.shard.num_local_experts)
            copy_into(param.data, self._gate_up_rows(mine) if role == "w13_bias" else mine)
            return
        rows, cols = (2 * i, h) if role.startswith("w13") else (h, i)
        if getattr(param, "quantize_on_load", None) is not None:
            check_shape(param.label, full, (e, rows, cols))
            self._quantize_stack(param, full)
            return
        if self.weight_format in ("fp8_block", "fp8_channel"):
            raise UnsupportedQuantizationError(
                f"{self.prefix or param.label}: FP8 experts stored as one stacked tensor are not supported "
                "(per-expert tensors with their scales are; stacked experts load unquantized, as MXFP4, or "
                "quantized while loading)")
        if param.col_unit == 2 and full.dim() == 4:  # gpt-oss MXFP4 blocks [E, N, K/32, 16] -> [E, N, K/2]
            full = full.flatten(-2)
        check_shape(param.label, full, (e, *self._stored(param, rows, cols)))
        mine = full.narrow(0, self.shard.expert_start, self.shard.num_local_experts)
        if role.startswith("w13"):
            mine = self._gate_up_rows(mine)  # (row_unit is 1 for every stacked format)
        elif param.col_unit is not None:
            unit = param.col_unit
            mine = mine.narrow(2, self.shard.intermediate_start // unit, self.shard.intermediate_size // unit)
        copy_into(param.data, mine)

    def _quantize_stack(self, param: nn.Parameter, full: torch.Tensor) -> None:
        """Online quantization of a float stack (module layout), one local expert at a time."""
        fmt, scale = param.quantize_on_load, self._scale_of(param)
        start, size = self.shard.intermediate_start, self.shard.intermediate_size
        for local in range(self.shard.num_local_experts):
            w = full[self.shard.expert_start + local].to(param.device)
            if param.moe_role.startswith("w13"):
                q, s = quantize_weight(self._gate_up_rows(w[None])[0], fmt)
            else:
                q, s = quantize_weight(w.narrow(1, start, size), fmt, row_amax=self._row_amax(w, fmt))
            copy_into(param.data[local], q)
            copy_into(scale.data[local], s)

    def _row_amax(self, down: torch.Tensor, fmt) -> torch.Tensor | None:
        """Per-channel scales of the down projection are over its full rows, whichever columns this rank holds."""
        return down.abs().amax(dim=1) if fmt.scales == "per_channel" and self.tp_size > 1 else None

    def _load_expert(self, param: nn.Parameter, loaded: torch.Tensor, local: int, proj: str) -> None:
        h, i = self.hidden_size, self.intermediate_size
        start, size = self.shard.intermediate_start, self.shard.intermediate_size
        role = param.moe_role
        label = f"{param.label}[expert {self.shard.expert_start + local}, {proj}]"
        if role == "w2_bias":
            check_shape(label, loaded, (h,))
            copy_into(param.data[local], loaded)
            return
        if role == "w13_bias":
            check_shape(label, loaded, (i,))
            self._copy_gate_up(param, local, proj, loaded.narrow(0, start, size), 1)
            return
        fmt = getattr(param, "quantize_on_load", None)
        if role == "w2_weight" or role == "w2_weight_scale":
            if fmt is not None:
                check_shape(label, loaded, (h, i))
                q, s = quantize_weight(loaded.narrow(1, start, size).to(param.device), fmt,
                                       row_amax=self._row_amax(loaded, fmt))
                copy_into(param.data[local], q)
                copy_into(self.w2_weight_scale.data[local], s)
                return
            loaded = self._as_scale_rows(param, loaded, h)
            check_shape(label, loaded, self._stored(param, h, i))
            unit = param.col_unit
            copy_into(param.data[local], loaded if unit is None else loaded.narrow(1, start // unit, -(-size // unit)))
            return
        if fmt is not None:
            check_shape(label, loaded, (i, h))
            q, s = quantize_weight(loaded.narrow(0, start, size).to(param.device), fmt)
            self._copy_gate_up(param, local, proj, q, 1)
            self._copy_gate_up(self.w13_weight_scale, local, proj, s, self.w13_weight_scale.row_unit)
            return
        loaded = self._as_scale_rows(param, loaded, i)
        check_shape(label, loaded, self._stored(param, i, h))
        unit = param.row_unit  # (a block split that is not whole blocks was refused when the layer was built)
        self._copy_gate_up(param, local, proj, loaded.narrow(0, start // unit, -(-size // unit)), unit)

    def _copy_gate_up(self, param: nn.Parameter, local: int, proj: str, piece: torch.Tensor, row_unit: int) -> None:
        """This rank's rows of expert ``local``'s gate (w1) or up (w3) part into its place in ``param``."""
        up = proj == "w3"
        if self.layout == "interleaved":
            if row_unit != 1:
                raise UnsupportedQuantizationError(
                    f"{self.prefix or param.label}: per-expert block-scaled gate/up tensors cannot be interleaved "
                    f"({self.activation}); such experts load as one stack, quantized while loading")
            dst = param.data[local, int(up)::2]
        else:
            rows = piece.shape[0]
            dst = param.data[local].narrow(0, rows if up else 0, rows)
        copy_into(dst, piece)

    # ---- forward --------------------------------------------------------------------------

    def local_topk_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids [T, K] -> this rank's local ids, -1 where another EP rank holds the expert."""
        if self.ep_size == 1:
            return topk_ids
        local = topk_ids - self.shard.expert_start
        held = (local >= 0) & (local < self.shard.num_local_experts)
        return torch.where(held, local, torch.full_like(local, -1))

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                hidden_quant: QuantizedActivation | None = None) -> torch.Tensor:
        """hidden [T, H]; topk_weights [T, K] fp32; topk_ids [T, K] int32 global expert ids -> [T, H].
        hidden_quant: hidden quantized as ``input_quant`` says (by the norm before the block), or None.

        With several ranks and ``reduce_results=False`` the result is this rank's partial sum.
        """
        if self.ep_comm == "all_to_all" and self.ep_size > 1:
            if self.ep_exchange not in EXCHANGES:
                raise ValueError(f"{self.prefix or 'FusedMoE'}: ep_exchange must be one of {EXCHANGES}, "
                                 f"got {self.ep_exchange!r}")
            group = require_group(self.group, self.ep_size, self)
            return all_to_all_experts(self, hidden, topk_weights, topk_ids, group,
                                      tokens_replicated=self.tokens_replicated)
        out = self.quant_method.apply(self, hidden, topk_weights, self.local_topk_ids(topk_ids),
                                      self.w2_bias if self.tp_rank == 0 else None, hidden_quant)
        if self.reduce_results and self.tp_size * self.ep_size > 1:
            out = reduce_over(out, self.group, self.tp_size * self.ep_size, self)
        return out

    def extra_repr(self) -> str:
        quant = "" if self.weight_format is None else f", quant={self.quant_method.describe()}"
        return (f"num_experts={self.num_experts}, local_experts={self.shard.num_local_experts}, "
                f"hidden_size={self.hidden_size}, intermediate_per_rank={self.shard.intermediate_size}, "
                f"activation={self.activation}, bias={self.w13_bias is not None}, "
                f"tp={self.tp_rank}/{self.tp_size}, ep={self.ep_rank}/{self.ep_size}"
                f"{', all-to-all' if self.ep_comm == 'all_to_all' else ''}{quant}")
