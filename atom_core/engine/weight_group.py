"""A weight-update group: the trainer's rank 0 and every rank of an inference engine in one extra process
group, so that the trainer broadcasts each parameter straight to the engine's devices (NCCL on GPUs, gloo
on the CPU) — the pattern of vLLM's RLHF example and SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``.

``WeightUpdateGroup`` is one process's membership. It is built on its own ``TCPStore`` (under a
``PrefixStore`` named after the group) and a backend object made directly on it, never through
``torch.distributed``'s default group: the engine's tensor-parallel ranks already use that one, and a
trainer has its own. The trainer joins as rank 0 with the same class; the engine's ranks join as
``rank_offset + tp_rank`` (``Engine.init_weight_update_group``).

This module also holds what every engine rank does with its member: the checks of the arguments (before
any collective), the rounds of the tensors to receive, and joining / closing on every TP rank together
(rank 0 tells its workers over the control channel, ``WEIGHT_GROUP`` messages).
"""

from __future__ import annotations

import datetime
import numbers
import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from atom_core.engine import weight_sync
from atom_core.engine.distributed import WEIGHT_GROUP

if TYPE_CHECKING:
    from atom_core.engine.distributed import StepChannel

__all__ = ["DEFAULT_TIMEOUT", "WeightGroupWorker", "WeightUpdateGroup", "check_src", "close_all", "default_backend",
           "group_args", "join_all", "plan_rounds", "tensor_specs"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # each wait of a member: joining, and every broadcast
BACKENDS = ("nccl", "gloo")
TensorSpec = tuple[str, tuple[int, ...], torch.dtype]  # (name, shape, dtype) of one tensor to receive


def default_backend(device: torch.device) -> str:
    """The group's backend for a member whose tensors live on ``device``: "nccl" on CUDA, "gloo" elsewhere."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class WeightUpdateGroup:
    """One process's membership in a weight-update group (``world_size`` members; rank 0 hosts the store).

    The trainer side, rank 0, broadcasting its parameters in the order the engine was given their names::

        group = WeightUpdateGroup("10.0.0.1", 29600, rank=0, world_size=1 + engine_tp_size, backend="nccl",
                                  device=torch.device("cuda", 0))
        for name, param in policy.named_parameters():   # while the engine's update_weights_from_distributed runs
            group.broadcast(param.data, src=0)
        group.close()

    Args:
        master_address, master_port: where rank 0 opens the group's ``TCPStore`` (the others connect there).
        rank, world_size: this member's rank in the group and the group's size.
        backend: "nccl" (tensors on ``device``, a CUDA device) or "gloo" (CPU tensors).
        device: this member's CUDA device for "nccl" (default: the current one); unused for "gloo".
        group_name: the store's key prefix (two groups on one store stay apart).
        timeout: the longest a member waits for the others, when joining and in each broadcast
            (a ``timedelta`` or seconds).

    With gloo, joining blocks until every member has joined (or ``timeout`` passes: an error); with NCCL it
    only connects to the store, and the communicator is made at the first broadcast, by every member.
    """

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, *,
                 backend: str = "gloo", device: torch.device | str | None = None,
                 group_name: str = "weight_update",
                 timeout: datetime.timedelta | float = DEFAULT_TIMEOUT):
        import torch.distributed as dist

        check_address(master_address, master_port)
        check_int("world_size", world_size, 1)
        check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank must be below world_size={world_size}, got {rank}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"group_name must be a non-empty string, got {group_name!r}")
        timeout = as_timedelta(timeout)
        self.rank, self.world_size, self.backend, self.group_name = rank, world_size, backend, group_name
        self.device = _member_device(backend, device)
        # wait_for_workers=False: the store's host returns at once; the group's own join waits for everyone.
        self._store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0),
                                    timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(group_name, self._store)
        self._group = _nccl_group(store, rank, world_size, timeout) if backend == "nccl" else \
            dist.ProcessGroupGloo(store, rank, world_size, timeout)

    @property
    def closed(self) -> bool:
        return self._group is None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """``src``'s ``tensor`` into every member's tensor of the same shape and dtype, in place; waits for it
        (on a GPU: the current stream waits for NCCL's). ``tensor`` is contiguous, on this member's device; any
        dtype (over gloo, float8 crosses as its bytes)."""
        import torch.distributed as dist

        if self._group is None:
            raise RuntimeError(f"weight-update group {self.group_name!r} is closed")
        if self.backend == "gloo" and tensor.is_floating_point() and tensor.element_size() == 1:
            tensor = tensor.view(torch.uint8)  # gloo has no float8 types: their bytes cross (on every member alike)
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        self._group.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Leave the group (this member's communicator shut down, the store released). Idempotent."""
        group, self._group, self._store = self._group, None, None
        if group is not None:
            group.shutdown()


def _member_device(backend: str, device) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"backend 'nccl' broadcasts CUDA tensors: device must be a CUDA device, got {device}")
    return device


def _nccl_group(store, rank: int, world_size: int, timeout: datetime.timedelta):
    """A ``ProcessGroupNCCL`` on ``store`` (its communicator is made at the first broadcast, on the device of
    the tensor)."""
    from torch.distributed import distributed_c10d

    nccl = getattr(distributed_c10d, "ProcessGroupNCCL", None)
    if nccl is None:
        raise ValueError("backend 'nccl': this torch build has no NCCL (a CPU build?): use backend='gloo'")
    options = nccl.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    return nccl(store, rank, world_size, options)


# ---- argument checks (before any collective) ---------------------------------------------------------------------

def check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_address(master_address, master_port) -> None:
    if not isinstance(master_address, str) or not master_address:
        raise ValueError(f"master_address must be a host name or address, got {master_address!r}")
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise ValueError(f"master_port must be an int from 1 to 65535, got {master_port!r}")


def as_timedelta(timeout) -> datetime.timedelta:
    """``timeout`` (a ``timedelta`` or seconds > 0) as a ``timedelta``; ValueError naming it otherwise."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"timeout must be a timedelta or a number of seconds > 0, got {timeout!r}")
    return datetime.timedelta(seconds=seconds)


def group_args(master_address: str, master_port: int, rank_offset: int, world_size: int, *, backend: str | None,
               group_name: str, timeout, tp_size: int, device: torch.device) -> dict:
    """``Engine.init_weight_update_group``'s arguments checked (ValueError naming the first one that makes no
    sense) and completed: the message every engine rank joins with (``join``)."""
    check_address(master_address, master_port)
    check_int("rank_offset", rank_offset, 0)
    check_int("world_size", world_size, tp_size + 1)  # the engine's ranks and at least one sender
    if rank_offset + tp_size > world_size:
        raise ValueError(f"rank_offset={rank_offset} + the engine's {tp_size} ranks do not fit in world_size="
                         f"{world_size}")
    backend = default_backend(device) if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None (nccl on CUDA, gloo on the CPU) or one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and torch.device(device).type != "cuda":
        raise ValueError(f"backend 'nccl' needs the engine on CUDA; it runs on {device}: use backend='gloo'")
    if not isinstance(group_name, str) or not group_name:
        raise ValueError(f"group_name must be a non-empty string, got {group_name!r}")
    return dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                world_size=world_size, backend=backend, group_name=group_name, timeout=as_timedelta(timeout))


def check_src(src: int, member: WeightUpdateGroup, tp_size: int) -> None:
    """``src`` must be a rank of the group other than the engine's own (``member.rank`` onwards)."""
    check_int("src", src, 0)
    if src >= member.world_size or member.rank <= src < member.rank + tp_size:
        raise ValueError(f"src must be a rank of group {member.group_name!r} outside the engine's ranks "
                         f"{member.rank}..{member.rank + tp_size - 1} (the trainer's), got {src} of "
                         f"world_size={member.world_size}")


