"""Communication ops: ``all_reduce``, ``all_gather`` and ``all_to_all`` over a process group passed in.

Legend: R = ranks in the group, N = rows (dim 0) of this rank's input, r = this rank's place in the group.

Every op takes the group as an argument and never reads ``torch.distributed``'s default group.
``group=None`` means one rank: the backend returns the input itself (``all_to_all``: whose one split
is N) without touching ``torch.distributed`` at all, so a single-process model needs no process group,
and no ``import torch.distributed`` is made on that path. (Every backend serves ``group=None`` this
way; the selftest checks it.)

- ``all_reduce(x, group)``: the elementwise sum of ``x`` over the group's ranks. ``x`` is *donated*:
  NCCL computes the sum in place in ``x`` (no copy) and returns ``x``; the one-shot path (below) and
  ``torch.compile`` return a new tensor. Always use the return value, and do not read ``x``
  afterwards (the same contract as vLLM's ``tensor_model_parallel_all_reduce``).
- ``all_gather(x, group, dim=-1)``: the ranks' ``x`` (equal shapes) concatenated along ``dim`` in
  group-rank order (rank r's piece at ``[r * x.shape[dim], (r + 1) * x.shape[dim])``); a new tensor.
- ``all_to_all(x, group, output_split_sizes=None, input_split_sizes=None)``: rows
  ``[sum(input_split_sizes[:j]), sum(input_split_sizes[:j + 1]))`` of ``x`` go to rank j; the output
  holds, in group-rank order, the ``output_split_sizes[j]`` rows rank j sent here (None: ``N / R``
  rows each way). The splits are host ints every rank agrees on (rank j's ``input_split_sizes[r]`` ==
  rank r's ``output_split_sizes[j]``): expert-parallel dispatch first exchanges the per-rank token
  counts (an equal-split ``all_to_all`` of a [R] count tensor, then ``.tolist()``), then the rows.

**Backends.** Each op is an ``Op`` (``atom_core.ops.dispatch``) with one backend today, ``torch``: the
``torch.distributed`` collective itself (NCCL on GPUs, gloo on CPUs) is the reference. A faster
backend (a one-shot all-reduce for small messages, AITER's custom all-reduce) registers beside it
later; it must make the SAME choice on every rank of a group (a rank running NCCL while its peer runs
a custom kernel deadlocks), so its ``supports`` rule may read only what every rank shares (shape,
dtype, group size), and the one-process selftest (``selftest_cases_comm``: the single-rank contract)
cannot verify it: a multi-rank test must.

**torch.compile.** Each op is also ``torch.ops.atom_core.{all_reduce, all_gather, all_to_all}``, a
functional custom op taking the group by name (``group.group_name``; a ``ProcessGroup`` is not a
custom-op argument type) and resolving it at run time, so a compiled model keeps each collective as
one opaque node (``fullgraph=True`` holds). The public functions call it only while tracing; eagerly
they call the backend directly.

**CUDA graphs.** NCCL collectives are capturable, and ``torch.distributed``'s NCCL process group
supports capture since torch 2.1 (captured work is kept out of its watchdog, pytorch#103503, and
capture begins only once the watchdog's outstanding eager work is done, pytorch#104487). What torch
needs: the group's NCCL communicator must exist before capture (NCCL creates it lazily on the group's
first collective, and creating it is not capturable: run one collective on the group, e.g. a warm-up
step, before capturing, or pass ``device_id`` to ``init_process_group`` for eager creation); every
rank captures and replays the same sequence of collectives with the same shapes (the graphs are
replayed in lock step, one per batch size); the tensors are allocated inside the capture (the graph's
memory pool), which the ops do.
An ``all_to_all`` with host split sizes is captured with those sizes fixed: only a fixed-split
exchange is graph-safe. gloo (CPU) has no graphs.

**Expert parallelism** (``models/layers/expert_exchange.py``) is the ``all_to_all`` user: an equal-split
exchange of the per-rank row counts (int64 [R]) read on the host, then the rows with those splits (the
*exact* exchange: a host sync, not capturable), or rows at a fixed capacity per peer with equal splits
(the *padded* exchange: no host sync, captured inside the engine's CUDA graphs). The rows carry int32
expert ids and fp32 weights as raw bits in their last columns: every backend must move bytes unchanged
(NaN patterns included), which NCCL and gloo do. gloo serves ``all_to_all_single`` on CPU tensors of
every dtype used here (bf16, fp16, fp32, int32, int64) and empty splits, so no send/recv fallback is needed.

**One-shot all-reduce for small messages.** ``enable_one_shot_all_reduce(group, dtype, device)`` (collective:
every rank of the group calls it) gives a CUDA group a buffer in torch's symmetric memory
(``torch.distributed._symmetric_memory``: every rank maps its peers' buffers over NVLink). From then on the
``torch`` backend sums a contiguous bf16 / fp32 ``x`` of that dtype and at most ``one_shot_max_bytes(R)``
with ``torch.ops.symm_mem.one_shot_all_reduce_copy_out``: ``x`` is copied into this rank's buffer, the ranks
meet at a barrier, and each reads every peer's buffer and writes the sum into a new tensor (returned; ``x``
is left as it was). One kernel, no ring: on two H200s 6.7 µs against NCCL's 14.9 µs at 8 KiB, 21.8 against
39.5 µs at 2 MiB, inside CUDA graphs (``benchmarks/comm.py``, ``one_shot_us``). Everything else (larger
messages, other dtypes, CPU groups, groups never enabled) stays on ``torch.distributed.all_reduce``.
The choice reads only the group's registration, ``x``'s dtype, size, contiguity and storage offset: the
same on every rank of a group running the same program. It is capturable (the barrier's signals live in
the symmetric memory, not on the host). ``disable_one_shot_all_reduce(group)`` (the engine's shutdown, after
its graphs are released) drops the buffer. The engine enables it for its TP group on CUDA (``StepChannel``;
only where every rank's environment says ``ATOM_CORE_ONE_SHOT_ALL_REDUCE=1``: NCCL stays the default).
Torch keeps symmetric memory's per-group state for the life of the process under the group's name, and
groups made after ``destroy_process_group`` reuse earlier names: a group whose name this process already
set up symmetric memory under stays on NCCL (a second multi-rank engine in one process).
"""

