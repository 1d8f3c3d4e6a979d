"""DP attention in the engine: the replicas of a ``DataParallelEngine(..., dp_attention=True)`` are the DP
ranks of one world, each holding the whole attention and 1/M of every MoE layer's experts
(``ParallelContext(dp_attention=True)``, ``models.parallel``).

Legend: M = DP ranks (replicas), r = this replica's rank.

Every MoE layer exchanges the ranks' tokens (an all-to-all over the world), so the M ranks must run their
forwards in lock step, whatever work each has. Before each step the ranks agree, with one all-reduce (MAX)
of [has work, leaving, loading] over a gloo group of their own (``LockStep.agree``): nobody works → nobody
steps; somebody works → every rank runs exactly one forward, its own step or, with no sequences, a forward of
one padding token that touches no KV slot and samples nothing (``ModelRunner.idle_forward``); somebody leaves
(the front's shutdown) → every rank leaves; somebody was told to load new weights
(``DataParallelEngine.load_weights``) → every rank loads them, outside any collective. What differs per rank
(its sequences, its pool, its sampling) stays its own, as in a replica.

What this layout costs and does not do yet (docs/architecture.md, "DP attention"): each step waits for the
slowest rank; the steps run eagerly and without async scheduling (the exact exchange reads its row counts
on the host, which neither a CUDA graph nor a launch-ahead step can hold); one world, so a rank that dies
stops every rank (the others' collectives fail, within the world's ``timeout``). Attention over
tensor-parallel groups (tp > 1 per DP rank) is not built.
"""

from __future__ import annotations

import datetime
import socket

import torch

from atom_core.models.parallel import ParallelContext

__all__ = ["LockStep", "join_world", "new_world"]

IDLE_WAIT_S = 0.02  # how long a rank waits for the front's next command between agreements while nobody works


def new_world(size: int) -> dict:
    """The spec of a world of ``size`` replicas the front starts (each joins it with ``join_world``, its
    ``"rank"`` added): a rendezvous on a loopback TCP port no process listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return {"size": size, "init_method": f"tcp://127.0.0.1:{probe.getsockname()[1]}"}


def join_world(spec: dict, device_type: str, timeout_s: float) -> tuple[ParallelContext, LockStep]:
    """Join the replicas' world as rank ``spec["rank"]`` of ``spec["size"]`` (``spec["init_method"]``: the
    rendezvous the front chose; NCCL on GPUs, gloo on the CPU; every collective bounded by ``timeout_s``)
    and make the gloo group the ranks agree over. Returns the model's parallel context and the lock step."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device_type == "cuda" else "gloo"
    extra = {"device_id": torch.device("cuda", 0)} if device_type == "cuda" else {}  # the replica's one GPU
    dist.init_process_group(backend, init_method=spec["init_method"], rank=spec["rank"], world_size=spec["size"],
                            timeout=timeout, **extra)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return ParallelContext.from_world(expert_parallel="all_to_all", dp_attention=True), LockStep(control)


class LockStep:
    """The ranks' agreement before each step (see the module docstring)."""

    def __init__(self, group) -> None:
        self.group = group
        self.idle_forwards = 0  # forwards of a padding token run for the peers' sake

    def agree(self, busy: bool, leaving: bool, loading: bool) -> tuple[bool, bool, bool]:
        """(does any rank have work, is any rank leaving, has any rank been told to load new weights): every
        rank calls it once per round."""
        import torch.distributed as dist

        flags = torch.tensor([int(busy), int(leaving), int(loading)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1]), bool(flags[2])

    def idle(self, engine) -> None:
        """This rank's forward in a step where it has no sequences."""
        engine.runner.idle_forward()
        self.idle_forwards += 1

    @staticmethod
    def close() -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
