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
3. every rank hands the batch's pairs to its own ``models.loader.load_named_tensors`` (ONE call per rank
   over the whole stream: its report, accounting and ``process_weights_after_loading`` cover it all), which
   cuts each rank's shard;
4. the ranks exchange a status (empty: fine, else the error) over the control group; one failed rank
   stops every rank's load at that batch, and rank 0 raises the error (its own, or a worker's, named).

After the last round the ranks exchange a final status (``process_weights_after_loading`` can fail too).
A refused tensor leaves the ranks in step (the engine serves on; the tensors before it are loaded, as on
one rank); a collective that fails (a worker died) marks the engine broken as a failed step does.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from atom_core.engine.distributed import LOAD_WEIGHTS
from atom_core.models.loader import named_tensor_pair

if TYPE_CHECKING:
    from atom_core.engine.distributed import StepChannel
    from atom_core.models.loader import LoadReport

__all__ = ["BATCH_BYTES", "WeightLoadError", "load_weights_driver", "load_weights_worker", "next_batch"]

BATCH_BYTES = 256 * 1024 * 1024  # the full (unsharded) tensors a rank holds at once, besides a larger single one


_END = object()  # the caller's iterable is exhausted


class WeightLoadError(RuntimeError):
    """A worker rank, or a data-parallel replica, refused a tensor (or failed to finish the load); the message
    names the rank (or replica) and says why."""


def next_batch(source: Iterator, device: torch.device | str, caller: str) -> list[tuple[str, torch.Tensor]]:
    """One round's pairs, read from ``source`` one at a time until they hold ``BATCH_BYTES`` (so at least one
    tensor: a tensor over the bound ends its round); empty once ``source`` is exhausted. Each item is checked
    to be a ``(name, tensor)`` pair (TypeError naming ``caller`` otherwise) and its tensor detached, moved to
    ``device`` and made contiguous. What ``source`` raises propagates (nothing of the round is kept)."""
    batch, size = [], 0
    while size < BATCH_BYTES:
        item = next(source, _END)
        if item is _END:
            break
        name, tensor = named_tensor_pair(item, caller)
        tensor = tensor.detach().to(device).contiguous()
        batch.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    return batch


class _Stopped(Exception):
    """This rank's load ends because another rank failed, or rank 0 aborted: nothing more to exchange."""


class _Stream:
    """One rank's side of the rounds; ``pairs()`` is the generator its ``load_named_tensors`` reads."""

    def __init__(self, channel: StepChannel, source: Iterator | None):
        self.channel = channel
        self.source = source  # rank 0: the caller's pairs; a worker: None
        self.owed = False     # a batch was handed out: this rank owes the round's status exchange
        self.finished = False  # the end came: the final status exchange is owed
        self.aborted = False  # rank 0: its iterable failed (the workers were told)
        self.statuses: list[str] = []  # the last failed exchange's statuses, one per rank
        self._tensors: list[torch.Tensor] = []  # rank 0: the batch being sent

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
            self.channel.send(LOAD_WEIGHTS, payload=pickle.dumps({"abort": f"{type(error).__name__}: {error}"}))
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
            self.check(self.channel.exchange_status(""))

    def check(self, statuses: list[str]) -> None:
        if any(statuses):
            self.statuses = statuses
            raise _Stopped("another rank failed")


def _run(model, stream: _Stream, options: dict) -> tuple[LoadReport | None, BaseException | None, list[str]]:
    """This rank's ``load_named_tensors`` over the stream; returns (report, this rank's error, the ranks'
    statuses). A failure of the rounds themselves (a collective, rank 0's iterable) is raised."""
    from atom_core.models.loader import load_named_tensors

    try:
        report = load_named_tensors(model, stream.pairs(), **options)
        error = None
    except _Stopped:
        return None, None, stream.statuses
    except Exception as caught:  # shared with the other ranks below when it is a load's error
        if not (stream.owed or stream.finished):
            raise  # the rounds themselves failed (or rank 0's iterable): see the callers
        report, error = None, caught
    status = "" if error is None else f"{type(error).__name__}: {error}"
    return report, error, stream.channel.exchange_status(status)


def load_weights_driver(model, channel: StepChannel, weights: Iterable, *, strict: bool,
                        check_finite: bool) -> LoadReport:
    """Rank 0: stream ``weights`` to the workers and load them here too (see the module docstring).
    Raises this rank's own error (a ValueError naming a refused tensor, say), or ``WeightLoadError`` naming
    the worker rank that failed; the ranks stay in step either way."""
    options = {"strict": strict, "check_finite": check_finite}
    channel.send(LOAD_WEIGHTS, payload=pickle.dumps({"start": options}))
    stream = _Stream(channel, iter(weights))
    try:
        report, error, statuses = _run(model, stream, options)
    except BaseException as failure:
        if stream.aborted:  # the caller's iterable failed: the workers were told, the ranks are in step
            raise
        raise channel.fail(failure) from failure  # a collective failed (or an interrupt): out of step
    if error is not None:
        raise error
    failed = [(rank, status) for rank, status in enumerate(statuses) if status]
    if failed:
        rank, status = failed[0]
        raise WeightLoadError(f"Engine.load_weights: tensor-parallel rank {rank} failed to load the weights "
                              f"({status}); the tensors before it are loaded on every rank")
    return report


def load_weights_worker(model, channel: StepChannel, start: dict) -> None:
    """A worker rank, after a ``LOAD_WEIGHTS`` start message: receive and load rank 0's pairs into this
    rank's shard. A refused tensor is reported to rank 0 (which raises it); returns either way."""
    stream = _Stream(channel, None)
    _run(model, stream, start["start"])
