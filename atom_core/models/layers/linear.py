"""Linear layers whose weights may be split across tensor-parallel ranks.

Legend: T = tokens (any leading dims), I = input features, O = output features of the full
(unsharded) layer, r = tp_rank, R = tp_size.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``: it receives
the FULL checkpoint tensor (all ranks' rows), checks its shape, cuts out this rank's piece
and copies it in (casting to the parameter's dtype and device). ``shard_id`` picks the piece
of a fused parameter that the checkpoint tensor fills (``"q"``/``"k"``/``"v"`` for
``QKVParallelLinear``, an index into ``output_sizes`` for ``MergedColumnParallelLinear``);
``None`` means the checkpoint tensor is already the whole fused tensor.

With ``tp_size == 1`` every class is a plain ``F.linear`` over the full weight.

**Groups.** The parallel classes take ``tp_group``, the process group of the ``tp_size`` ranks (this
process its rank ``tp_rank``; checked when the layer is built), and ``RowParallelLinear`` sums its
ranks' partial products over it with ``ops.all_reduce`` — never over ``torch.distributed``'s default
group (``models.parallel``). A layer split over several ranks but built without a group (to inspect a
shard) raises ``MissingProcessGroupError`` when it has to reduce.
Weights are stored ``[out, in]`` like ``nn.Linear`` and are created uninitialised
(``torch.empty``): a checkpoint or a dummy initialiser fills them.

**Quantized layers.** Every class takes ``quant_config`` (a ``QuantConfig`` bound to the model's
name mappings, or None) and ``prefix`` (the layer's parameter-name prefix, e.g.
``model.layers.0.self_attn.qkv_proj``); ``quant_config.scheme_for(prefix)`` picks the layer's
linear method (``models.quantization.linear_methods``: unquantized, FP8, INT8), which creates the
weight and its scale parameters and computes ``forward``. The loaders here shard every such
parameter by the attributes the method gives it:

- rows (``output_dim=0``: weight, bias, per-channel scale ``[O, 1]``; a checkpoint's ``[O]`` is
  taken as ``[O, 1]``): cut like the weight's rows in the column-parallel classes, whole in the
  row-parallel one;
- columns (``input_dim=1``: the weight): cut in the row-parallel class;
- 128-blocks (``block_size=128``: block-FP8 ``weight_scale`` ``[ceil(O/128), ceil(I/128)]``): cut in
  blocks along the same dims; a split that would cut a block (a rank's rows or columns not a
  multiple of 128, or a fused part other than the last that is not) is refused when the layer is
  built, naming it;
- per part (``per_part``: per-tensor ``weight_scale`` / ``input_scale``, one value per fused part):
  element ``i`` of the parameter is shard ``i``'s scalar (q, k, v = 0, 1, 2), replicated.

A weight created with ``quantize_on_load`` (online quantization) takes the unquantized checkpoint
tensor: this rank's piece is quantized as it is read and its scales written beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from atom_core.models.layers.sharding import check_tp, divide, qkv_shard, shard_range
from atom_core.models.parallel import check_group, reduce_over
from atom_core.models.quantization.activation import QuantizedActivation
from atom_core.models.quantization.config import QuantConfig
from atom_core.models.quantization.linear_methods import (
    LinearMethod,
    UnquantizedLinear,
    linear_method_for,
    make_param,
    quantize_weight,
)
from atom_core.models.quantization.schemes import UnsupportedQuantizationError


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_shape(label: str, loaded: torch.Tensor, expected: Sequence[int], stored: torch.Tensor | None = None) -> None:
    """Raise ValueError naming ``label`` and both shapes unless ``loaded.shape == expected`` (``stored``: the
    checkpoint's tensor where ``loaded`` is a view of it in the parameter's layout; its shape is the one named)."""
    if _shape(loaded) != tuple(expected):
        raise ValueError(
            f"{label}: checkpoint tensor has shape {_shape(loaded if stored is None else stored)}, "
            f"expected {tuple(expected)}"
        )


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` (same shape), casting dtype and moving device in one ``copy_``."""
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Load a checkpoint tensor that maps one-to-one onto ``param`` (no sharding, no fusing)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {_shape(param)} is not fused; got shard_id={shard_id!r}")
    check_shape(getattr(param, "label", "parameter"), loaded_weight, param.shape)
    copy_into(param.data, loaded_weight)


def _make_param(shape: Sequence[int], dtype: torch.dtype | None, label: str,
                loader: Callable[..., None], **sharding) -> nn.Parameter:
    """An uninitialised inference parameter (no grad) with ``label``, ``weight_loader`` and sharding attributes."""
    return make_param(shape, dtype or torch.get_default_dtype(), label, loader, **sharding)