def tensor_specs(names: Sequence[str], dtypes: Sequence, shapes: Sequence[Sequence[int]]) -> list[TensorSpec]:
    """The ``(name, shape, dtype)`` of each tensor ``update_weights_from_distributed`` receives, checked:
    three lists of one length, names non-empty strings, dtypes ``torch.dtype`` or their names ("bfloat16",
    "torch.bfloat16"), shapes sequences of ints >= 0. ValueError naming the first problem otherwise."""
    lists = {"names": names, "dtypes": dtypes, "shapes": shapes}
    for what, value in lists.items():
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes must have one length, got {len(names)}, {len(dtypes)} and "
                         f"{len(shapes)}")
    specs = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"names[{i}] must be a non-empty string, got {name!r}")
        specs.append((name, _shape(i, name, shape), _dtype(i, name, dtype)))
    return specs


def _dtype(i: int, name: str, dtype) -> torch.dtype:
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    elif isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"dtypes[{i}] (tensor {name!r}) must be a torch dtype or its name such as 'bfloat16', "
                     f"got {dtype!r}")


def _shape(i: int, name: str, shape) -> tuple[int, ...]:
    if isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)) and all(
            isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 0 for n in shape):
        return tuple(int(n) for n in shape)
    raise ValueError(f"shapes[{i}] (tensor {name!r}) must be a list of ints >= 0, got {shape!r}")


