"""Data parallelism: M engine replicas behind one front that routes each request to one of them.

``Engine.from_pretrained(path, data_parallel_size=M, tensor_parallel_size=N)`` returns a
``DataParallelEngine``: this process is the *front*; each *replica* is a fresh Python process (started
like the engine's worker ranks: ``sys.executable -c``, no re-import of the user's script) that builds
its own ``Engine.from_pretrained(path, tensor_parallel_size=N)`` and runs its own step loop. On CUDA,
replica i sees GPUs ``i*N .. i*N+N-1`` (``CUDA_VISIBLE_DEVICES``); on the CPU all use the CPU and share
its cores (``OMP_NUM_THREADS``). A replica with N > 1 starts its own worker ranks as any engine does.
The replica's process, its loop and the messages between front and replica: ``engine/dp_replica.py``.

A request is checked in the front (``Engine``'s own checks, with the limits the replica reported at
start), so ``add_request`` raises at once and never waits for a replica.

The front keeps a mirror ``Request`` per sequence (prompt, tokens so far, log-probs, its own
detokenizer) and returns the engine's own ``StepOutputs`` / ``RequestOutput`` over the mirrors, so the
outputs are those of ``Engine`` (text decoded in the front when read). Request ids are the front's,
unique across replicas: a replica's engine numbers a request with the front's id.

Routing: least outstanding tokens. A replica's outstanding tokens are, over its unfinished
sequences, the prompt tokens not yet prefilled (a prompt counts until its first output token) plus
``max_tokens`` less the tokens already generated; a request goes to the replica with the fewest (ties:
the lowest index). The front updates the counts from the outputs it reads, so routing decided between
two ``step()`` calls sees the state as of the last one.

Stepping: replicas run concurrently and never wait for the front (a reader thread per replica takes
their messages as they come). ``step()`` returns the outputs of every replica step finished since the
last call (a sequence may then appear once per replica step, each output with that step's token); it
blocks until at least one arrives while requests are unfinished.

Failures: a replica process that dies (its socket closes) or, while it has unfinished requests, sends
nothing for ``step_timeout`` seconds (it hangs) makes ``step()`` raise ``ReplicaFailedError`` (a
``WorkerFailedError`` naming the replica, its pid and signal); the front then finishes every unfinished
request with reason "error", stops every replica, and later calls raise ``DistributedEngineError``. A
step that raises inside a replica (its engine stays usable) raises ``ReplicaStepError`` in the front
for that step's requests only (``failed_request_ids``), like ``Engine.step``. ``shutdown()``, leaving a
``with`` block, dropping the front and the interpreter's exit stop every replica (and so their workers).
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from atom_core.cache.block_manager import PrefixCacheStats
from atom_core.engine import structured_output
from atom_core.engine.distributed import DistributedEngineError, WorkerFailedError
from atom_core.engine.dp_attention import new_world
from atom_core.engine.dp_replica import (ABORT, ADD, CLOSED, FATAL, OUTPUTS, READY, RESET_PREFIX_CACHE, START_FAILED,
                                        STATS, STEP_ERROR, ReplicaHandle, replica_main, start_replica, stop_replicas)
from atom_core.engine.engine import DEMO_MODEL
from atom_core.engine.logprobs import check_logprobs_mode
from atom_core.engine.dp_sleep import ReplicaSleepMode
from atom_core.engine.dp_weights import ReplicaWeightUpdates
from atom_core.engine.offline import OfflineAPI
from atom_core.engine.outputs import StepOutputs
from atom_core.engine.request import Request, Status, prompt_text_of, request_ids_of
from atom_core.engine.request_checks import RequestChecks
from atom_core.engine.sampling_params import SamplingParams
from atom_core.engine.tokenizer import Tokenizer
from atom_core.engine.workers import DEFAULT_STEP_TIMEOUT, STARTUP_TIMEOUT, STOP_TIMEOUT
from atom_core.models.parallel import ep_comm_of

logger = logging.getLogger(__name__)

__all__ = ["DataParallelEngine", "ReplicaFailedError", "ReplicaStepError", "replica_main"]

_WAIT_SLICE_S = 0.05  # step() checks the replicas' processes this often while it waits for outputs


class ReplicaFailedError(WorkerFailedError):
    """A replica process died, or sent nothing within ``step_timeout`` seconds while it had unfinished
    requests; the message names it (index, pid, exit status). The front has stopped every replica."""


class ReplicaStepError(RuntimeError):
    """A step raised inside a replica (its engine is still usable): that step's requests finished with
    reason "error" (``DataParallelEngine.failed_request_ids``); the other requests go on."""


@dataclass(frozen=True)
class PoolSummary:
    """The replicas' KV pools together (``DataParallelEngine.block_manager``)."""

    num_blocks: int
    num_free_blocks: int
    stats: PrefixCacheStats