def _named(prefix: str, what: str) -> str:
    """``what`` in an error message, after the layer's name where the layer was given one."""
    return f"{prefix}: {what}" if prefix else what


def linear_method(quant_config: QuantConfig | None, prefix: str) -> LinearMethod:
    """The linear method of the layer named ``prefix`` under ``quant_config`` (None: unquantized)."""
    if quant_config is None:
        return UnquantizedLinear()
    if not prefix:
        raise ValueError("a layer built with a quant_config needs its prefix (parameter-name prefix) to find "
                         "its scheme")
    return linear_method_for(quant_config.scheme_for(prefix), online=quant_config.online, where=prefix)


def _as_rows(loaded: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """A per-channel scale stored ``[O]`` (Quark) as the parameter's ``[O, 1]`` (compressed-tensors' shape)."""
    if param.dim() == 2 and param.shape[1] == 1 and loaded.dim() == 1 and getattr(param, "input_dim", 1) is None:
        return loaded.unsqueeze(1)
    return loaded


def _load_scalar(param: nn.Parameter, loaded: torch.Tensor, index: int | None, label: str) -> None:
    """A per-tensor scale (one value, stored ``[]`` or ``[1]``) into element ``index`` (None: every element)."""
    if loaded.numel() != 1:
        raise ValueError(f"{label}: a per-tensor scale holds one value, got shape {tuple(loaded.shape)}")
    with torch.no_grad():
        if index is None:
            param.data.copy_(loaded.reshape(1).expand(param.shape[0]))
        else:
            param.data[index:index + 1].copy_(loaded.reshape(1))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _Piece:
    """Rows ``[src_start, src_start + size)`` of a full checkpoint tensor of ``full_rows`` rows (one
    part of a fused layer) go to rows ``[dst_offset, dst_offset + size)`` of this rank's parameter."""

    shard_id: object
    full_rows: int
    src_start: int
    size: int
    dst_offset: int
    name: str


class _Linear(nn.Module):
    """Shared body: the linear method's ``[out_per_rank, in_per_rank]`` weight (and scales), an optional
    bias, ``forward`` through the method."""

    def __init__(self, in_per_rank: int, out_per_rank: int, bias: bool, bias_rows: int,
                 dtype: torch.dtype | None, tp_rank: int, tp_size: int, *,
                 quant_config: QuantConfig | None = None, prefix: str = "",
                 part_sizes: Sequence[int] | None = None, tp_group=None) -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.prefix = prefix
        name = type(self).__name__
        check_group(tp_group, tp_rank, tp_size, f"{name} {prefix}".rstrip())
        self.tp_group = tp_group  # a torch.distributed ProcessGroup of the tp_size ranks, or None
        self.quant_method = linear_method(quant_config, prefix)
        self.quant_method.create_weights(self, in_per_rank, list(part_sizes or [out_per_rank]),
                                         dtype or torch.get_default_dtype(), self.weight_loader)
        # The quantized form of the input that forward also takes (models.quantization.activation).
        self.input_quant = self.quant_method.input_quant(in_per_rank)
        if bias:
            self.bias = _make_param((bias_rows,), dtype, f"{name}.bias", self.weight_loader, input_dim=None)
        else:
            self.register_parameter("bias", None)

    @property
    def scheme(self):
        """The layer's ``LinearScheme`` (``UNQUANTIZED`` for a plain layer)."""
        return self.quant_method.scheme

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """x: [T, in_per_rank] -> [T, out_per_rank], in x's dtype (the model dtype); x may come quantized as
        ``input_quant`` says."""
        return self.quant_method.apply(self, x, self.bias)

    def _check_block_split(self, pieces: Sequence[_Piece], *, dim: str) -> None:
        """Refuse, naming the layer, a rank's rows (``dim="rows"``) or columns whose piece of a 128-block
        format would cut a block: every piece must start on a block and, unless it is the last piece of
        the parameter and ends the tensor, hold whole blocks."""
        block = getattr(self.weight_scale, "block_size", None) if hasattr(self, "weight_scale") else None
        if not block:
            return
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            whole = piece.size % block == 0 or (last and piece.src_start + piece.size == piece.full_rows)
            if piece.src_start % block or piece.dst_offset % block or not whole:
                what = f"{piece.name} " if piece.name else ""
                hint = ("use a tensor-parallel size that keeps blocks whole" if self.tp_size > 1 else
                        "a fused layer's parts other than the last must be whole blocks: block FP8 cannot serve "
                        f"parts of {[p.full_rows for p in pieces]} rows")
                raise UnsupportedQuantizationError(
                    f"{self.prefix or type(self).__name__}: FP8 128 x 128 block scales cannot follow this split: "
                    f"{what}{dim} [{piece.src_start}, {piece.src_start + piece.size}) of {piece.full_rows} on "
                    f"tp_rank {self.tp_rank} of {self.tp_size} cut a 128-block (each rank's {dim} of each part "
                    f"must be whole blocks); {hint}")

    def extra_repr(self) -> str:
        quant = "" if not self.scheme.is_quantized else f", quant={self.quant_method.describe()}"
        return (f"in_per_rank={self.weight.shape[1]}, out_per_rank={self.weight.shape[0]}, "
                f"bias={self.bias is not None}, tp_rank={self.tp_rank}, tp_size={self.tp_size}{quant}")


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class ReplicatedLinear(_Linear):
    """The whole ``[output_size, input_size]`` weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 dtype: torch.dtype | None = None, quant_config: QuantConfig | None = None,
                 prefix: str = "") -> None:
        _check_positive(input_size=input_size, output_size=output_size)
        self.input_size = input_size
        self.output_size = output_size
        super().__init__(input_size, output_size, bias, output_size, dtype, 0, 1,
                         quant_config=quant_config, prefix=prefix)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{param.label} is not fused; got shard_id={shard_id!r}")
        if getattr(param, "per_part", False):
            _load_scalar(param, loaded_weight, None, param.label)
            return
        fmt = getattr(param, "quantize_on_load", None)
        if fmt is not None:
            check_shape(param.label, loaded_weight, param.shape)
            q, scale = quantize_weight(loaded_weight.to(param.device), fmt)
            copy_into(param.data, q)
            copy_into(self.weight_scale.data, scale)
            return
        rows = _as_rows(loaded_weight, param)
        check_shape(param.label, rows, param.shape, stored=loaded_weight)
        copy_into(param.data, rows)


class ColumnParallelLinear(_Linear):
    """Output dim split across ranks: rank r holds rows ``[r*O/R, (r+1)*O/R)`` of W (and of b).

    forward: [T, I] -> [T, O/R] (the output stays sharded; a RowParallelLinear usually follows).
    """

    _fused = False  # whether the layer is made of parts (shard ids); a shard_id None tensor then holds them all

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype | None = None,
                 quant_config: QuantConfig | None = None, prefix: str = "", tp_group=None) -> None:
        _check_positive(input_size=input_size, output_size=output_size)
        check_tp(tp_rank, tp_size)
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = divide(output_size, tp_size, what=_named(prefix, "output_size"))
        super().__init__(input_size, self.output_size_per_rank, bias, self.output_size_per_rank,
                         dtype, tp_rank, tp_size, quant_config=quant_config, prefix=prefix,
                         part_sizes=[o // tp_size for o in getattr(self, "output_sizes", [output_size])],
                         tp_group=tp_group)
        self._check_block_split(self._pieces(), dim="rows")

    def _pieces(self) -> list[_Piece]:
        """This rank's rows of each part of the layer's full checkpoint tensor(s), in parameter order."""
        start, size = shard_range(self.output_size, self.tp_rank, self.tp_size)
        return [_Piece(None, self.output_size, start, size, 0, "")]

    def _piece(self, param, shard_id) -> tuple[int, _Piece, str]:
        """(part index, piece, label) of ``shard_id``; ValueError for a shard id this layer does not have."""
        if shard_id is not None:
            raise ValueError(f"{param.label} is not fused; got shard_id={shard_id!r}")
        return 0, self._pieces()[0], param.label

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None and self._fused:
            self._load_fused(param, loaded_weight, self._pieces())
            return
        index, piece, label = self._piece(param, shard_id)
        self._load_piece(param, loaded_weight, index, piece, label)

    def _load_fused(self, param, loaded, pieces: list[_Piece]) -> None:
        """The checkpoint already holds the fused tensor (every part, full rows): split it and load piece by piece."""
        if getattr(param, "per_part", False):
            _load_scalar(param, loaded, None, param.label)  # one scale for the fused tensor: every part's
            return
        block = getattr(param, "block_size", None) or 1
        full = [_cdiv(p.full_rows, block) for p in pieces]
        if block > 1 and any(p.full_rows % block for p in pieces[:-1]):
            raise ValueError(f"{param.label}: a fused checkpoint tensor's block scales cannot be split into parts "
                             f"of {[p.full_rows for p in pieces]} rows (not whole 128-blocks)")
        rows = _as_rows(loaded, param)
        check_shape(param.label, rows, (sum(full), *param.shape[1:]), stored=loaded)
        loaded = rows
        offset = 0
        for i, (piece, rows) in enumerate(zip(pieces, full)):
            self._load_piece(param, loaded.narrow(0, offset, rows), i, piece, f"{param.label}[{piece.name}]")
            offset += rows

    def _load_piece(self, param, loaded, index: int, piece: _Piece, label: str) -> None:
        if getattr(param, "per_part", False):
            _load_scalar(param, loaded, index, label)
            return
        fmt = getattr(param, "quantize_on_load", None)
        if fmt is not None:
            check_shape(label, loaded, (piece.full_rows, *param.shape[1:]))
            q, scale = quantize_weight(loaded.narrow(0, piece.src_start, piece.size).to(param.device), fmt)
            copy_into(param.data.narrow(0, piece.dst_offset, piece.size), q)
            dst = piece.dst_offset // (self.weight_scale.block_size or 1)
            copy_into(self.weight_scale.data.narrow(0, dst, scale.shape[0]), scale)
            return
        stored, loaded = loaded, _as_rows(loaded, param)
        block = getattr(param, "block_size", None)
        if block:  # rows counted in 128-blocks (alignment checked when the layer was built)
            full, src = _cdiv(piece.full_rows, block), piece.src_start // block
            size, dst = _cdiv(piece.src_start + piece.size, block) - src, piece.dst_offset // block
        else:
            full, src, size, dst = piece.full_rows, piece.src_start, piece.size, piece.dst_offset
        check_shape(label, loaded, (full, *param.shape[1:]), stored=stored)
        copy_into(param.data.narrow(0, dst, size), loaded.narrow(0, src, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused along the output dim.

    ``output_sizes = [O_0, O_1, ...]`` (full sizes, each divisible by R); rank r's weight is
    the concatenation of its column shards ``[W_0 shard r; W_1 shard r; ...]``, so with
    gate/up (shard ids 0/1) the output is ``[gate_r | up_r]``, ready for ``silu_and_mul``.
    """

    _fused = True

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, *,
                 tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype | None = None,
                 quant_config: QuantConfig | None = None, prefix: str = "", tp_group=None) -> None:
        if isinstance(output_sizes, (int, str)) or len(output_sizes) == 0:
            raise ValueError(f"output_sizes must be a non-empty list of ints, got {output_sizes!r}")
        check_tp(tp_rank, tp_size)
        for i, size in enumerate(output_sizes):
            _check_positive(**{f"output_sizes[{i}]": size})
            divide(size, tp_size, what=_named(prefix, f"output_sizes[{i}]"))
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype,
                         quant_config=quant_config, prefix=prefix, tp_group=tp_group)

    def _pieces(self) -> list[_Piece]:
        pieces, dst = [], 0
        for i, full in enumerate(self.output_sizes):
            start, size = shard_range(full, self.tp_rank, self.tp_size)
            pieces.append(_Piece(i, full, start, size, dst, f"part {i}"))
            dst += size
        return pieces

    def _piece(self, param, shard_id) -> tuple[int, _Piece, str]:
        if not isinstance(shard_id, int) or isinstance(shard_id, bool) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"{param.label}: shard_id must be an index in [0, {len(self.output_sizes)}), got {shard_id!r}"
            )
        return shard_id, self._pieces()[shard_id], f"{param.label}[shard {shard_id}]"


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused, split across ranks by heads.

    Full checkpoint tensors: q_proj ``[num_heads * head_dim, hidden]``, k_proj and v_proj
    ``[num_kv_heads * head_dim, hidden]``. Rank r's weight is
    ``[q heads of r; k heads of r; v heads of r]`` with ``.num_heads``/``.num_kv_heads`` heads
    per rank (see ``sharding.qkv_shard``; KV heads are replicated when fewer than ranks).
    forward: [T, hidden] -> [T, q_size + 2 * kv_size]; split with
    ``out.split([q_size, kv_size, kv_size], dim=-1)``.
    """

    _fused = True

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype | None = None, quant_config: QuantConfig | None = None,
                 prefix: str = "", tp_group=None) -> None:
        _check_positive(hidden_size=hidden_size)
        shard = qkv_shard(num_heads, num_kv_heads, head_dim, tp_rank, tp_size)
        self.shard = shard
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.q_size = shard.q_size
        self.kv_size = shard.kv_size
        self.input_size = hidden_size
        # Rows of the full fused checkpoint tensor [q; k; v].
        self.output_size = (num_heads + 2 * num_kv_heads) * head_dim
        self.output_size_per_rank = self.q_size + 2 * self.kv_size
        _Linear.__init__(self, hidden_size, self.output_size_per_rank, bias, self.output_size_per_rank, dtype,
                         tp_rank, tp_size, quant_config=quant_config, prefix=prefix,
                         part_sizes=[self.q_size, self.kv_size, self.kv_size], tp_group=tp_group)
        self._check_block_split(self._pieces(), dim="rows")

    def _pieces(self) -> list[_Piece]:
        hd = self.head_dim
        full_q, full_kv = self.total_num_heads * hd, self.total_num_kv_heads * hd
        q_start, kv_start = self.shard.q_start * hd, self.shard.kv_start * hd
        return [_Piece("q", full_q, q_start, self.q_size, 0, "q"),
                _Piece("k", full_kv, kv_start, self.kv_size, self.q_size, "k"),
                _Piece("v", full_kv, kv_start, self.kv_size, self.q_size + self.kv_size, "v")]

    def _piece(self, param, shard_id) -> tuple[int, _Piece, str]:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"{param.label}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        index = "qkv".index(shard_id)
        return index, self._pieces()[index], f"{param.label}[{shard_id}]"


class RowParallelLinear(_Linear):
    """Input dim split across ranks: rank r holds columns ``[r*I/R, (r+1)*I/R)`` of W.

    forward: x [T, I/R] (this rank's slice, e.g. the output of a ColumnParallelLinear)
    -> [T, O]. With R > 1 the partial products are summed over ``tp_group`` with ``ops.all_reduce``
    when ``reduce_results``; otherwise each rank returns its partial sum and the caller reduces. The bias (full, ``[O]``, identical on every rank) is
    added by rank 0 only, so it appears exactly once in the sum. Per-channel and per-tensor scales
    (and ``input_scale``) are whole on every rank; block scales are cut by 128-column blocks.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 reduce_results: bool = True, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype | None = None, quant_config: QuantConfig | None = None,
                 prefix: str = "", tp_group=None) -> None:
        _check_positive(input_size=input_size, output_size=output_size)
        check_tp(tp_rank, tp_size)
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = divide(input_size, tp_size, what=_named(prefix, "input_size"))
        self.reduce_results = reduce_results
        super().__init__(self.input_size_per_rank, output_size, bias, output_size, dtype, tp_rank, tp_size,
                         quant_config=quant_config, prefix=prefix, tp_group=tp_group)
        start, size = shard_range(self.input_size, tp_rank, tp_size)
        self._check_block_split([_Piece(None, input_size, start, size, 0, "")], dim="columns")

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{param.label} is not fused; got shard_id={shard_id!r}")
        if getattr(param, "per_part", False):
            _load_scalar(param, loaded_weight, None, param.label)
            return
        if getattr(param, "input_dim", 1) is None:  # bias, per-channel scale: whole on every rank
            rows = _as_rows(loaded_weight, param)
            check_shape(param.label, rows, param.shape, stored=loaded_weight)
            copy_into(param.data, rows)
            return
        start, size = shard_range(self.input_size, self.tp_rank, self.tp_size)
        fmt = getattr(param, "quantize_on_load", None)
        if fmt is not None:
            check_shape(param.label, loaded_weight, (self.output_size, self.input_size))
            # Per-channel scales are over the whole row (as offline quantization makes them), whichever
            # columns this rank holds; block scales never span two ranks.
            row_amax = loaded_weight.abs().amax(dim=1) if fmt.scales == "per_channel" and self.tp_size > 1 else None
            q, scale = quantize_weight(loaded_weight.narrow(1, start, size).to(param.device), fmt, row_amax=row_amax)
            copy_into(param.data, q)
            copy_into(self.weight_scale.data, scale)
            return
        block = getattr(param, "block_size", None)
        if block:  # columns counted in 128-blocks (alignment checked when the layer was built)
            full, start, size = _cdiv(self.input_size, block), start // block, _cdiv(start + size, block) - start // block
        else:
            full = self.input_size
        check_shape(param.label, loaded_weight, (param.shape[0], full))
        copy_into(param.data, loaded_weight.narrow(1, start, size))

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """x: [T, I/R] (or quantized as ``input_quant`` says) -> [T, O]."""
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results:
            out = reduce_over(out, self.tp_group, self.tp_size, self)
        return out
