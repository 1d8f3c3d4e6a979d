"""``Engine``'s sleep mode, mixed into ``Engine``: give the GPU memory the engine holds to a trainer in the same
process and take it back (vLLM's ``LLM(enable_sleep_mode=True)``, ``llm.sleep(level)``, ``llm.wake_up(tags)``, as
TRL's GRPO colocate mode calls them between rollouts).

``sleep(level)`` frees the KV pool (with the extra caches and the token state) and the CUDA graphs (with their
memory pool), and the weights: level 1 moves every parameter and buffer of the model to host memory (pinned on a
GPU), level 2 discards the parameters' values and keeps the buffers on the host (vLLM's rule: a buffer such as a
rotary cache is not among the weights a trainer sends). ``wake_up(tags)`` brings back "weights", "kv_cache" or both:
the weights into the same tensor objects (``.data`` reassigned, so ``load_weights`` and anything holding a
parameter keep working), the pool with the same plan, and the CUDA graphs once both are back.

What they use of the engine: ``model``, ``device``, ``runner``, ``enable_sleep_mode``, ``_sleep`` (the
``SleepState`` while asleep, else None), ``_channel`` (None with one rank; else the worker ranks sleep and wake with
this one: ``SleepWorker``), ``_in_flight``, ``_num_unfinished()``, ``step()``, ``reset_prefix_cache()`` and
``warmup()``.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from atom_core.engine.distributed import SLEEP

__all__ = ["SLEEP_LEVELS", "WAKE_TAGS", "EngineAsleepError", "SleepMode", "SleepState", "SleepWorker"]

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")  # vLLM's names of what wake_up brings back


class EngineAsleepError(RuntimeError):
    """What a call needs is asleep (``Engine.sleep``): ``wake_up`` first. (A server answers 503: retry later.)"""


@dataclass
class OffloadedTensor:
    """A model tensor while asleep: its values on the host (``host``), or only its layout (values discarded)."""

    tensor: torch.Tensor  # the model's own object (a Parameter or a buffer); its .data is a placeholder meanwhile
    device: torch.device
    shape: torch.Size
    stride: tuple[int, ...]
    host: torch.Tensor | None


@dataclass
class SleepState:
    """What ``sleep`` took away: its level, the tags still asleep, the offloaded weights, and whether CUDA graphs
    were captured before (they are captured again once everything is awake)."""

    level: int
    asleep: set[str] = field(default_factory=lambda: set(WAKE_TAGS))
    weights: list[OffloadedTensor] = field(default_factory=list)
    recapture: bool = False


def offload(tensor: torch.Tensor, keep_values: bool, pin: bool) -> OffloadedTensor:
    """Free ``tensor``'s device memory in place: its values copied to the host (``keep_values``; pinned memory
    when ``pin``) or dropped; ``tensor.data`` becomes the host copy, or an empty placeholder on its device."""
    host = None
    if keep_values:
        host = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu", pin_memory=pin)
        host.copy_(tensor.detach())
    saved = OffloadedTensor(tensor, tensor.device, tensor.shape, tensor.stride(), host)
    tensor.data = host if host is not None else torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return saved


def restore(saved: OffloadedTensor) -> None:
    """Give the tensor a new allocation of its shape on its device again: with the saved values, or
    uninitialised where they were discarded (the caller loads new weights)."""
    data = torch.empty_strided(saved.shape, saved.stride, dtype=saved.tensor.dtype, device=saved.device)
    if saved.host is not None:
        data.copy_(saved.host)
    saved.tensor.data = data


def offload_weights(model: torch.nn.Module, level: int, pin: bool) -> list[OffloadedTensor]:
    """Every parameter and buffer of ``model`` (each object once: a tied weight is one parameter) offloaded:
    level 1 keeps every value on the host, level 2 keeps the buffers' values only. When one fails (no host
    memory left), those offloaded before it are restored and the error raised: the model is as it was."""
    params = [(p, level == 1) for p in model.parameters()]
    buffers = [(b, True) for b in model.buffers()]
    done = []
    try:
        for tensor, keep in params + buffers:
            done.append(offload(tensor, keep, pin))
    except BaseException:
        for saved in done:  # (a failure can only come from a host copy: every one done so far kept its values)
            restore(saved)
        raise
    return done


def sleep_rank(runner, model: torch.nn.Module, level: int, device: torch.device) -> SleepState:
    """One rank's part of ``sleep``: its CUDA graphs, KV pool and weights freed; the rank as it was when the
    weights cannot be offloaded (the error raised)."""
    state = SleepState(level, recapture=runner.drop_graphs() > 0)
    runner.release_pool()
    try:
        state.weights = offload_weights(model, level, pin=device.type == "cuda")
    except BaseException:
        runner.allocate_pool()  # awake again (the CUDA graphs are captured as steps need them)
        raise
    return state


def wake_rank(state: SleepState, tags: set[str], runner) -> None:
    """One rank's part of ``wake_up``: the tags of ``tags`` still asleep brought back (the others left as they are);
    out of memory for the pool leaves "kv_cache" asleep, to be woken again."""
    if "weights" in tags & state.asleep:
        for saved in state.weights:
            restore(saved)
        state.weights = []
        state.asleep.discard("weights")
    if "kv_cache" in tags & state.asleep:
        runner.allocate_pool()
        state.asleep.discard("kv_cache")


def return_memory(device: torch.device) -> None:
    """Give the freed device memory back to the driver (the caching allocator would keep it for this process)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class SleepWorker:
    """A worker rank's side of ``SLEEP`` messages (``{"sleep": level}``, ``{"wake": tags}``): this rank's part, then
    a status exchange with the other ranks (rank 0 raises naming a rank that failed)."""

    def __init__(self, model, runner, channel) -> None:
        self.model, self.runner, self.channel = model, runner, channel
        self.state: SleepState | None = None

    def handle(self, message: dict) -> None:
        from atom_core.engine.weight_sync import error_status

        error = None
        try:
            if "sleep" in message:
                if self.state is None:
                    self.state = sleep_rank(self.runner, self.model, message["sleep"], self.channel.device)
                    return_memory(self.channel.device)
            elif self.state is not None:
                wake_rank(self.state, set(message["wake"]), self.runner)
                if not self.state.asleep:
                    self.state = None
        except Exception as e:  # noqa: BLE001 - shared with rank 0 by the status exchange
            error = e
        self.channel.exchange_status(error_status(error))