# R ranks in the group, N rows of this rank's input

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op
from atom_core.ops.validation import check_tensor, debug_enabled

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["all_gather", "all_reduce", "all_to_all", "disable_one_shot_all_reduce", "enable_one_shot_all_reduce",
           "group_size", "one_shot_max_bytes"]

logger = logging.getLogger(__name__)

ALL_REDUCE = Op("all_reduce")
ALL_GATHER = Op("all_gather")
ALL_TO_ALL = Op("all_to_all")


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 for None, without touching ``torch.distributed``)."""
    return 1 if group is None else group.size()


# ---- the torch backend: torch.distributed's collectives ---------------------------------------------------------

def _torch_all_reduce(x: Tensor, group) -> Tensor:
    if group is None:
        return x
    one_shot = _ONE_SHOT.get(group.group_name)
    if one_shot is not None and one_shot.group is group and one_shot.serves(x):
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(one_shot.buffer[:x.numel()].view_as(x), x, "sum",
                                                        group.group_name, out)
        return out
    import torch.distributed as dist

    dist.all_reduce(x, group=group)
    return x


def _torch_all_gather(x: Tensor, group, dim: int) -> Tensor:
    if group is None:
        return x
    import torch.distributed as dist

    ranks = group.size()
    x = x.contiguous()
    stacked = x.new_empty((ranks * x.shape[0], *x.shape[1:]))               # [R * N, ...]: rank r at rows r * N
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the new name since 2.13)
    gather(stacked, x, group=group)
    if dim == 0:
        return stacked
    # [R, ..., x.shape[dim], ...] -> rank r's piece at [r * n, (r + 1) * n) of dim
    pieces = stacked.view(ranks, *x.shape).movedim(0, dim)
    return pieces.reshape(*x.shape[:dim], ranks * x.shape[dim], *x.shape[dim + 1:])


def _torch_all_to_all(x: Tensor, group, output_split_sizes, input_split_sizes) -> Tensor:
    if group is None:
        return x
    import torch.distributed as dist

    rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
    return out


# ---- the one-shot all-reduce over symmetric memory (see the module docstring) ------------------------------------

ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # what torch's one-shot kernel sums


def one_shot_max_bytes(ranks: int) -> int:
    """The largest message the one-shot path takes over a group of ``ranks``. Two: 2 MiB, where it still beat
    NCCL on two H200s (1.8x; measured up to there). More ranks read R - 1 peer buffers per element: 256 KiB,
    torch's own one-shot limit for intra-node all-reduce, until measured."""
    return 2 * 2**20 if ranks == 2 else 256 * 2**10


