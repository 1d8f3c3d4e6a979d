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
Weights are stored ``[out, in]`` like ``nn.Linear`` and are created uninitialised
(``torch.empty``): a checkpoint or a dummy initialiser fills them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from atom_core.models.layers.sharding import check_tp, divide, qkv_shard, shard_range


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_shape(label: str, loaded: torch.Tensor, expected: Sequence[int]) -> None:
    """Raise ValueError naming ``label`` and both shapes unless ``loaded.shape == expected``."""
    if _shape(loaded) != tuple(expected):
        raise ValueError(
            f"{label}: checkpoint tensor has shape {_shape(loaded)}, expected {tuple(expected)}"
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
                loader: Callable[..., None]) -> nn.Parameter:
    """An uninitialised inference parameter (no grad) with ``label`` and ``weight_loader`` attached."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype or torch.get_default_dtype()), requires_grad=False)
    param.label = label
    param.weight_loader = loader
    return param


class _Linear(nn.Module):
    """Shared body: a ``[out_per_rank, in_per_rank]`` weight, an optional bias, ``F.linear``."""

    def __init__(self, in_per_rank: int, out_per_rank: int, bias: bool, bias_rows: int,
                 dtype: torch.dtype | None, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        name = type(self).__name__
        self.weight = _make_param((out_per_rank, in_per_rank), dtype, f"{name}.weight", self.weight_loader)
        if bias:
            self.bias = _make_param((bias_rows,), dtype, f"{name}.bias", self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_per_rank] -> [T, out_per_rank], dtype of the weight."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_per_rank={self.weight.shape[1]}, out_per_rank={self.weight.shape[0]}, "
                f"bias={self.bias is not None}, tp_rank={self.tp_rank}, tp_size={self.tp_size}")


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class ReplicatedLinear(_Linear):
    """The whole ``[output_size, input_size]`` weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 dtype: torch.dtype | None = None) -> None:
        _check_positive(input_size=input_size, output_size=output_size)
        self.input_size = input_size
        self.output_size = output_size
        super().__init__(input_size, output_size, bias, output_size, dtype, 0, 1)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{param.label} is not fused; got shard_id={shard_id!r}")
        check_shape(param.label, loaded_weight, param.shape)
        copy_into(param.data, loaded_weight)


