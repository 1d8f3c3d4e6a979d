"""``DataParallelEngine``'s weight updates, mixed into it: ``load_weights`` sends the caller's ``(name, tensor)``
pairs to every replica process in bounded rounds, each round through one shared-memory file
(``engine/shared_round.py``), and every replica feeds them to one ``Engine.load_weights`` call
(``engine/dp_replica.py``'s ``_WeightRounds``). A trainer's weight-update group spans every replica's ranks:
replica i joins as ranks ``rank_offset + i * tensor_parallel_size`` on, and one broadcast of the trainer reaches
them all (``WEIGHT_GROUP`` commands run ``Engine``'s group methods on each replica).

What they use of the front: ``_replicas``, ``_send_to``, ``_collect``, ``_check_usable``, ``_num_unfinished``,
``_groups``, ``abort``, ``_check_awake``, ``dp_attention``, ``device``, ``tensor_parallel_size``, ``_failure``
and ``_finalizer``.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from atom_core.engine.dp_replica import LOAD_WEIGHTS, WEIGHT_GROUP, WEIGHTS
from atom_core.engine.shared_round import remove_round, write_round
from atom_core.engine.weight_group import DEFAULT_TIMEOUT, check_int, group_args, tensor_specs
from atom_core.engine.weight_sync import WeightLoadError, error_status, next_batch

if TYPE_CHECKING:
    from atom_core.models.loader import LoadReport

__all__ = ["ReplicaWeightUpdates"]

def _replica_load_error(failed: dict[int, str]) -> WeightLoadError:
    """The error for replicas whose load failed (``{index: error text}``), naming the first."""
    index, *others = sorted(failed)
    also = f"; replica{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} too" if others else ""
    return WeightLoadError(f"DataParallelEngine.load_weights: replica {index} failed to load the weights "
                           f"({failed[index]}){also}; every replica stopped at that round (the ones before it "
                           "are loaded) and serves on: load the full set again")


def _named(failed: dict[int, str]) -> str:
    """The replicas of ``{index: error text}`` and their errors, for a message."""
    return "; ".join(f"replica {index}: {error}" for index, error in sorted(failed.items()))


class ReplicaWeightUpdates:
    """The weight-update methods of ``DataParallelEngine`` (see the module docstring)."""

    _weight_group: dict | None = None  # the open group's arguments (group_args), with the engine's rank count

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int, *,
                                 backend: str | None = None, group_name: str = "weight_update",
                                 timeout=DEFAULT_TIMEOUT) -> None:
        """``Engine.init_weight_update_group`` over every replica (see there): replica i's ranks join as group ranks
        ``rank_offset + i * tensor_parallel_size`` on, so the engine's ranks are ``rank_offset`` ..
        ``rank_offset + data_parallel_size * tensor_parallel_size - 1`` and ``world_size`` must hold them and the
        trainer's. A replica that cannot join is named (RuntimeError); the replicas that joined leave again. Not
        with ``dp_attention`` (NotImplementedError: its replicas step in lock step)."""
        if self.dp_attention:
            raise NotImplementedError("DataParallelEngine.init_weight_update_group: not built with dp_attention (the "
                                      "replicas step in lock step); use load_weights")
        if self._weight_group is not None:
            raise ValueError(f"DataParallelEngine.init_weight_update_group: weight-update group "
                             f"{self._weight_group['group_name']!r} is open; destroy_weight_update_group() first")
        tp, ranks = self.tensor_parallel_size, len(self._replicas) * self.tensor_parallel_size
        args = group_args(master_address, master_port, rank_offset, world_size, backend=backend,
                          group_name=group_name, timeout=timeout, tp_size=ranks, device=self.device)
        answers = self._on_every_replica_group(
            "init_weight_update_group", lambda i: args | {"rank_offset": rank_offset + i * tp})
        failed = {i: error for i, (_, error) in answers.items() if error}
        if failed:
            self._on_every_replica_group("destroy_weight_update_group", lambda i: {})  # (idempotent on each)
            raise RuntimeError(f"DataParallelEngine.init_weight_update_group: {_named(failed)}; no replica is in "
                               "the group")
        self._weight_group = args | {"engine_ranks": ranks}

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence, shapes: Sequence[Sequence[int]],
                                        *, src: int = 0, strict: bool = False, check_finite: bool = True,
                                        unfinished: str = "refuse") -> list[LoadReport]:
        """``Engine.update_weights_from_distributed`` on every replica at once (see there): each of the trainer's
        broadcasts reaches every replica's ranks. Returns the replicas' ``LoadReport``s in replica order.

        Refused before anything is received, as there (the trainer must then not broadcast): lists that do not
        match (ValueError), ``src`` one of the engine's ranks, no group open (RuntimeError), the replicas asleep,
        unfinished requests under ``unfinished="refuse"`` (RuntimeError naming the count; ``"abort"`` aborts them
        first, ``"keep"`` lets them go on with the new weights). A tensor a replica refuses raises
        ``WeightLoadError`` naming the replica and its error; every replica still receives the rest, so the
        trainer's broadcasts complete and the group stays usable."""
        from atom_core.engine.weight_updates import UNFINISHED, aborts_unfinished

        caller = "DataParallelEngine.update_weights_from_distributed"
        tensor_specs(names, dtypes, shapes)  # (each replica checks them again: the same rules)
        group = self._weight_group
        if group is None:
            raise RuntimeError(f"{caller}: no weight-update group is open (init_weight_update_group first)")
        check_int("src", src, 0)
        first, last = group["rank_offset"], group["rank_offset"] + group["engine_ranks"] - 1
        if src >= group["world_size"] or first <= src <= last:
            raise ValueError(f"src must be a rank of group {group['group_name']!r} outside the engine's ranks "
                             f"{first}..{last} (the trainer's), got {src} of world_size={group['world_size']}")
        if unfinished not in UNFINISHED:
            raise ValueError(f"{caller}: unfinished must be one of {UNFINISHED}, got {unfinished!r}")
        self._check_awake(caller)
        if aborts_unfinished(caller, unfinished, self._num_unfinished()):
            self.abort(list(self._groups))  # (each replica reads the aborts before the update)
        kwargs = dict(names=list(names), dtypes=list(dtypes), shapes=[list(shape) for shape in shapes], src=src,
                      strict=strict, check_finite=check_finite, unfinished=unfinished)
        answers = self._on_every_replica_group("update_weights_from_distributed", lambda i: kwargs)
        failed = {i: error for i, (_, error) in answers.items() if error}
        if failed:
            raise WeightLoadError(f"{caller}: {_named(failed)}; every replica received every tensor and serves on: "
                                  "broadcast the full set again")
        return [answers[i][0] for i in range(len(self._replicas))]

    def destroy_weight_update_group(self) -> None:
        """Every replica's ranks leave the weight-update group (the trainer closes its own member). Idempotent."""
        if self._weight_group is None:
            return
        self._weight_group = None
        answers = self._on_every_replica_group("destroy_weight_update_group", lambda i: {})
        failed = {i: error for i, (_, error) in answers.items() if error}
        if failed:
            raise RuntimeError(f"DataParallelEngine.destroy_weight_update_group: {_named(failed)}")

    def _on_every_replica_group(self, method: str, kwargs_of) -> dict[int, tuple]:
        """Run the engine's weight-group ``method`` on every replica at once (``kwargs_of(index)``) and wait for
        all: {index: (result, "" or why it failed)}."""
        self._check_usable()
        indices = range(len(self._replicas))
        for index in indices:
            self._send_to([index], pickle.dumps((WEIGHT_GROUP, (method, kwargs_of(index)))))
        return {index: answer[1:] for index, answer in self._collect((WEIGHT_GROUP,), indices).items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = False,
                     check_finite: bool = True) -> list[LoadReport]:
        """``Engine.load_weights`` on every replica, with the same pairs: new weights from a trainer, then each
        replica's prefix-cache reset (vLLM's RL convention). Returns the replicas' ``LoadReport``s, one per
        replica, in replica order (their engines load the same pairs into the same model: the reports agree).

        ``weights``: ``(checkpoint name, tensor)`` pairs, as ``Engine.load_weights`` takes them (any iterable, a
        generator included). It is read once, one pair at a time, in rounds of ``weight_sync.BATCH_BYTES``
        (``weight_sync.next_batch``): each round's tensors, on the CPU, are written once into one shared-memory
        file (``engine/shared_round.py``: /dev/shm) that every replica maps, and the replicas are sent only where
        each tensor lies in it; each replica's one ``Engine.load_weights`` call reads the rounds as they come
        (one report, one ``process_weights_after_loading`` and one prefix-cache reset per replica; with TP
        workers its engine streams them on to its ranks). The front holds one round at a time (and its file,
        removed once every replica has answered the round, or the load failed).

        Every replica answers every round; a round refused by any replica ends the load at that round on
        all of them and raises ``weight_sync.WeightLoadError`` naming the replica and its error (the rounds
        before it are loaded; each engine serves on, its prefix cache reset: load the full set again). An
        iterable that raises midway (or gives something that is not a pair) ends every replica's load
        cleanly and its error is raised here; the engine serves on (so does a round the front cannot write:
        OSError, no room in /dev/shm nor the temporary directory). A replica that dies or does not answer
        a round within ``step_timeout`` raises ``ReplicaFailedError`` and stops the replicas, as in a step.
        Outputs that arrive meanwhile are kept for the next ``step()``.

        Raises RuntimeError naming the count, before sending anything, while requests are unfinished (they
        would mix KV of two weight sets). With ``dp_attention`` the replicas load too: each takes the load
        at its next agreement with its peers, outside the lock step (``engine/dp_replica.py``).
        """
        from atom_core.engine.data_parallel import ReplicaFailedError  # (it imports this module)

        self._check_usable()
        unfinished = self._num_unfinished()
        if unfinished:
            raise RuntimeError(f"DataParallelEngine.load_weights: {unfinished} requests are unfinished; they would "
                               "mix KV and tokens of two weight sets: let them finish (or abort them) first")
        source = iter(weights)
        start = pickle.dumps((LOAD_WEIGHTS, {"strict": strict, "check_finite": check_finite}))
        try:
            self._send_to(range(len(self._replicas)), start)
            ends, caller_error = self._stream_rounds(source)  # (every replica's load has ended)
        except ReplicaFailedError:
            raise  # (the replicas are stopped)
        except BaseException as error:  # an interrupt mid-round: where each replica's load stands is unknown
            self._failure = f"load_weights was interrupted while the replicas loaded ({type(error).__name__})"
            self._finalizer()
            raise
        if caller_error is not None:
            raise caller_error
        failed = {index: error for index, (_, _, error) in ends.items() if error}
        if failed:
            raise _replica_load_error(failed)
        return [ends[index][1] for index in range(len(self._replicas))]

    def _stream_rounds(self, source: Iterator) -> tuple[dict[int, tuple], BaseException | None]:
        """Send ``source``'s rounds to every replica until its end, a replica's refusal, or its error, and end
        every replica's load there. Returns (the end-of-load answers ``(LOAD_WEIGHTS, report, error text)``
        by replica index: every replica's after the last round, the refusing replicas' only after a refusal,
        none after an error of ``source`` or of writing a round; what it raised, or None)."""
        everyone = range(len(self._replicas))
        while True:
            try:
                batch = next_batch(source, "cpu", "DataParallelEngine.load_weights")
            except BaseException as error:  # noqa: BLE001 - the caller's iterable: loads stop, load_weights raises it
                self._end_loads(everyone, {"abort": f"the caller's weights raised {error_status(error)}"})
                return {}, error
            if not batch:
                return self._end_loads(everyone, {"end": True}), None
            try:
                shared = write_round(batch)
            except BaseException as error:  # noqa: BLE001 - no room for the round (OSError): loads stop, it is raised
                self._end_loads(everyone, {"abort": f"the front could not write the round ({type(error).__name__})"})
                return {}, error
            del batch  # (written: not held while the next round is read)
            try:
                self._send_to(everyone, pickle.dumps((WEIGHTS, shared), protocol=pickle.HIGHEST_PROTOCOL))
                answers = self._collect((WEIGHTS, LOAD_WEIGHTS), everyone)
            finally:  # every replica answered the round (or one failed, or an interrupt): no file is left behind
                remove_round(shared)
            refused = {index: answer for index, answer in answers.items() if answer[0] == LOAD_WEIGHTS}
            if refused:  # (a replica answers a round with its load's end only when the load failed)
                self._end_loads([i for i in everyone if i not in refused],
                                {"abort": f"replica {min(refused)} refused this round"})
                return refused, None

    def _end_loads(self, indices: Iterable[int], message: dict) -> dict[int, tuple]:
        """Send ``(WEIGHTS, message)`` (``end`` or ``abort``) to the replicas of ``indices`` and return their
        end-of-load answers by index."""
        self._send_to(indices, pickle.dumps((WEIGHTS, message)))
        return self._collect((LOAD_WEIGHTS,), indices)