@dataclass(frozen=True)
class _OneShot:
    buffer: Tensor  # this rank's symmetric buffer, flat, of the enabled dtype
    group: ProcessGroup  # the group it was set up for (a later group may carry the same name)

    def serves(self, x: Tensor) -> bool:
        # Facts every rank of the group shares (a rank choosing NCCL while its peer waits at the one-shot
        # barrier would hang both): dtype, size, contiguity, the 16-byte alignment of the storage offset.
        return (x.dtype == self.buffer.dtype and 0 < x.numel() <= self.buffer.numel() and x.is_contiguous()
                and x.storage_offset() * x.element_size() % 16 == 0)


_ONE_SHOT: dict[str, _OneShot] = {}  # by group name
_SYMMETRIC_NAMES: set[str] = set()  # group names this process has set up symmetric memory under


def enable_one_shot_all_reduce(group: ProcessGroup | None, dtype: torch.dtype, device, want: bool = True) -> bool:
    """Let ``all_reduce`` over ``group`` sum small ``dtype`` messages with the one-shot kernel (module docstring).

    Collective: every rank of ``group`` calls it with the same ``dtype``; ``want`` is each rank's wish (any
    rank's False keeps NCCL for all). Returns whether it is on. It is not (and no collective runs) for one
    rank, a CPU group or another dtype than bf16 / fp32. Otherwise the ranks first agree, and only then meet
    in torch's rendezvous (a rank waiting there for a peer that never comes would hang): each rank says
    whether it could allocate its buffer and whether its process never set up symmetric memory under the
    group's name before. (Torch keeps that state per group name for the life of the process, and a group
    made after ``destroy_process_group`` reuses an earlier group's name: a second multi-rank engine in one
    process hung in the rendezvous. Such a group stays on NCCL.) Idempotent per group."""
    if group is None or group.size() == 1 or torch.device(device).type != "cuda" or dtype not in ONE_SHOT_DTYPES:
        return False
    name = group.group_name
    entry = _ONE_SHOT.get(name)
    if entry is not None:
        if entry.group is group:
            return True
        del _ONE_SHOT[name]  # a destroyed group's, never disabled: its name stays on NCCL (below)
    import torch.distributed as dist

    buffer, reason = None, "not wanted"
    if name in _SYMMETRIC_NAMES:
        reason = f"this process set up symmetric memory under the group name {name!r} before"
    elif want:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            element_size = torch.empty((), dtype=dtype).element_size()
            buffer = symm_mem.empty(one_shot_max_bytes(group.size()) // element_size, dtype=dtype, device=device)
        except Exception as e:  # noqa: BLE001 - a torch build or machine without it: NCCL serves every message
            reason = f"{type(e).__name__}: {e}"
    agreed = torch.tensor([int(buffer is not None)], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not agreed.item():
        logger.info("one-shot all-reduce off for group %s (%s)", name,
                    reason if buffer is None else "another rank could not set it up")
        return False
    _SYMMETRIC_NAMES.add(name)
    symm_mem.rendezvous(buffer, name)
    _ONE_SHOT[name] = _OneShot(buffer, group)
    return True


def disable_one_shot_all_reduce(group: ProcessGroup | None) -> None:
    """Send ``group``'s messages back to NCCL and drop its symmetric buffer (no-op where not enabled)."""
    if group is not None and getattr(_ONE_SHOT.get(group.group_name), "group", None) is group:
        del _ONE_SHOT[group.group_name]


ALL_REDUCE.register("torch", _torch_all_reduce)
ALL_GATHER.register("torch", _torch_all_gather)
ALL_TO_ALL.register("torch", _torch_all_to_all)


# ---- custom ops (what torch.compile traces): functional, the group by name ---------------------------------------

def _group_named(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@torch.library.custom_op("atom_core::all_reduce", mutates_args=())
def _all_reduce_op(x: Tensor, group_name: str, backend: str | None) -> Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # functional: the input stays as it was
    return ALL_REDUCE(out, _group_named(group_name), backend=backend)


@_all_reduce_op.register_fake
def _(x, group_name, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("atom_core::all_gather", mutates_args=())
def _all_gather_op(x: Tensor, group_name: str, group_ranks: int, dim: int, backend: str | None) -> Tensor:
    return ALL_GATHER(x, _group_named(group_name), dim, backend=backend).clone()  # (a view when dim != 0)


@_all_gather_op.register_fake
def _(x, group_name, group_ranks, dim, backend):
    shape = list(x.shape)
    shape[dim] *= group_ranks
    return x.new_empty(shape)


@torch.library.custom_op("atom_core::all_to_all", mutates_args=())
def _all_to_all_op(x: Tensor, group_name: str, output_split_sizes: list[int] | None,
                   input_split_sizes: list[int] | None, backend: str | None) -> Tensor:
    return ALL_TO_ALL(x, _group_named(group_name), output_split_sizes, input_split_sizes, backend=backend)


@_all_to_all_op.register_fake
def _(x, group_name, output_split_sizes, input_split_sizes, backend):
    rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    return x.new_empty((rows, *x.shape[1:]))


# ---- public ops ---------------------------------------------------------------------------------------------------

def all_reduce(x: Tensor, group: ProcessGroup | None, *, backend: str | None = None) -> Tensor:
    """Sum of ``x`` (any shape and float dtype) over ``group``'s ranks; ``group=None``: one rank, ``x`` itself.

    ``x`` is donated (see the module docstring): eagerly the sum is written into ``x`` (made contiguous
    first if it is not) and returned; use the return value.
    """
    if debug_enabled():
        check_tensor("x", x)
    if torch.compiler.is_compiling():
        return x if group is None else torch.ops.atom_core.all_reduce(x, group.group_name, backend)
    return ALL_REDUCE(x if group is None or x.is_contiguous() else x.contiguous(), group, backend=backend)


def all_gather(x: Tensor, group: ProcessGroup | None, dim: int = -1, *, backend: str | None = None) -> Tensor:
    """The group's ``x`` (same shape on every rank) concatenated along ``dim`` in group-rank order:
    ``x.shape[dim] * R`` there, other dims unchanged; ``group=None``: ``x`` itself."""
    if debug_enabled():
        check_tensor("x", x)
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim={dim} is out of range for x of shape {tuple(x.shape)}")
    dim = dim % x.dim()
    if torch.compiler.is_compiling():
        return x if group is None else torch.ops.atom_core.all_gather(x, group.group_name, group.size(), dim, backend)
    return ALL_GATHER(x, group, dim, backend=backend)


def all_to_all(x: Tensor, group: ProcessGroup | None, output_split_sizes: Sequence[int] | None = None,
               input_split_sizes: Sequence[int] | None = None, *, backend: str | None = None) -> Tensor:
    """Rows of ``x`` [N, ...] exchanged over ``group``: ``input_split_sizes[j]`` consecutive rows to rank j, and
    back ``[sum(output_split_sizes), ...]``, rank j's rows at ``sum(output_split_sizes[:j])`` (None: equal
    splits, ``N / R`` rows each way). ``group=None``: one rank, ``x`` itself (splits, if given, must be ``[N]``)."""
    output_split_sizes = None if output_split_sizes is None else [int(s) for s in output_split_sizes]
    input_split_sizes = None if input_split_sizes is None else [int(s) for s in input_split_sizes]
    if debug_enabled():
        _check_all_to_all_args(x, group, output_split_sizes, input_split_sizes)
    if torch.compiler.is_compiling():
        return x if group is None else torch.ops.atom_core.all_to_all(x, group.group_name, output_split_sizes,
                                                                       input_split_sizes, backend)
    return ALL_TO_ALL(x, group, output_split_sizes, input_split_sizes, backend=backend)


def _check_all_to_all_args(x, group, output_split_sizes, input_split_sizes) -> None:
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("all_to_all exchanges rows: x must have at least one dim")
    ranks = group_size(group)
    for name, splits in (("output_split_sizes", output_split_sizes), ("input_split_sizes", input_split_sizes)):
        if splits is not None and (len(splits) != ranks or any(s < 0 for s in splits)):
            raise ValueError(f"{name} must hold {ranks} sizes >= 0 (one per rank of the group), got {splits}")
    if input_split_sizes is not None and sum(input_split_sizes) != x.shape[0]:
        raise ValueError(f"input_split_sizes {input_split_sizes} sum to {sum(input_split_sizes)}, x has {x.shape[0]} rows")
    if input_split_sizes is None and x.shape[0] % ranks:
        raise ValueError(f"equal splits: x's {x.shape[0]} rows do not divide over {ranks} ranks")
    if group is None and output_split_sizes is not None and output_split_sizes != [x.shape[0]]:
        raise ValueError(f"one rank receives its own {x.shape[0]} rows, got output_split_sizes {output_split_sizes}")
