"""New weights for a model split over a TP group: rank 0 streams ``(name, tensor)`` pairs to its workers and
every rank loads them into its own shard (``Engine.load_weights`` with several ranks).

The pairs go in rounds of a bounded batch (``BATCH_BYTES``, at least one tensor: ``next_batch``, which the
data-parallel front's ``load_weights`` reads its rounds with too), so that no rank holds more than one batch
of full tensors at once and a generator on rank 0 is read once, one pair at a time.
Each round, on every rank:

1. rank 0 takes the next pairs from the caller's iterable and sends a ``LOAD_WEIGHTS`` message over the
   control group: a pickled dict with the batch's ``(name, shape, dtype)`` list (or ``end``: no more
   pairs; or ``abort``: rank 0's iterable raised or gave something that is not a pair);
2. each tensor's bytes are broadcast from rank 0 over the TP group (the model's device group: NCCL on a
   GPU, gloo on the CPU; rank 0's tensors moved to its device first);
3. every rank hands the batch's pairs to its own ``models.named_tensors.load_named_tensors`` (ONE call per rank
   over the whole stream: its report, accounting and ``process_weights_after_loading`` cover it all), which
   cuts each rank's shard;
4. the ranks exchange a status (empty: fine, else the error) over the control group; one failed rank
   stops every rank's load at that batch, and rank 0 raises the error (its own, or a worker's, named).

After the last round the ranks exchange a final status (``process_weights_after_loading`` can fail too).
A refused tensor leaves the ranks in step (the engine serves on; the tensors before it are loaded, as on
one rank); a collective that fails (a worker died) marks the engine broken as a failed step does.

``Engine.update_weights_from_distributed`` runs the same rounds with another source of bytes
(``load_from_group_driver`` / ``load_from_group_worker``): every rank knows the ``(name, shape, dtype)``
list from the start (rank 0 sends the rounds once), and in each round every engine rank receives each
tensor by a broadcast from the trainer over the weight-update group (``engine.weight_group``) instead of
from rank 0. The status exchanges are the same (with one rank there is nothing to exchange). A load that
stops early still receives the rest of the declared tensors on every rank, discarding them, so that the
trainer's broadcasts complete and the group stays usable.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

import torch

from atom_core.engine.distributed import LOAD_WEIGHTS, WEIGHT_GROUP
from atom_core.models.named_tensors import named_tensor_pair

if TYPE_CHECKING:
    from atom_core.engine.distributed import StepChannel
    from atom_core.engine.weight_group import TensorSpec, WeightUpdateGroup
    from atom_core.models.loader import LoadReport

__all__ = ["BATCH_BYTES", "WeightLoadError", "load_from_group_driver", "load_from_group_worker",
           "load_weights_driver", "load_weights_worker", "next_batch", "take_round"]

BATCH_BYTES = 256 * 1024 * 1024  # the full (unsharded) tensors a rank holds at once, besides a larger single one


_END = object()  # the caller's iterable is exhausted
T = TypeVar("T")


class WeightLoadError(RuntimeError):
    """A worker rank, or a data-parallel replica, refused a tensor (or failed to finish the load); the message
    names the rank (or replica) and says why."""


def error_status(error: BaseException | None) -> str:
    """A rank's status in a status exchange: "" when it did its part, else its error's type and message."""
    return "" if error is None else f"{type(error).__name__}: {error}"


def take_round(items: Iterator[T], nbytes: Callable[[T], int]) -> list[T]:
    """The next round of ``items``, read one at a time until the round holds ``BATCH_BYTES`` (by ``nbytes`` of
    each: so at least one item, and an item over the bound ends its round); empty once ``items`` is exhausted.
    The one rule every weight stream cuts its rounds by."""
    batch, size = [], 0
    while size < BATCH_BYTES:
        item = next(items, _END)
        if item is _END:
            break
        batch.append(item)
        size += nbytes(item)
    return batch


def next_batch(source: Iterator, device: torch.device | str, caller: str) -> list[tuple[str, torch.Tensor]]:
    """One round's pairs from ``source`` (``take_round``). Each item is checked to be a ``(name, tensor)``
    pair (TypeError naming ``caller`` otherwise) and its tensor detached, moved to ``device`` and made
    contiguous. What ``source`` raises propagates (nothing of the round is kept)."""
    def prepared(item) -> tuple[str, torch.Tensor]:
        name, tensor = named_tensor_pair(item, caller)
        return name, tensor.detach().to(device).contiguous()

    return take_round(map(prepared, source), lambda pair: pair[1].numel() * pair[1].element_size())


class _Stopped(Exception):
    """This rank's load ends because another rank failed, or rank 0 aborted: nothing more to exchange."""


