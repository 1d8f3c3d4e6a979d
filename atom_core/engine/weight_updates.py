"""``Engine``'s weight updates for RL loops, mixed into ``Engine``: ``load_weights`` (pairs handed over in this
process, streamed to the TP workers by ``engine.weight_sync``), the trainer's weight-update group
(``init_weight_update_group`` / ``update_weights_from_distributed`` / ``destroy_weight_update_group``,
``engine.weight_group``), and ``reset_prefix_cache``, which every update ends with.

What they use of the engine: ``model``, ``device``, ``block_manager``, ``_channel`` (the TP ranks' control
channel, None with one rank), ``_weight_group`` (this rank's member of an open group, else None),
``_num_unfinished()``, ``_requests`` and ``abort`` (an ``unfinished="abort"`` update), ``shutdown()`` and
``_check_awake`` (sleep mode: the weights must be awake).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from atom_core.engine.weight_group import (
    DEFAULT_TIMEOUT,
    check_src,
    close_all,
    group_args,
    join_all,
    plan_rounds,
    tensor_specs,
)
from atom_core.engine.weight_sync import load_from_group_driver, load_weights_driver

if TYPE_CHECKING:
    from atom_core.models.loader import LoadReport

__all__ = ["UNFINISHED", "WeightUpdates"]

UNFINISHED = ("refuse", "abort", "keep")  # what a weight update does with unfinished requests (load_weights)


def aborts_unfinished(caller: str, unfinished: str, count: int) -> bool:
    """A weight update's rule for ``count`` unfinished requests under ``unfinished`` (one of ``UNFINISHED``):
    RuntimeError naming the count under "refuse"; True when they are to be aborted first."""
    if count and unfinished == "refuse":
        raise RuntimeError(f"{caller}: {count} requests are unfinished; they would mix KV and tokens of two "
                           "weight sets: let them finish first, or pass unfinished='abort' (abort them) or "
                           "'keep' (they go on with the new weights)")
    return bool(count) and unfinished == "abort"


class WeightUpdates:
    """The weight-update methods of ``Engine`` (see the module docstring for what they read of it)."""

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache entry, so no later prompt reuses KV computed before now (after a weight
        update; or between benchmark runs). Returns False and changes nothing while requests hold KV blocks
        (vLLM's rule: finish or abort them first); waiting requests hold none. The prefix-cache counters
        (``block_manager.stats``) keep counting. Another engine over the same model keeps its own cache."""
        return self.block_manager.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = False,
                     check_finite: bool = True, unfinished: str = "refuse") -> LoadReport:
        """New weights for the live model from a trainer, then a prefix-cache reset: vLLM's
        ``model.load_weights(weights)`` followed by ``llm.reset_prefix_cache()`` in RL loops.

        ``weights``: ``(checkpoint name, tensor)`` pairs, Hugging Face names as ``state_dict()`` gives them
        (any iterable, a generator included; a subset updates those parameters only). They are copied into
        the model's parameters in place (``models.named_tensors.load_named_tensors``: same name mapping, shards and
        online quantization as loading the checkpoint; ``strict`` and ``check_finite`` as there), so CUDA
        graphs captured over the model read the new values. Returns the ``LoadReport``.

        With several tensor-parallel ranks (rank 0 holds the engine) the pairs stream to the worker ranks in
        bounded batches (``engine.weight_sync``: each tensor broadcast over the TP group, every rank loading
        its own shard with the same pairs; a generator is still read once, one pair at a time), and the ranks
        agree on the outcome after each batch: a tensor refused on any rank raises here (rank 0's own error,
        or ``WeightLoadError`` naming the worker rank and its error), the ranks stay in step and the engine
        serves on. A worker that dies meanwhile raises ``WorkerFailedError`` and stops the engine.

        ``unfinished``: what happens to requests not finished when the update comes (``UNFINISHED``):
        - ``"refuse"`` (the default): RuntimeError naming the count, nothing loaded (a request would mix KV
          and tokens of two weight sets);
        - ``"abort"`` (SGLang's ``abort_all_requests``): each is aborted first, as ``Engine.abort`` does (no
          further output for it), then the update runs;
        - ``"keep"`` (in-flight updates, as async RL loops run vLLM): they go on with the new weights over the KV
          already computed with the old ones; waiting requests hold no KV and start on the new weights. The
          prefix cache is reset all the same, and a request that held KV through the update publishes none of
          its blocks, so no later prompt reuses KV of the old weights.

        Raises RuntimeError while the weights are asleep (``Engine.sleep``; wake_up(["weights"]) first). A
        refused tensor stops the load there, the ones before it loaded (load the full set
        again); the prefix cache is reset whenever the load began, so no KV of the old weights is reused.
        """
        from atom_core.models.named_tensors import load_named_tensors

        def load() -> LoadReport:
            if self._channel is None:
                return load_named_tensors(self.model, weights, strict=strict, check_finite=check_finite)
            return load_weights_driver(self.model, self._channel, weights, strict=strict, check_finite=check_finite)

        self._check_weight_update("Engine.load_weights", unfinished)
        return self._update_weights("Engine.load_weights", load)

    def _check_weight_update(self, caller: str, unfinished: str) -> None:
        """Refuse a weight update (before anything is read or received): the ranks are gone
        (``DistributedEngineError``), the weights are asleep, ``unfinished`` is not one of ``UNFINISHED`` (ValueError),
        or requests are unfinished under ``"refuse"`` (RuntimeError naming the count); under ``"abort"`` abort them.
        With the KV pool asleep and the weights awake an update is allowed (vLLM's ``wake_up(["weights"])``, load,
        then ``wake_up(["kv_cache"])``)."""
        if unfinished not in UNFINISHED:
            raise ValueError(f"{caller}: unfinished must be one of {UNFINISHED}, got {unfinished!r}")
        self._check_awake(caller, needs=("weights",))
        if self._channel is not None:
            self._channel.check_usable()
        if aborts_unfinished(caller, unfinished, self._num_unfinished()):
            self.abort(list(self._requests))

    def _update_weights(self, caller: str, load) -> LoadReport:
        """``load()`` (every rank's load of new weights), then the prefix-cache reset, also when it fails (some
        tensors may be loaded); ranks out of step after a failure are stopped. Requests still running (an
        ``unfinished="keep"`` update) keep their blocks and publish none of them (``reset_prefix_cache``)."""
        try:
            report = load()
        except BaseException:
            if self._channel is not None and self._channel.failure is not None:
                self.shutdown()  # the ranks are out of step: stop the workers now
            else:
                self.block_manager.reset_prefix_cache(keep_held=True)  # (some tensors may be loaded)
            raise
        self.block_manager.reset_prefix_cache(keep_held=True)
        return report

    # ------------------------------------------------------------------ weight-update group (RL)

    @property
    def _tp_size(self) -> int:
        return 1 if self._channel is None else self._channel.parallel.tp_size

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int, *,
                                 backend: str | None = None, group_name: str = "weight_update",
                                 timeout=DEFAULT_TIMEOUT) -> None:
        """Join a trainer's weight-update group (SGLang's ``init_weights_update_group``; vLLM's RLHF example): a
        process group of ``world_size`` members, the trainer's rank 0 among them (it hosts the group's store at
        ``master_address:master_port``), which ``update_weights_from_distributed`` receives new weights over.

        Every engine rank joins: this process as rank ``rank_offset``, TP rank r (a worker, told over the
        control channel) as ``rank_offset + r``. ``backend``: None picks "nccl" on CUDA (the tensors arrive
        on each rank's GPU), "gloo" on the CPU. ``timeout`` (a ``timedelta`` or seconds): the longest a member
        waits, to join and in each broadcast. With gloo it blocks until every member has joined (the trainer
        joins with ``engine.weight_group.WeightUpdateGroup(..., rank=0, ...)``; with NCCL the communicator is
        made at the first broadcast); the engine's ranks are all members or none is (RuntimeError naming a
        worker rank that could not join).

        The group is built on its own store, not on ``torch.distributed``'s default group. ValueError naming
        the argument that makes no sense, or naming the group already open (one at a time:
        ``destroy_weight_update_group`` first).
        """
        if self._weight_group is not None:
            raise ValueError(f"Engine.init_weight_update_group: weight-update group {self._weight_group.group_name!r}"
                             " is open; destroy_weight_update_group() first")
        args = group_args(master_address, master_port, rank_offset, world_size, backend=backend,
                          group_name=group_name, timeout=timeout, tp_size=self._tp_size, device=self.device)
        if self._channel is not None:
            self._channel.check_usable()
        self._weight_group = join_all(self._channel, args, self.device)

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence, shapes: Sequence[Sequence[int]],
                                        *, src: int = 0, strict: bool = False, check_finite: bool = True,
                                        unfinished: str = "refuse") -> LoadReport:
        """New weights broadcast by the trainer (group rank ``src``) over the weight-update group, then a
        prefix-cache reset: SGLang's ``update_weights_from_distributed``; ``load_weights``' rules otherwise.

        ``names``, ``dtypes``, ``shapes``: one entry per tensor the trainer broadcasts, in its order (Hugging
        Face names as ``state_dict()`` gives them; ``torch.dtype`` or its name, "bfloat16" or
        "torch.bfloat16"; full, unsharded shapes). Every engine rank allocates each full tensor (on its GPU for
        nccl, on the CPU for gloo), receives it by broadcast from ``src``, and one ``load_named_tensors`` call
        per rank loads them all (each rank cutting its own shard), in rounds of ``weight_sync.BATCH_BYTES`` so
        that a rank holds one round of full tensors at most; the ranks agree on the outcome after each round,
        as in ``load_weights``. Returns rank 0's ``LoadReport``.

        The trainer must broadcast exactly these tensors, in this order, while this call runs (in an RL loop
        the engine call is remote or on another thread: start it, then broadcast). A tensor refused on any
        rank (a wrong shape: ValueError naming it; ``weight_sync.WeightLoadError`` naming a worker rank) stops
        the load there; the later tensors are still received and dropped, so the trainer's broadcasts complete
        and the engine serves on (load the full set again). A broadcast that fails (the trainer gone, the
        group's timeout) raises; destroy the group and make a new one.

        Refused before any tensor is received, with nothing received (so the trainer must not broadcast:
        its broadcasts would wait for the group's timeout): lists that do not match or hold no dtype or shape
        (ValueError naming the entry), ``src`` not a trainer rank (ValueError), no group open (RuntimeError),
        unfinished requests under ``unfinished="refuse"`` (RuntimeError naming the count; ``"abort"`` and
        ``"keep"`` as in ``load_weights``), a model from a quantized checkpoint (NotImplementedError).
        """
        from atom_core.models.named_tensors import check_updatable

        specs = tensor_specs(names, dtypes, shapes)
        member = self._weight_group
        if member is None:
            raise RuntimeError("Engine.update_weights_from_distributed: no weight-update group is open "
                               "(init_weight_update_group first)")
        check_src(src, member, self._tp_size)
        check_updatable(self.model)  # (before any request is aborted)
        self._check_weight_update("Engine.update_weights_from_distributed", unfinished)
        rounds = plan_rounds(specs)
        return self._update_weights("Engine.update_weights_from_distributed", lambda: load_from_group_driver(
            self.model, self._channel, member, rounds, src=src, strict=strict, check_finite=check_finite))

    def destroy_weight_update_group(self) -> None:
        """Every engine rank leaves the weight-update group (the trainer closes its own member). Idempotent:
        nothing happens without a group."""
        member, self._weight_group = self._weight_group, None
        if member is not None:
            close_all(self._channel, member)