def plan_rounds(specs: list[TensorSpec]) -> list[list[TensorSpec]]:
    """``specs`` cut into rounds of about ``weight_sync.BATCH_BYTES`` of full tensors (at least one tensor a
    round), as ``weight_sync.next_batch`` cuts a stream of pairs: no rank holds more at once."""
    remaining, rounds = iter(specs), []
    while batch := weight_sync.take_round(remaining, lambda spec: torch.Size(spec[1]).numel() * spec[2].itemsize):
        rounds.append(batch)
    return rounds


# ---- every engine rank together -----------------------------------------------------------------------------------

def join(args: dict, tp_rank: int, device: torch.device) -> WeightUpdateGroup:
    """This engine rank's member of the group ``args`` describe (``join_all``'s message)."""
    return WeightUpdateGroup(args["master_address"], args["master_port"], args["rank_offset"] + tp_rank,
                             args["world_size"], backend=args["backend"], device=device,
                             group_name=args["group_name"], timeout=args["timeout"])


def join_all(channel: StepChannel | None, args: dict, device: torch.device) -> WeightUpdateGroup:
    """Rank 0: every engine rank joins the group (the workers told first); the ranks then agree on the
    outcome, so that either all are members or none is. Raises this rank's own error, or RuntimeError naming
    the worker rank that could not join."""
    if channel is None:
        return join(args, 0, device)
    channel.send(WEIGHT_GROUP, payload=pickle.dumps({"join": args}))
    member, error = _try_join(args, 0, device)
    statuses = channel.exchange_status(weight_sync.error_status(error))
    if error is not None:
        raise error
    failed = [(rank, status) for rank, status in enumerate(statuses) if status]
    if failed:
        member.close()
        rank, status = failed[0]
        raise RuntimeError(f"Engine.init_weight_update_group: tensor-parallel rank {rank} could not join group "
                           f"{args['group_name']!r} ({status})")
    return member


def close_all(channel: StepChannel | None, member: WeightUpdateGroup) -> None:
    """Rank 0: every engine rank leaves the group (this one first; the workers told, when they still listen)."""
    member.close()
    if channel is not None and channel.failure is None:
        channel.send(WEIGHT_GROUP, payload=pickle.dumps({"close": True}))


def _try_join(args: dict, tp_rank: int, device) -> tuple[WeightUpdateGroup | None, BaseException | None]:
    try:
        return join(args, tp_rank, device), None
    except Exception as error:  # noqa: BLE001 - shared with the other ranks (join_all / WeightGroupWorker.handle)
        return None, error


class WeightGroupWorker:
    """A worker rank's side of ``WEIGHT_GROUP`` messages: join, receive an update, close."""

    def __init__(self, model, channel: StepChannel):
        self.model, self.channel = model, channel
        self.member: WeightUpdateGroup | None = None

    def handle(self, message: dict) -> None:
        if "join" in message:
            member, error = _try_join(message["join"], self.channel.parallel.tp_rank, self.channel.device)
            statuses = self.channel.exchange_status(weight_sync.error_status(error))
            if any(statuses) and member is not None:
                member.close()  # another rank could not join: none is a member
            elif member is not None:
                self.member = member
        elif "update" in message:
            weight_sync.load_from_group_worker(self.model, self.channel, self.member, message["update"])
        elif "close" in message:
            self.close()
        else:
            raise RuntimeError(f"a worker got an unknown weight-group message {sorted(message)}")

    def close(self) -> None:
        if self.member is not None:
            self.member.close()
            self.member = None