def wake_tags(tags: Iterable[str] | None) -> set[str]:
    """The tags ``wake_up`` brings back: None = all of WAKE_TAGS; ValueError naming a tag that is not one (or
    none given); TypeError for a bare string (a list of one tag is meant)."""
    if tags is None:
        return set(WAKE_TAGS)
    if isinstance(tags, str):
        raise TypeError(f"tags must be a list of tags from {list(WAKE_TAGS)}, got the string {tags!r}")
    tags = list(tags)
    unknown = [tag for tag in tags if tag not in WAKE_TAGS]
    if unknown or not tags:
        raise ValueError(f"tags must be None or a non-empty list of tags from {list(WAKE_TAGS)}, got {tags!r}")
    return set(tags)


class SleepMode:
    """The sleep-mode methods of ``Engine`` (see the module docstring for what they read of it)."""

    @property
    def is_sleeping(self) -> bool:
        """Whether ``sleep`` took something that ``wake_up`` has not brought back yet."""
        return self._sleep is not None

    def sleep(self, level: int = 1) -> None:
        """Free the GPU memory this engine holds, so a trainer in the same process can use it (vLLM's
        ``llm.sleep(level)``): the KV pool and the caches beside it, the CUDA graphs, and the weights — level 1
        moves them to host memory (pinned), level 2 discards the parameters (load new ones with ``load_weights``
        after ``wake_up``; the buffers are kept on the host). The prefix cache is reset (its KV is freed), then
        ``torch.cuda.empty_cache()`` returns the memory to the driver. On the CPU the same happens in host memory.

        Needs ``Engine(enable_sleep_mode=True)`` (RuntimeError otherwise, as vLLM refuses). Refused, changing
        nothing: a level other than 1 or 2 (ValueError), unfinished requests (RuntimeError naming the count). An
        engine already asleep logs a warning and stays as it is (vLLM's rule).

        Over several tensor-parallel ranks every rank does the same with its own pool, graphs and weight shard
        (a ``SLEEP`` message to the workers, then a status exchange); if one cannot, the ranks that slept wake
        again and this raises naming the rank. ``wake_up`` likewise: a rank that could not wake is named, and
        calling ``wake_up`` again with the same tags retries it on every rank.
        """
        self._check_sleep_mode("Engine.sleep")
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"Engine.sleep: level must be 1 (weights kept on the host) or 2 (weights discarded), "
                             f"got {level!r}")
        if self._sleep is not None:
            logger.warning("Engine.sleep: the engine is already asleep (%s)", ", ".join(sorted(self._sleep.asleep)))
            return
        if self._channel is not None:
            self._channel.check_usable()
        unfinished = self._num_unfinished()
        if unfinished:
            raise RuntimeError(f"Engine.sleep: {unfinished} requests are unfinished; their KV would be freed: let them "
                               "finish (or abort them) first")
        while self._in_flight is not None:  # a step launched ahead of its outputs: run it out (it produces nothing)
            self.step()
        if not self.reset_prefix_cache():  # (no request holds blocks: cannot happen)
            raise RuntimeError("Engine.sleep: the prefix cache could not be reset")
        if self._channel is None:
            self._sleep = sleep_rank(self.runner, self.model, level, self.device)
        else:  # every rank sleeps; when one cannot, those that did wake again and this raises
            self._channel.send(SLEEP, payload=pickle.dumps({"sleep": level}))
            state, error = None, None
            try:
                state = sleep_rank(self.runner, self.model, level, self.device)
            except Exception as e:  # noqa: BLE001 - shared with the workers by the status exchange
                error = e
            failed = self._ranks_failed(error)
            if failed:
                self._channel.send(SLEEP, payload=pickle.dumps({"wake": list(WAKE_TAGS)}))
                if state is not None:
                    wake_rank(state, set(WAKE_TAGS), self.runner)
                self._ranks_failed(None)
                raise error or RuntimeError(f"Engine.sleep: {failed}; every rank is awake again")
            self._sleep = state
        return_memory(self.device)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Bring back what ``sleep`` took (vLLM's ``llm.wake_up(tags)``): ``tags`` a list of "weights" and
        "kv_cache" (None: both), so that a trainer can wake the weights, load new ones, then wake the pool.

        "weights": every parameter and buffer gets device memory again, in the same tensor objects (the same
        ``Parameter``s; level 1: the saved values; level 2: uninitialised parameters, to be filled by
        ``load_weights``). "kv_cache": a zeroed pool of the same plan (same block count), bound to the model.
        Once both are awake the CUDA graphs are captured again (over the new addresses), when there were any.

        Needs ``enable_sleep_mode=True`` (RuntimeError). A tag that is not one of those raises ValueError (a bare
        string, TypeError). An
        engine that is not asleep, or a tag already awake, logs a warning and changes nothing (vLLM's rule).
        """
        self._check_sleep_mode("Engine.wake_up")
        tags = wake_tags(tags)
        state = self._sleep
        if state is None:
            logger.warning("Engine.wake_up: the engine is not asleep")
            return
        awake = sorted(tags - state.asleep)
        if awake:
            logger.warning("Engine.wake_up: %s already awake (asleep: %s); nothing done", ", ".join(awake),
                           ", ".join(sorted(state.asleep)) or "nothing")
            return
        if self._channel is None:  # (out of memory for the pool: the weights stay awake; wake "kv_cache" again)
            wake_rank(state, tags, self.runner)
        else:  # every rank wakes the tags it still has asleep; a rank that could not is named
            self._channel.check_usable()
            self._channel.send(SLEEP, payload=pickle.dumps({"wake": sorted(tags)}))
            error = None
            try:
                wake_rank(state, tags, self.runner)
            except Exception as e:  # noqa: BLE001 - shared with the workers by the status exchange
                error = e
            failed = self._ranks_failed(error)
            if failed:  # asleep again here too, so that the next wake_up reaches every rank (redoing it is harmless)
                state.asleep |= tags
                raise error or RuntimeError(f"Engine.wake_up: {failed}; call wake_up({sorted(tags)!r}) again")
        if state.asleep:
            return
        self._sleep = None
        if state.recapture:
            self.warmup()

    def _check_sleep_mode(self, caller: str) -> None:
        if not self.enable_sleep_mode:
            raise RuntimeError(f"{caller}: sleep mode is off; build the engine with enable_sleep_mode=True "
                               "(vLLM's flag; the serve CLI's --enable-sleep-mode)")

    def _check_awake(self, caller: str, needs: Iterable[str] = WAKE_TAGS) -> None:
        """RuntimeError naming what is asleep when ``caller`` needs any of ``needs``."""
        asleep = sorted(set(needs) & self._sleep.asleep) if self._sleep is not None else []
        if asleep:
            raise EngineAsleepError(f"{caller}: the engine is asleep ({', '.join(repr(t) for t in asleep)} asleep): "
                                    f"wake_up({asleep!r}) first")

    def _ranks_failed(self, error: BaseException | None) -> str:
        """The status exchange after a ``SLEEP`` message: "" when every rank did its part, else which failed."""
        from atom_core.engine.weight_sync import error_status

        statuses = self._channel.exchange_status(error_status(error))
        return "; ".join(f"tensor-parallel rank {rank}: {status}" for rank, status in enumerate(statuses) if status)