class _Stream:
    """One rank's side of the rounds; ``pairs()`` is the generator its ``load_named_tensors`` reads."""

    def __init__(self, channel: StepChannel | None, source: Iterator | None):
        self.channel = channel  # None: a one-rank engine's update from a weight-update group
        self.source = source  # rank 0: the caller's pairs; a worker: None
        self.owed = False     # a batch was handed out: this rank owes the round's status exchange
        self.finished = False  # the end came: the final status exchange is owed
        self.aborted = False  # rank 0: its iterable failed (the workers were told)
        self.statuses: list[str] = []  # the last failed exchange's statuses, one per rank
        self._tensors: list[torch.Tensor] = []  # rank 0: the batch being sent

    def finish(self) -> None:
        """What this rank does after its load, stopped early or not: nothing here (a ``_GroupStream`` receives
        the tensors it did not)."""

    # ---- step 1: the batch's description
    def _next_message(self) -> dict:
        if self.source is None:
            kind, payload = self.channel.recv()
            if kind != LOAD_WEIGHTS:
                raise RuntimeError(f"a worker loading weights got message kind {kind}")
            return pickle.loads(payload)
        try:
            batch = next_batch(self.source, self.channel.device, "load_weights")
        except BaseException as error:
            self.aborted = True
            self.channel.send(LOAD_WEIGHTS, payload=pickle.dumps({"abort": error_status(error)}))
            raise
        message = {"batch": [(n, tuple(t.shape), t.dtype) for n, t in batch]} if batch else {"end": True}
        self.channel.send(LOAD_WEIGHTS, payload=pickle.dumps(message))
        self._tensors = [t for _, t in batch]
        return message

    # ---- step 2: the bytes
    def _broadcast(self, meta: list) -> list[torch.Tensor]:
        tensors = self._tensors if self.source is not None else [
            torch.empty(shape, dtype=dtype, device=self.channel.device) for _, shape, dtype in meta]
        self._tensors = []
        for tensor in tensors:
            if tensor.numel():  # (bytes: any dtype crosses, bool and float8 included)
                self.channel.broadcast_tensor(tensor.reshape(-1).view(torch.uint8))
        return tensors

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            message = self._next_message()
            if "abort" in message:
                raise _Stopped(f"rank 0 stopped the load ({message['abort']})")
            if "end" in message:
                self.finished = True
                return
            tensors = self._broadcast(message["batch"])
            self.owed = True
            for (name, _, _), tensor in zip(message["batch"], tensors):
                yield name, tensor
            del tensors
            self.owed = False
            # step 4: every rank loaded the batch; go on only if all did
            self.check(self.exchange_status(""))

    def exchange_status(self, status: str) -> list[str]:
        """Every rank's status (``StepChannel.exchange_status``); with one rank (no channel) its own."""
        return [status] if self.channel is None else self.channel.exchange_status(status)

    def check(self, statuses: list[str]) -> None:
        if any(statuses):
            self.statuses = statuses
            raise _Stopped("another rank failed")


def _run(model, stream: _Stream, options: dict) -> tuple[LoadReport | None, BaseException | None, list[str]]:
    """This rank's ``load_named_tensors`` over the stream; returns (report, this rank's error, the ranks'
    statuses). A failure of the rounds themselves (a collective, rank 0's iterable) is raised."""
    from atom_core.models.named_tensors import load_named_tensors

    try:
        report = load_named_tensors(model, stream.pairs(), **options)
        error = None
    except _Stopped:
        return None, None, stream.statuses
    except Exception as caught:  # shared with the other ranks below when it is a load's error
        if not (stream.owed or stream.finished):
            raise  # the rounds themselves failed (or rank 0's iterable): see the callers
        report, error = None, caught
    return report, error, stream.exchange_status(error_status(error))


def load_weights_driver(model, channel: StepChannel, weights: Iterable, *, strict: bool,
                        check_finite: bool) -> LoadReport:
    """Rank 0: stream ``weights`` to the workers and load them here too (see the module docstring).
    Raises this rank's own error (a ValueError naming a refused tensor, say), or ``WeightLoadError`` naming
    the worker rank that failed; the ranks stay in step either way."""
    options = {"strict": strict, "check_finite": check_finite}
    channel.send(LOAD_WEIGHTS, payload=pickle.dumps({"start": options}))
    return _drive(model, _Stream(channel, iter(weights)), options, "Engine.load_weights")


