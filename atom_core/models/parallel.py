"""The parallel context: which shard of a model this process holds, and over which process groups its
layers communicate.

A ``ParallelContext`` is built once (by the user, a framework that owns its groups, or the engine's
launcher) and passed to ``load_model(path, parallel=ctx)`` / ``build_model(config, parallel=ctx)``;
the model hands ``tp_rank`` / ``tp_size`` / ``tp_group`` to every layer that splits a weight, and the
layers reduce or gather through ``atom_core.ops`` (``all_reduce`` / ``all_gather``) over ``tp_group``,
never over ``torch.distributed``'s default group.

- **TP** (``tp_rank`` of ``tp_size`` in ``tp_group``): heads, MLP columns and the vocabulary are split;
  ``tp_rank`` is this process's rank in ``tp_group`` (the LM head gathers the vocabulary in that order).
- **EP** (``expert_parallel``): a MoE layer's experts are split, whole, over the same ``tp_group``
  instead of each expert's intermediate dim (``ep_group is tp_group``); attention and dense layers stay
  tensor-parallel. ``expert_parallel`` says how the ranks' experts combine (``ep_comm``): True or
  ``"all_reduce"`` — every rank runs its experts on all the (replicated) tokens and one all-reduce sums
  the partial outputs; ``"all_to_all"`` — each rank sends a slice of the tokens to the ranks holding
  their experts and gets the outputs back (``layers.expert_exchange``; docs/architecture.md, "expert
  parallelism: two exchanges").
- **DP** (``dp_rank`` of ``dp_size`` in ``dp_group``): replicas of the model; the model itself does not
  communicate over it (the engine's front balances requests across replicas).
- **DP attention** (``dp_attention=True``, with ``expert_parallel="all_to_all"`` and ``tp_size`` 1): ATOM's
  layout for MoE models. Attention and dense layers are whole on every rank, which computes them for its
  own tokens; a MoE layer's experts are split over ``dp_group`` (``ep_group``), and each rank sends its
  own tokens to the ranks holding their experts and gets their outputs back (``layers.expert_exchange``,
  ``tokens_replicated=False``). Every MoE layer is then a collective over the DP ranks: they must run
  their forwards in lock step, a rank without tokens running one on a padding token
  (docs/architecture.md, "DP attention").

``ParallelContext.single()`` (the default): one rank, no groups, and ``torch.distributed`` is never
touched. ``from_group(tp_group)`` wraps groups a framework already owns; ``from_world()`` builds the
groups over an initialized default world (the common ``torchrun`` / launcher case): the default group is
read there and in ``resolve_parallel`` (``load_model``'s ``tp_rank`` / ``tp_size`` convenience) only.

A context with ``tp_size > 1`` and no ``tp_group`` is a shard that cannot communicate: its weights and
sizes are those of rank ``tp_rank`` (to inspect a shard, or its memory, without processes), and a layer
that has to reduce raises ``MissingProcessGroupError`` naming itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from atom_core.models.layers.sharding import check_tp
from atom_core.ops import comm

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["EP_COMM_MODES", "MissingProcessGroupError", "ParallelContext", "check_group", "ep_comm_of", "reduce_over",
           "require_group", "resolve_parallel"]

EP_COMM_MODES = ("all_reduce", "all_to_all")  # how expert-parallel ranks combine their experts' outputs


def ep_comm_of(expert_parallel: bool | str) -> str | None:
    """``expert_parallel`` (False, True, ``"all_reduce"`` or ``"all_to_all"``) as the exchange it names: None
    (experts not split), ``"all_reduce"`` (True too) or ``"all_to_all"``. TypeError / ValueError otherwise."""
    if isinstance(expert_parallel, bool):
        return "all_reduce" if expert_parallel else None
    if not isinstance(expert_parallel, str):
        raise TypeError(f"expert_parallel must be a bool or one of {EP_COMM_MODES}, got {expert_parallel!r}")
    if expert_parallel not in EP_COMM_MODES:
        raise ValueError(f"expert_parallel must be a bool or one of {EP_COMM_MODES}, got {expert_parallel!r}")
    return expert_parallel


class MissingProcessGroupError(RuntimeError):
    """A layer split over several ranks has to communicate, but was built without a process group."""


def _check_rank(name: str, rank: int, size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{name}_size must be an int >= 1, got {size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        raise ValueError(f"{name}_rank must be an int in [0, {size}), got {rank!r}")


def check_group(group: ProcessGroup | None, rank: int, size: int, where: str, *, check_rank: bool = True) -> None:
    """Raise ValueError naming ``where`` unless ``group`` (when given) has ``size`` ranks and this process is
    its rank ``rank`` (``check_rank=False``: the size only)."""
    if group is None:
        return
    import torch.distributed as dist

    group_rank = dist.get_rank(group)
    if group_rank < 0:
        raise ValueError(f"{where}: this process is not a member of its process group")
    group_ranks = dist.get_world_size(group)
    if group_ranks != size:
        raise ValueError(f"{where}: its process group has {group_ranks} ranks, but it is split over {size}")
    if check_rank and group_rank != rank:
        raise ValueError(f"{where}: this process is rank {group_rank} of its process group, but holds shard {rank}: "
                         "a shard's rank must be its rank in the group")


def reduce_over(x: Tensor, group: ProcessGroup | None, size: int, where: object) -> Tensor:
    """``ops.all_reduce(x, group)`` for a layer split over ``size > 1`` ranks (``where``: the layer, named in
    the error); raise ``MissingProcessGroupError`` when it was built without a group."""
    if group is None:
        raise MissingProcessGroupError(_missing(where, size))
    return comm.all_reduce(x, group)


def require_group(group: ProcessGroup | None, size: int, where: object) -> ProcessGroup:
    """``group`` of a layer split over ``size > 1`` ranks; ``MissingProcessGroupError`` when it has none."""
    if group is None:
        raise MissingProcessGroupError(_missing(where, size))
    return group


def gather_over(x: Tensor, group: ProcessGroup | None, size: int, where: object, dim: int = -1) -> Tensor:
    """``ops.all_gather(x, group, dim)`` for a layer split over ``size > 1`` ranks (see ``reduce_over``)."""
    if group is None:
        raise MissingProcessGroupError(_missing(where, size))
    return comm.all_gather(x, group, dim)


def _missing(where: object, size: int) -> str:
    name = where if isinstance(where, str) else type(where).__name__
    prefix = getattr(where, "prefix", "")
    return (f"{name}{f' ({prefix})' if prefix else ''} is split over {size} ranks but was built without a process "
            "group, so it cannot combine its ranks' results: build the model with "
            "parallel=ParallelContext.from_group(tp_group) or ParallelContext.from_world() (atom_core.models.parallel), "
            "or give the layer its tp_group")


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in a parallel model (see the module docstring). Frozen; validated when built:
    ranks within their sizes, and a group given has the size stated, with this process at the rank stated."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: ProcessGroup | None = None
    expert_parallel: bool | str = False  # False, True (= "all_reduce"), "all_reduce" or "all_to_all"
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: ProcessGroup | None = None
    dp_attention: bool = False  # experts split over dp_group, each rank's own tokens exchanged (docstring)

    def __post_init__(self) -> None:
        check_tp(self.tp_rank, self.tp_size)
        _check_rank("dp", self.dp_rank, self.dp_size)
        ep_comm = ep_comm_of(self.expert_parallel)  # (raises for anything else)
        if self.dp_attention:
            if ep_comm != "all_to_all":
                raise ValueError("dp_attention splits the experts over the DP ranks, each sending its own tokens "
                                 f"to their experts: it needs expert_parallel='all_to_all', got {self.expert_parallel!r}")
            if self.tp_size != 1:
                raise ValueError(f"dp_attention over tensor-parallel groups (tp_size={self.tp_size}) is not built: "
                                 "each DP rank must hold the whole attention (tp_size=1)")
        check_group(self.tp_group, self.tp_rank, self.tp_size, "ParallelContext.tp_group")
        check_group(self.dp_group, self.dp_rank, self.dp_size, "ParallelContext.dp_group")

    # ---- constructors ------------------------------------------------------------------------------------------

    @classmethod
    def single(cls) -> ParallelContext:
        """One rank, no groups; ``torch.distributed`` is not touched."""
        return cls()

    @classmethod
    def from_group(cls, tp_group: ProcessGroup, *, expert_parallel: bool | str = False,
                   dp_group: ProcessGroup | None = None) -> ParallelContext:
        """The context of groups a framework owns: this process's rank and size in ``tp_group`` (and
        ``dp_group``), read from them."""
        import torch.distributed as dist

        dp = {} if dp_group is None else {"dp_rank": dist.get_rank(dp_group), "dp_size": dist.get_world_size(dp_group),
                                          "dp_group": dp_group}
        return cls(tp_rank=dist.get_rank(tp_group), tp_size=dist.get_world_size(tp_group), tp_group=tp_group,
                   expert_parallel=expert_parallel, **dp)

    @classmethod
    def from_world(cls, *, tensor_parallel_size: int | None = None, expert_parallel: bool | str = False,
                   dp_attention: bool = False) -> ParallelContext:
        """Split an initialized default world of W ranks into W / tp replicas of ``tensor_parallel_size`` (default
        W) ranks: TP group d is ranks ``[d * tp, (d + 1) * tp)``, DP group t the ranks ``t, t + tp, ...``. Every
        rank must call it (creating a group is collective). With tp = W the TP group is the world group itself
        (no new communicator); a DP group is made only when W > tp. ``dp_attention``: W DP ranks of one rank
        each (tp 1, the default then), the experts split over the world group (see the module docstring)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ParallelContext.from_world needs an initialized default process group "
                               "(torch.distributed.init_process_group, or torchrun); one process needs none: "
                               "ParallelContext.single()")
        world, rank = dist.get_world_size(), dist.get_rank()
        if dp_attention:
            if tensor_parallel_size not in (None, 1):
                raise ValueError(f"dp_attention over tensor-parallel groups (tensor_parallel_size="
                                 f"{tensor_parallel_size}) is not built: use tensor_parallel_size=1")
            return cls(dp_rank=rank, dp_size=world, dp_group=dist.group.WORLD, expert_parallel=expert_parallel,
                       dp_attention=True)
        tp = world if tensor_parallel_size is None else tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or world % tp:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r} must divide the world size {world}")
        dp = world // tp
        if dp == 1:
            return cls(tp_rank=rank, tp_size=tp, tp_group=dist.group.WORLD, expert_parallel=expert_parallel)
        tp_group = dp_group = None
        for d in range(dp):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(d * tp, (d + 1) * tp)))
            if rank // tp == d:
                tp_group = group
        for t in range(tp):
            group = dist.new_group(list(range(t, world, tp)))
            if rank % tp == t:
                dp_group = group
        return cls(tp_rank=rank % tp, tp_size=tp, tp_group=tp_group, expert_parallel=expert_parallel,
                   dp_rank=rank // tp, dp_size=dp, dp_group=dp_group)

    # ---- derived -----------------------------------------------------------------------------------------------

    @property
    def is_single(self) -> bool:
        """One TP rank and one replica: nothing is split and nothing communicates."""
        return self.tp_size == 1 and self.dp_size == 1

    @property
    def ep_size(self) -> int:
        """Ranks a MoE layer's experts are split over: ``tp_size`` with ``expert_parallel`` (``dp_size`` with
        ``dp_attention``), else 1."""
        if self.dp_attention:
            return self.dp_size
        return self.tp_size if self.expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        if self.dp_attention:
            return self.dp_rank
        return self.tp_rank if self.expert_parallel else 0

    @property
    def ep_comm(self) -> str | None:
        """How the experts' ranks combine: ``"all_reduce"``, ``"all_to_all"``, or None when they are not split."""
        return ep_comm_of(self.expert_parallel)

    @property
    def ep_group(self) -> ProcessGroup | None:
        """The group the experts are split over (the TP group; the DP group with ``dp_attention``) with
        ``expert_parallel``, else None."""
        if self.dp_attention:
            return self.dp_group
        return self.tp_group if self.expert_parallel else None

    def describe(self) -> str:
        parts = [f"tp {self.tp_rank}/{self.tp_size}"]
        if self.expert_parallel:
            parts.append("experts split over the tp ranks"
                         + (" (all-to-all)" if self.ep_comm == "all_to_all" else ""))
        if self.dp_size > 1:
            parts.append(f"dp {self.dp_rank}/{self.dp_size}")
        if self.dp_attention:
            parts = [f"dp {self.dp_rank}/{self.dp_size}", "attention data-parallel, experts split over the dp ranks "
                     "(all-to-all of each rank's own tokens)"]
        if self.tp_size > 1 and self.tp_group is None:
            parts.append("no process group")
        return ", ".join(parts)


def resolve_parallel(parallel: ParallelContext | None, tp_rank: int = 0, tp_size: int = 1,
                     expert_parallel: bool | str = False) -> ParallelContext:
    """``load_model`` / ``build_model``'s context: ``parallel`` when given (then the convenience arguments must
    keep their defaults), else one built from the convenience arguments ``tp_rank`` / ``tp_size`` /
    ``expert_parallel``: single-rank for (0, 1); for ``tp_size > 1`` the TP group is the default world group,
    which must then hold exactly ``tp_size`` ranks with this process at ``tp_rank`` (the only place a model
    reads the default group); without an initialized default group, a shard that cannot communicate."""
    convenience = (tp_rank, tp_size) != (0, 1) or ep_comm_of(expert_parallel) is not None
    if parallel is not None:
        if not isinstance(parallel, ParallelContext):
            raise TypeError(f"parallel must be a ParallelContext, got {type(parallel).__name__}")
        if convenience:
            raise ValueError("pass either parallel= or tp_rank / tp_size / expert_parallel, not both "
                             f"(got parallel={parallel.describe()!r} and tp_rank={tp_rank}, tp_size={tp_size}, "
                             f"expert_parallel={expert_parallel})")
        return parallel
    check_tp(tp_rank, tp_size)
    if tp_size == 1:
        return ParallelContext(expert_parallel=expert_parallel)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ParallelContext(tp_rank=tp_rank, tp_size=tp_size, expert_parallel=expert_parallel)
    world, rank = dist.get_world_size(), dist.get_rank()
    if (world, rank) != (tp_size, tp_rank):
        raise ValueError(
            f"tp_rank={tp_rank}, tp_size={tp_size} split the model over the default process group, but this process "
            f"is rank {rank} of {world} there; pass parallel=ParallelContext.from_world(tensor_parallel_size=...) "
            "or ParallelContext.from_group(your_group)")
    return ParallelContext(tp_rank=tp_rank, tp_size=tp_size, tp_group=dist.group.WORLD,
                           expert_parallel=expert_parallel)