class DataParallelEngine(OfflineAPI, ReplicaWeightUpdates, ReplicaSleepMode):
    """M engine replicas behind one front with ``Engine``'s API (see the module docstring).

    Built by ``Engine.from_pretrained(path, data_parallel_size=M, ...)`` (or directly with the same
    arguments): every argument but ``data_parallel_size`` goes to each replica's
    ``Engine.from_pretrained``. ``data_parallel_size=1`` is allowed (one replica in its own process).
    ``dp_attention=True`` (a MoE model, ``expert_parallel="all_to_all"``): the replicas split the experts and
    step in lock step (``engine/dp_attention.py``).

    API: ``add_request``, ``step``, ``generate``, ``chat``, ``abort``, ``has_unfinished_requests``, ``is_unfinished``,
    ``shutdown`` and the context manager, as ``Engine``'s (and ``model.config``: the replicas' model config,
    no module); ``reset_prefix_cache``, ``load_weights``, the weight-update group's methods, ``sleep`` and
    ``wake_up`` run ``Engine``'s on every replica (``engine/dp_weights.py``, ``engine/dp_sleep.py``);
    ``replica_of(request_id)`` says where a request runs, ``requests_per_replica`` how many each got.
    """

    def __init__(self, path: str | Path | None = None, *, data_parallel_size: int, tensor_parallel_size: int = 1,
                 expert_parallel: bool | str = False, dp_attention: bool = False, dtype=None, device=None,
                 load_format: str = "auto", quantization: str | None = None,
                 step_timeout: float = DEFAULT_STEP_TIMEOUT, **engine_args):
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an int >= 1, got {data_parallel_size!r}")
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
                or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
        if isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float)) or not step_timeout > 0:
            raise ValueError(f"step_timeout must be a number of seconds > 0, got {step_timeout!r}")
        ep_comm = ep_comm_of(expert_parallel)  # a bad value is refused before any replica starts
        if "logprobs_mode" in engine_args:  # likewise (each replica's Engine would refuse it at start-up)
            check_logprobs_mode(engine_args["logprobs_mode"])
        if dp_attention:
            if ep_comm != "all_to_all" or tensor_parallel_size != 1:
                raise ValueError("dp_attention=True needs expert_parallel='all_to_all' (each replica sends its own "
                                 "tokens to their experts' replicas) and tensor_parallel_size=1 (attention over "
                                 f"TP groups is not built); got expert_parallel={expert_parallel!r}, "
                                 f"tensor_parallel_size={tensor_parallel_size}")
            if not engine_args.get("enforce_eager", False) or engine_args.get("async_scheduling", True):
                logger.info("dp_attention: the replicas step eagerly and without async scheduling "
                            "(engine/dp_attention.py)")
            engine_args = engine_args | {"enforce_eager": True, "async_scheduling": False}
        if "workers" in engine_args:
            raise ValueError("workers= is for Engine(model, ...); the replicas start their own")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            raise ValueError("data_parallel_size > 1 starts its replicas itself; it does not run under torchrun "
                             "(run the script with python)")
        from atom_core.models import ParallelContext, check_buildable

        path = Path(path) if path is not None else DEMO_MODEL
        # a missing folder or config.json, or sizes a replica's ranks cannot split: refused here rather than by
        # every replica after it starts
        check_buildable(path, ParallelContext(dp_size=data_parallel_size, dp_attention=True, expert_parallel=ep_comm)
                        if dp_attention else ParallelContext(tp_size=tensor_parallel_size,
                                                             expert_parallel=expert_parallel),
                        quantization=quantization)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is not None:
            raise ValueError(f"device={str(device)!r}: with data parallelism replica i uses GPUs "
                             f"i*tensor_parallel_size.. (device='cuda'); hide GPUs with CUDA_VISIBLE_DEVICES")
        ranks = data_parallel_size * tensor_parallel_size
        visible = self._visible_gpus() if device.type == "cuda" else []
        if device.type == "cuda" and len(visible) < ranks:
            raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tensor_parallel_size} "
                             f"needs {ranks} GPUs (one per rank), this machine shows {len(visible)}")
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.device = device
        self.step_timeout = float(step_timeout)
        self.tokenizer = Tokenizer.maybe_from(path)
        self.failed_request_ids: list[int] = []
        self._failure: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._held: list[tuple[int, tuple]] = []  # messages taken from the inbox, not handled yet
        self._groups: dict[int, tuple[ReplicaHandle, list[Request]]] = {}  # unfinished requests by id
        self._sequences: dict[int, Request] = {}  # unfinished sequences by id (mirrors)
        self._prompt_pending: set[int] = set()  # requests whose prompt is not prefilled yet
        self._next_id = 0
        self._state = {"stopping": False}
        self._replicas: list[ReplicaHandle] = []
        config = {"path": str(path), "dtype": dtype, "load_format": load_format, "quantization": quantization,
                  "tensor_parallel_size": tensor_parallel_size, "expert_parallel": expert_parallel,
                  "step_timeout": step_timeout, "engine_args": engine_args}
        self.dp_attention = bool(dp_attention)
        world = new_world(data_parallel_size) if dp_attention else None
        self._finalizer = weakref.finalize(self, stop_replicas, self._replicas, self._state)
        try:
            for index in range(data_parallel_size):
                gpus = visible[index * tensor_parallel_size:(index + 1) * tensor_parallel_size]
                rank = None if world is None else world | {"rank": index}
                own = config | {"device": device.type, "dp_attention": rank}
                if engine_args.get("seed") is not None:  # replicas draw different seeds for their unseeded requests
                    own["engine_args"] = engine_args | {"seed": engine_args["seed"] + index}
                self._replicas.append(start_replica(index, gpus, ranks, own, self._inbox))
            self._wait_ready()
        except BaseException:
            for replica in self._replicas:  # still loading (deaf to a shutdown message), or failed
                if replica.process.poll() is None:
                    replica.process.kill()
            self.shutdown()
            raise
        info = self._replicas[0].info
        self.max_model_len = info["max_model_len"]
        self.max_logprobs = info["max_logprobs"]
        self.logprobs_mode = info["logprobs_mode"]
        self.default_sampling_params = info["default_sampling_params"]
        self.generation_defaults = info["generation_defaults"]
        self._eos_token_ids = info["eos_token_ids"]
        self.config = info["config"]
        # ``model.config`` as an Engine has it (what servers and benchmarks read); the model runs in the replicas.
        self.model = SimpleNamespace(config=self.config)
        # Engine's request checks, so the front refuses what a replica would, with the same messages. A
        # constraint is parsed, not compiled (no compiler over the vocabulary here; the replica compiles it,
        # and refuses the rare constraint only a compile refuses as a step error).
        self._checks = RequestChecks(self.tokenizer, self.config.vocab_size, self.max_model_len, self.max_logprobs,
                                     structured_output.check_grammar)
        logger.info("data-parallel engine: %d replicas of %s (pids %s)", data_parallel_size,
                    f"TP {tensor_parallel_size}" if tensor_parallel_size > 1 else "one rank",
                    [r.process.pid for r in self._replicas])

    # ------------------------------------------------------------------ starting and stopping

    @staticmethod
    def _visible_gpus() -> list[str]:
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        if listed is not None:
            return [d.strip() for d in listed.split(",") if d.strip()][:torch.cuda.device_count()]
        return [str(i) for i in range(torch.cuda.device_count())]

    def _wait_ready(self) -> None:
        """Wait until every replica has built its engine (while they stay alive, within STARTUP_TIMEOUT)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        waiting = {r.index for r in self._replicas}
        while waiting:
            try:
                index, message = self._inbox.get(timeout=_WAIT_SLICE_S)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise ReplicaFailedError(f"the replicas did not start within {STARTUP_TIMEOUT:g} s") from None
                continue
            replica = self._replicas[index]
            if message[0] == READY:
                replica.info = message[1]
                replica.counters = replica.info["counters"]
                waiting.discard(index)
            elif message[0] in (START_FAILED, CLOSED):
                why = f": {message[1]}" if message[0] == START_FAILED else ""
                replica.reap(STOP_TIMEOUT if message[0] == START_FAILED else 1.0)
                raise ReplicaFailedError(f"{replica.describe_exit()} while starting{why}")

    def shutdown(self) -> None:
        """Stop every replica (they stop their own worker ranks); idempotent. The front cannot step afterwards."""
        self._failure = self._failure or "the engine was shut down"
        self._finalizer()

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The replicas' processes, by replica index."""
        return [r.process for r in self._replicas]

    @property
    def requests_per_replica(self) -> list[int]:
        """Requests routed to each replica so far."""
        return [r.num_requests for r in self._replicas]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def num_preemptions(self) -> int:
        """Requests the replicas sent back to recompute, as of their last reports (see ``block_manager``)."""
        return sum(r.counters["num_preemptions"] for r in self._replicas)

    @property
    def block_manager(self) -> PoolSummary:
        """The replicas' KV pools summed (``num_blocks``, ``num_free_blocks``, prefix-cache ``stats``) as of
        their last reports: a running replica's outputs carry its counters every ``COUNTERS_EVERY_S``
        seconds (``engine/dp_replica.py``) and when it runs out of requests (what ``AsyncEngine``'s
        statistics read). ``replica_stats()`` asks for them now."""
        counters = [r.counters for r in self._replicas]
        prefix = [sum(c["prefix_cache"][i] for c in counters) for i in range(4)]
        return PoolSummary(sum(c["num_blocks"] for c in counters), sum(c["free_blocks"] for c in counters),
                           PrefixCacheStats(*prefix))

    def replica_of(self, request_id: int) -> int | None:
        """The replica running unfinished request ``request_id`` (None when finished or unknown)."""
        entry = self._groups.get(request_id)
        return None if entry is None else entry[0].index

    def replica_stats(self) -> list[dict]:
        """Each replica engine's counters, asked for now (one round trip, between its steps): ``unfinished``
        (sequences), ``unfinished_ids`` (its unfinished request ids), ``num_preemptions``, ``free_blocks`` and
        ``num_blocks`` of its KV pool, ``prefix_cache``
        (queries, hits, query tokens, hit tokens), ``steps`` and ``step_seconds`` (its ``engine.step()``
        calls so far and their time), its ``device`` and ``visible_gpus`` (its CUDA_VISIBLE_DEVICES, None
        on a CPU). Outputs that
        arrive meanwhile are kept for the next ``step()``."""
        answers = self._ask_every_replica(STATS)
        for replica, counters in zip(self._replicas, answers):
            replica.counters = counters
        return answers

    def reset_prefix_cache(self) -> bool:
        """``Engine.reset_prefix_cache`` on every replica (one round trip, between its steps); True when every
        replica reset its cache, False when one or more refused (it holds blocks of unfinished requests; the
        others did reset). Outputs that arrive meanwhile are kept for the next ``step()``."""
        return all(self._ask_every_replica(RESET_PREFIX_CACHE))

    def _send_to(self, indices: Iterable[int], payload: bytes) -> None:
        """Send one pickled message to each replica of ``indices``; one that cannot take it (its process is
        gone) fails the front (ReplicaFailedError)."""
        for index in indices:
            replica = self._replicas[index]
            try:
                replica.conn.send_bytes(payload)
            except (OSError, ValueError):
                replica.reap()
                raise self._fail(replica, ReplicaFailedError(f"{replica.describe_exit()}: it could not take a "
                                                             "message")) from None

    def _ask_every_replica(self, kind: str) -> list:
        """Send ``(kind,)`` to every replica and return their answers ``(kind, value)``' values in replica order
        (``_collect``)."""
        self._check_usable()
        for replica in self._replicas:
            replica.conn.send((kind,))
        answers = self._collect((kind,), range(len(self._replicas)))
        return [answers[i][1] for i in range(len(self._replicas))]

    def _collect(self, kinds: tuple[str, ...], indices: Iterable[int]) -> dict[int, tuple]:
        """The next message of one of ``kinds`` from each replica of ``indices`` (just asked), by index; other
        messages that arrive meanwhile are held for ``step()``. A replica that does not answer within
        step_timeout, or dies, fails the front (ReplicaFailedError)."""
        owing, asked = set(indices), time.monotonic()
        answers: dict[int, tuple] = {}
        while owing:
            index, message = self._wait_for_message(owing=owing, since=asked)
            if index in owing and message[0] in kinds:
                answers[index] = message
                owing.discard(index)
            else:
                self._held.append((index, message))
        return answers

    def check_health(self) -> None:
        """Raise ``DistributedEngineError`` naming why the replicas can no longer step: one of their processes
        has exited or said its engine cannot run (an idle replica checks its own worker ranks), or a step
        failed. Reads what the replicas' reader threads recorded and their exit statuses only (a server's
        health check; safe beside a thread that steps)."""
        self._check_usable()
        for replica in self._replicas:
            if replica.fatal is not None:
                raise ReplicaFailedError(f"this data-parallel engine can no longer run: {replica.describe_exit()}: "
                                         f"its engine can no longer run ({replica.fatal})")
            if replica.process.poll() is not None:
                raise ReplicaFailedError(f"this data-parallel engine can no longer run: {replica.describe_exit()}")

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise DistributedEngineError(f"this data-parallel engine can no longer run: {self._failure}")

    def _fail(self, replica: ReplicaHandle, error: ReplicaFailedError) -> ReplicaFailedError:
        """``replica`` failed: kill it (it may hang), finish every unfinished request with "error", stop the
        other replicas."""
        if replica.process.poll() is None:
            replica.process.kill()
            replica.process.wait()
        self._failure = str(error)
        self.failed_request_ids = sorted(self._groups)
        for owner, group in list(self._groups.values()):
            for request in group:
                if not request.finished:
                    self._finish(owner, request, "error")
        self._finalizer()
        return error

    # ------------------------------------------------------------------ requests

    def _check_request(self, prompt, params) -> tuple[list[int], SamplingParams]:
        params = self.default_sampling_params if params is None else params
        return self._checks.check(prompt, params)

    def add_request(self, prompt, params: SamplingParams | None = None, *, prompt_text: str | None = None) -> int:
        """Queue a prompt on the replica with the fewest outstanding tokens; returns its request id (unique
        over the replicas). Raises (and queues nothing) as ``Engine.add_request`` does; ``prompt_text`` as there
        (kept on the front's mirrors)."""
        token_ids, params = self._check_request(prompt, params)
        prompt_text = prompt_text_of(prompt, prompt_text)
        self._check_usable()
        self._check_awake("DataParallelEngine.add_request")
        replica = min(self._replicas, key=lambda r: (r.outstanding, r.index))
        group_id = self._next_id
        try:
            replica.conn.send((ADD, group_id, np.asarray(token_ids, dtype=np.int64), params))
        except (OSError, ValueError):
            replica.reap()
            error = ReplicaFailedError(f"{replica.describe_exit()}: it could not take a request")
            raise self._fail(replica, error) from None
        self._next_id += params.n
        group = [Request(group_id + index, token_ids, params, 0, group_id=group_id, index=index,
                         tokenizer=self.tokenizer, prompt=prompt_text) for index in range(params.n)]
        for request in group:
            request.status = Status.RUNNING
            self._sequences[request.request_id] = request
        self._groups[group_id] = (replica, group)
        self._prompt_pending.add(group_id)
        if replica.num_unfinished == 0:
            replica.last_heard = time.monotonic()  # the step_timeout of an idle replica counts from here
        replica.outstanding += len(token_ids) + params.n * params.max_tokens
        replica.num_unfinished += params.n
        replica.num_requests += 1
        return group_id

    def abort(self, request_id: int | Iterable[int]) -> None:
        """Stop a request (all its ``n`` sequences) now, or each of an iterable of ids, as ``Engine.abort``;
        unknown or finished ids are ignored. Outputs its replica made before it read the abort are dropped."""
        for one in request_ids_of(request_id):
            replica, group = self._groups.get(one, (None, ()))
            if replica is not None and self._failure is None:
                try:
                    replica.conn.send((ABORT, one))
                except (OSError, ValueError):  # a dead replica: step() says so
                    pass
            for request in group:
                if not request.finished:
                    self._finish(replica, request, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def is_unfinished(self, request_id: int) -> bool:
        """Whether the request (what ``add_request`` returned) has a sequence still to finish."""
        return request_id in self._groups

    def _num_unfinished(self) -> int:
        return len(self._sequences)

    def _finish(self, replica: ReplicaHandle, request: Request, reason: str) -> None:
        request.status = Status.FINISHED
        request.finish_reason = reason
        replica.outstanding -= request.params.max_tokens - request.num_output_tokens
        replica.num_unfinished -= 1
        del self._sequences[request.request_id]
        group_id = request.group_id
        if group_id in self._prompt_pending and all(r.finished for r in self._groups[group_id][1]):
            self._prompt_pending.discard(group_id)
            replica.outstanding -= request.num_prompt_tokens
        if all(r.finished for r in self._groups[group_id][1]):
            del self._groups[group_id]

    # ------------------------------------------------------------------ stepping

    def step(self) -> StepOutputs:
        """The outputs of every replica step finished since the last call (a sequence that got several
        tokens meanwhile has one output per token, in order). Blocks until one arrives while requests are
        unfinished. Raises ``ReplicaFailedError`` for a replica that died or hangs, ``ReplicaStepError``
        for a step that raised in a replica (after returning the outputs that came before it)."""
        self._check_usable()
        messages = self._take_messages(block=bool(self._groups))
        requests, tokens, num_tokens, finish_reasons = [], [], [], {}
        for position, (index, message) in enumerate(messages):
            kind = message[0]
            if kind == OUTPUTS:
                self._apply(self._replicas[index], message, requests, tokens, num_tokens, finish_reasons)
            elif kind in (STEP_ERROR, FATAL, CLOSED):
                if requests:  # first what came before it; the error at the next call
                    self._held = messages[position:] + self._held
                    break
                self._held = messages[position + 1:] + self._held
                self._raise_for(self._replicas[index], message)
        if not requests:
            return StepOutputs([], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), {})
        return StepOutputs(requests, np.concatenate(tokens), np.concatenate(num_tokens), finish_reasons)

    def _take_messages(self, block: bool) -> list[tuple[int, tuple]]:
        messages, self._held = self._held, []
        inbox = self._inbox
        if not messages and block:
            messages.append(self._wait_for_message())
        while True:
            try:
                messages.append(inbox.get_nowait())
            except queue.Empty:
                break
        # Also while other replicas keep sending: a hung one must not hide behind their messages. (A replica with
        # messages here, not applied yet, is not hung: a caller that steps late finds its last outputs waiting.)
        self._raise_if_hung(time.monotonic(), exempt={index for index, _ in messages})
        return messages

    def _wait_for_message(self, owing: set[int] = frozenset(), since: float = 0.0) -> tuple[int, tuple]:
        """The next message of any replica; a replica that died or hangs raises ReplicaFailedError, and so
        does one of ``owing`` (asked for an answer at ``since``) that has not answered within step_timeout."""
        while True:
            try:
                return self._inbox.get(timeout=_WAIT_SLICE_S)
            except queue.Empty:
                pass
            for replica in self._replicas:
                if replica.process.poll() is not None:
                    replica.reap()
                    raise self._fail(replica, ReplicaFailedError(f"{replica.describe_exit()}"))
            now = time.monotonic()
            self._raise_if_hung(now)
            if owing and now - since > self.step_timeout:
                replica = self._replicas[min(owing)]
                raise self._fail(replica, ReplicaFailedError(
                    f"{replica.describe_exit()} did not answer within step_timeout={self.step_timeout:g} s: it hangs"))

    def _raise_if_hung(self, now: float, exempt: set[int] = frozenset()) -> None:
        """ReplicaFailedError for a replica with unfinished sequences that sent nothing for step_timeout
        (its reader thread stamps every message as it arrives), unless its index is in ``exempt``."""
        for replica in self._replicas:
            if replica.index not in exempt and replica.num_unfinished and now - replica.last_heard > self.step_timeout:
                raise self._fail(replica, ReplicaFailedError(
                    f"{replica.describe_exit()} sent nothing within step_timeout={self.step_timeout:g} s while "
                    f"running {replica.num_unfinished} sequences: it hangs"))

    def _raise_for(self, replica: ReplicaHandle, message: tuple) -> None:
        kind = message[0]
        if kind == STEP_ERROR:
            _, failed_ids, error = message
            self.failed_request_ids = [i for i in failed_ids if i in self._groups]
            for group_id in self.failed_request_ids:
                for request in self._groups[group_id][1]:
                    if not request.finished:
                        self._finish(replica, request, "error")
            raise ReplicaStepError(f"replica {replica.index}: a step raised {error}")
        if kind == FATAL:
            replica.reap(STOP_TIMEOUT)
            raise self._fail(replica, ReplicaFailedError(f"{replica.describe_exit()}: its engine can no longer run "
                                                f"({message[1]})"))
        if self._state["stopping"]:
            return
        replica.reap()
        raise self._fail(replica, ReplicaFailedError(f"{replica.describe_exit()}"))

    def _apply(self, replica: ReplicaHandle, message: tuple, requests: list, tokens: list, num_tokens: list,
               finish_reasons: dict) -> None:
        """Append one replica step's tokens to the mirrors (dropping aborted sequences' ones), record its
        extras and finishes, and add its outputs to the step's lists."""
        _, sequence_ids, new_tokens, counts, extras, finishes, counters = message
        if counters is not None:
            replica.counters = counters
        sequences, offset = self._sequences, len(requests)
        step_requests, keep = [], []
        for j, (sequence_id, token) in enumerate(zip(sequence_ids, new_tokens.tolist())):
            request = sequences.get(sequence_id)
            if request is None:  # aborted (or failed) since the replica ran the step
                continue
            request.token_ids.append(token)
            step_requests.append(request)
            keep.append(j)
        if len(keep) != len(sequence_ids):
            new_tokens, counts = new_tokens[keep], counts[keep]
        replica.outstanding -= len(step_requests)
        for sequence_id, (logprob, rank, top, prompt_logprobs, num_cached_tokens) in extras.items():
            request = sequences.get(sequence_id)
            if request is None:
                continue
            if logprob is not None and request.logprobs is not None:
                request.logprobs.append(logprob)
                request.logprob_ranks.append(rank)
                if top is not None and request.top_logprobs is not None:
                    request.top_logprobs.append(top)
            if prompt_logprobs is not None:
                request.prompt_logprobs, request.prompt_logprob_ranks, request.prompt_top_logprobs = prompt_logprobs
            if num_cached_tokens is not None:
                request.num_cached_tokens = num_cached_tokens
            if request.group_id in self._prompt_pending:  # its first token: the prompt is prefilled
                self._prompt_pending.discard(request.group_id)
                replica.outstanding -= request.num_prompt_tokens
        positions = {sequence_id: offset + i for i, sequence_id in
                     enumerate(r.request_id for r in step_requests)} if finishes else {}
        for sequence_id, reason, stop_reason, final_tokens, final_chars, num_cached_tokens in finishes:
            request = sequences.get(sequence_id)
            if request is None:
                continue
            request.stop_reason = stop_reason
            request.num_cached_tokens = num_cached_tokens
            if request.detokenizer is not None and final_tokens is not None:
                request.detokenizer.finish(final_tokens, final_chars)
            self._finish(replica, request, reason)
            finish_reasons[positions[sequence_id]] = reason
        requests.extend(step_requests)
        tokens.append(new_tokens)
        num_tokens.append(counts)