class ColumnParallelLinear(_Linear):
    """Output dim split across ranks: rank r holds rows ``[r*O/R, (r+1)*O/R)`` of W (and of b).

    forward: [T, I] -> [T, O/R] (the output stays sharded; a RowParallelLinear usually follows).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype | None = None) -> None:
        _check_positive(input_size=input_size, output_size=output_size)
        check_tp(tp_rank, tp_size)
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = divide(output_size, tp_size, what="output_size")
        super().__init__(input_size, self.output_size_per_rank, bias, self.output_size_per_rank,
                         dtype, tp_rank, tp_size)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{param.label} is not fused; got shard_id={shard_id!r}")
        full = (self.output_size, *param.shape[1:])
        check_shape(param.label, loaded_weight, full)
        start, size = shard_range(self.output_size, self.tp_rank, self.tp_size)
        copy_into(param.data, loaded_weight.narrow(0, start, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused along the output dim.

    ``output_sizes = [O_0, O_1, ...]`` (full sizes, each divisible by R); rank r's weight is
    the concatenation of its column shards ``[W_0 shard r; W_1 shard r; ...]``, so with
    gate/up (shard ids 0/1) the output is ``[gate_r | up_r]``, ready for ``silu_and_mul``.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, *,
                 tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype | None = None) -> None:
        if isinstance(output_sizes, (int, str)) or len(output_sizes) == 0:
            raise ValueError(f"output_sizes must be a non-empty list of ints, got {output_sizes!r}")
        check_tp(tp_rank, tp_size)
        for i, size in enumerate(output_sizes):
            _check_positive(**{f"output_sizes[{i}]": size})
            divide(size, tp_size, what=f"output_sizes[{i}]")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias,
                         tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None:
            # The checkpoint already holds the fused tensor: split it and load piece by piece.
            check_shape(param.label, loaded_weight, (self.output_size, *param.shape[1:]))
            offset = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), i)
                offset += size
            return
        if not isinstance(shard_id, int) or isinstance(shard_id, bool) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"{param.label}: shard_id must be an index in [0, {len(self.output_sizes)}), got {shard_id!r}"
            )
        full_rows = self.output_sizes[shard_id]
        check_shape(f"{param.label}[shard {shard_id}]", loaded_weight, (full_rows, *param.shape[1:]))
        start, size = shard_range(full_rows, self.tp_rank, self.tp_size)
        dst_offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        copy_into(param.data.narrow(0, dst_offset, size), loaded_weight.narrow(0, start, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused, split across ranks by heads.

    Full checkpoint tensors: q_proj ``[num_heads * head_dim, hidden]``, k_proj and v_proj
    ``[num_kv_heads * head_dim, hidden]``. Rank r's weight is
    ``[q heads of r; k heads of r; v heads of r]`` with ``.num_heads``/``.num_kv_heads`` heads
    per rank (see ``sharding.qkv_shard``; KV heads are replicated when fewer than ranks).
    forward: [T, hidden] -> [T, q_size + 2 * kv_size]; split with
    ``out.split([q_size, kv_size, kv_size], dim=-1)``.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype | None = None) -> None:
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
        _Linear.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias,
                         self.q_size + 2 * self.kv_size, dtype, tp_rank, tp_size)
        self.output_size_per_rank = self.q_size + 2 * self.kv_size

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        hd = self.head_dim
        full_q = self.total_num_heads * hd
        full_kv = self.total_num_kv_heads * hd
        if shard_id is None:
            check_shape(param.label, loaded_weight, (full_q + 2 * full_kv, *param.shape[1:]))
            for sid, offset, rows in (("q", 0, full_q), ("k", full_q, full_kv), ("v", full_q + full_kv, full_kv)):
                self.weight_loader(param, loaded_weight.narrow(0, offset, rows), sid)
            return
        if shard_id == "q":
            full_rows, src_start, size, dst_offset = full_q, self.shard.q_start * hd, self.q_size, 0
        elif shard_id == "k":
            full_rows, src_start, size, dst_offset = full_kv, self.shard.kv_start * hd, self.kv_size, self.q_size
        elif shard_id == "v":
            full_rows, src_start, size, dst_offset = (full_kv, self.shard.kv_start * hd, self.kv_size,
                                                      self.q_size + self.kv_size)
        else:
            raise ValueError(f"{param.label}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        check_shape(f"{param.label}[{shard_id}]", loaded_weight, (full_rows, *param.shape[1:]))
        copy_into(param.data.narrow(0, dst_offset, size), loaded_weight.narrow(0, src_start, size))


class RowParallelLinear(_Linear):
    """Input dim split across ranks: rank r holds columns ``[r*I/R, (r+1)*I/R)`` of W.

    forward: x [T, I/R] (this rank's slice, e.g. the output of a ColumnParallelLinear)
    -> [T, O]. With R > 1 the partial products are summed over ranks with
    ``torch.distributed.all_reduce`` when ``reduce_results``; otherwise each rank returns its
    partial sum and the caller reduces. The bias (full, ``[O]``, identical on every rank) is
    added by rank 0 only, so it appears exactly once in the sum.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 reduce_results: bool = True, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype | None = None) -> None:
        _check_positive(input_size=input_size, output_size=output_size)
        check_tp(tp_rank, tp_size)
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = divide(input_size, tp_size, what="input_size")
        self.reduce_results = reduce_results
        super().__init__(self.input_size_per_rank, output_size, bias, output_size, dtype, tp_rank, tp_size)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{param.label} is not fused; got shard_id={shard_id!r}")
        if param.dim() == 1:  # bias: replicated
            check_shape(param.label, loaded_weight, param.shape)
            copy_into(param.data, loaded_weight)
            return
        check_shape(param.label, loaded_weight, (self.output_size, self.input_size))
        start, size = shard_range(self.input_size, self.tp_rank, self.tp_size)
        copy_into(param.data, loaded_weight.narrow(1, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, I/R] -> [T, O]."""
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        out = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results:
            dist.all_reduce(out)
        return out