def _drive(model, stream: _Stream, options: dict, caller: str) -> LoadReport:
    """Rank 0's load over ``stream`` (its workers already told): its report, or the error of the rank that
    failed (this rank's own, or ``WeightLoadError`` naming a worker rank)."""
    try:
        report, error, statuses = _run(model, stream, options)
    except BaseException as failure:
        if stream.aborted or stream.channel is None:  # the ranks are in step (or there is one)
            raise
        raise stream.channel.fail(failure) from failure  # a collective failed (or an interrupt): out of step
    stream.finish()
    if error is not None:
        raise error
    failed = [(rank, status) for rank, status in enumerate(statuses) if status]
    if failed:
        rank, status = failed[0]
        raise WeightLoadError(f"{caller}: tensor-parallel rank {rank} failed to load the weights "
                              f"({status}); the tensors before it are loaded on every rank")
    return report


def load_weights_worker(model, channel: StepChannel, start: dict) -> None:
    """A worker rank, after a ``LOAD_WEIGHTS`` start message: receive and load rank 0's pairs into this
    rank's shard. A refused tensor is reported to rank 0 (which raises it); returns either way."""
    stream = _Stream(channel, None)
    _run(model, stream, start["start"])


# ---- the bytes from a weight-update group ----------------------------------------------------------------------------

class _GroupStream(_Stream):
    """One rank's side of ``update_weights_from_distributed``: the rounds are known from the start, and each
    tensor comes from the trainer (``src``) over the weight-update group ``member``.

    A failed receive (the trainer gone, a timeout) is this rank's load error, shared at the round's status
    exchange like a refused tensor: the engine's ranks stay in step (the group itself may be unusable then).
    """

    def __init__(self, channel: StepChannel | None, member: WeightUpdateGroup, rounds: list[list[TensorSpec]],
                 src: int):
        super().__init__(channel, None)
        self.member, self.src = member, src
        self.rounds = iter(rounds)
        self.receive_failed = False

    def _next_message(self) -> dict:
        batch = next(self.rounds, None)
        return {"end": True} if batch is None else {"batch": batch}

    def _broadcast(self, meta: list) -> list[torch.Tensor]:
        self.owed = True  # (set before the bytes: a failed receive is shared at the status exchange)
        tensors = []
        for _, shape, dtype in meta:
            tensors.append(self._receive(shape, dtype))
        return tensors

    def _receive(self, shape, dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.member.device)
        try:
            self.member.broadcast(tensor, self.src)
        except BaseException:
            self.receive_failed = True
            raise
        return tensor

    def finish(self) -> None:
        """Receive and drop the tensors of the rounds not received (a load that stopped early): the trainer
        broadcasts every declared tensor, and each broadcast needs every member. Not after a failed receive
        (the group is broken: the trainer's broadcasts fail too)."""
        if self.receive_failed:
            return
        for batch in self.rounds:
            for _, shape, dtype in batch:
                self._receive(shape, dtype)


def load_from_group_driver(model, channel: StepChannel | None, member: WeightUpdateGroup,
                           rounds: list[list[TensorSpec]], *, src: int, strict: bool,
                           check_finite: bool) -> LoadReport:
    """Rank 0 (or the only rank): receive ``rounds`` of tensors from ``src`` over ``member``'s group and load
    them, the workers doing the same (told here); errors as ``load_weights_driver``'s."""
    options = {"strict": strict, "check_finite": check_finite}
    if channel is not None:
        channel.send(WEIGHT_GROUP, payload=pickle.dumps({"update": {"rounds": rounds, "src": src,
                                                                    "options": options}}))
    return _drive(model, _GroupStream(channel, member, rounds, src), options,
                  "Engine.update_weights_from_distributed")


def load_from_group_worker(model, channel: StepChannel, member: WeightUpdateGroup, update: dict) -> None:
    """A worker rank, after rank 0's ``update`` message: receive and load the tensors into this rank's shard.
    A refused tensor is reported to rank 0 (which raises it); returns either way."""
    stream = _GroupStream(channel, member, update["rounds"], update["src"])
    _run(model, stream, update["options"])
    stream.finish()
