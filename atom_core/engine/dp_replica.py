"""One replica of a data-parallel engine: its process (started, read and stopped by the front, the
``DataParallelEngine`` of ``engine/data_parallel.py``), what runs inside it, and the messages between the two.

A replica is a fresh Python process started like the engine's worker ranks (``start_interpreter``:
``sys.executable -c``, no re-import of the user's script) that builds its own ``Engine.from_pretrained``
with the arguments the front sends first, then runs its own step loop (``replica_main``). It leaves when
the front says shutdown, when its socket closes, or when the front's process is gone.

Front <-> replica: one Unix socket pair per replica (``multiprocessing.connection``, pickled tuples).

- front -> replica: ``("config", engine arguments)`` once, then ``("add", request id, prompt token ids,
  SamplingParams)``, ``("abort", id)``, ``("stats",)`` (answered with the replica engine's counters),
  ``("reset_prefix_cache",)`` (answered with ``("reset_prefix_cache", its engine's bool)``), ``("shutdown",)``;
  new weights (``DataParallelEngine.load_weights``): ``("load_weights", {"strict", "check_finite"})`` starts
  one ``Engine.load_weights`` call over the rounds that follow, ``("weights", {"file": path, "nbytes": its size,
  "tensors": [(name, dtype, shape, byte offset)]})`` each: the round's tensors are not in the message but in
  one shared-memory file the front wrote once for all replicas, which each maps and reads its tensors from as
  views (``engine/shared_round.py``; torch's multiprocessing tensor handles cannot be used: a process the front
  did not fork cannot open them), until ``("weights", {"end": True})`` or ``("weights", {"abort": why})``; each
  round taken is answered with ``("weights",)`` (the front then removes the round's file), and the load's end
  with ``("load_weights", LoadReport or None, error text or "")`` (``_WeightRounds``).
- replica -> front: ``("ready", its limits and counters)`` or ``("start_failed", why)`` once its engine is
  built (or not); then after each of its steps the step's outputs as arrays (sequence ids, new tokens,
  token counts), the finished sequences (reason, stop reason, where the final text ends), for the few
  sequences that need them log-probs, prompt log-probs and prefix-cache hits, and every COUNTERS_EVERY_S
  seconds its engine's counters (pool, preemptions, prefix cache) (``_outputs_message``);
  ``("step_error", request ids, why)`` for a step that raised (its engine stays usable);
  ``("fatal", why)`` when its engine can no longer run (found by a step, or while idle: a worker rank of its
  own has exited; the replica then leaves).

With DP attention (``config["dp_attention"]``: its rank, the world's size and rendezvous) the replica first
joins the replicas' world, builds its model over it, and serves in lock step with its peers
(``_serve_in_lock_step``; ``engine/dp_attention.py``).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import numpy as np
import torch

from atom_core.engine.distributed import DistributedEngineError
from atom_core.engine.dp_attention import IDLE_WAIT_S, LockStep, join_world
from atom_core.engine.engine import Engine
from atom_core.engine.outputs import StepOutputs
from atom_core.engine.request import Request
from atom_core.engine.shared_round import read_round
from atom_core.engine.workers import (
    STOP_TIMEOUT,
    exit_status,
    start_interpreter,
    stop_processes,
    watch_parent,
)

if TYPE_CHECKING:
    from atom_core.models.loader import LoadReport

__all__ = ["ReplicaHandle", "replica_main", "start_replica", "stop_replicas"]

# front -> replica
CONFIG, ADD, ABORT, STATS, RESET_PREFIX_CACHE, SHUTDOWN = "config", "add", "abort", "stats", "reset_prefix_cache", \
    "shutdown"
# front -> replica, and its answers (DataParallelEngine.load_weights; see the module docstring)
LOAD_WEIGHTS, WEIGHTS = "load_weights", "weights"
# front -> replica: ("sleep", {"sleep": level} or {"wake": tags}), answered ("sleep", "" or why it failed)
SLEEP = "sleep"
# front -> replica: ("weight_group", (method, kwargs)), one of the engine's weight-update group methods, answered
# ("weight_group", its result, "" or why it failed) (engine/dp_weights.py)
WEIGHT_GROUP = "weight_group"
WEIGHT_GROUP_METHODS = ("init_weight_update_group", "update_weights_from_distributed", "destroy_weight_update_group")
# replica -> front (CLOSED: put by the front's reader thread when the socket closes)
READY, START_FAILED, OUTPUTS, STEP_ERROR, FATAL, CLOSED = "ready", "start_failed", "outputs", "step_error", "fatal", \
    "closed"
FD_ENV = "ATOM_CORE_REPLICA_FD"
FRONT_ENV = "ATOM_CORE_FRONT_PID"
# A replica builds its own world (or none): a launcher's variables in the front's environment are not its own.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ATOM_CORE_WORKER_ARGS", "ATOM_CORE_PARENT_PID")
_ENTRY = "from atom_core.engine.dp_replica import replica_main; replica_main()"
COUNTERS_EVERY_S = 0.5  # a running replica's outputs carry its engine's counters this often (and when it idles)
HEALTH_EVERY_S = 1.0  # an idle replica checks that its own worker ranks still run this often


# ---- the front's side -----------------------------------------------------------------------------------------------

class ReplicaHandle:
    """The front's handle on one replica: its process, its socket, its load."""

    def __init__(self, index: int, process: subprocess.Popen, conn: Connection):
        self.index, self.process, self.conn = index, process, conn
        self.info: dict | None = None  # what it reported when its engine was built
        self.counters: dict = {}  # its engine's counters as of its last report (_counters)
        self.outstanding = 0  # tokens it still has to compute at most (routing: see engine/data_parallel.py)
        self.num_unfinished = 0  # its unfinished sequences
        self.num_requests = 0  # requests routed to it so far
        self.last_heard = time.monotonic()  # its last message (or the moment it got work while idle)
        self.fatal: str | None = None  # why its engine can no longer run, once it said so (FATAL)

    def describe_exit(self) -> str:
        code = self.process.poll()
        if code is None:
            return f"replica {self.index} (pid {self.process.pid})"
        return f"replica {self.index} (pid {self.process.pid}) {exit_status(code)}"

    def reap(self, timeout: float = 1.0) -> None:
        """Its socket closed: give its process a moment to be reaped (so its exit status is known)."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def start_replica(index: int, gpus: list[str], ranks: int, config: dict, inbox: queue.Queue) -> ReplicaHandle:
    """Start replica ``index`` on ``gpus`` (its CUDA_VISIBLE_DEVICES; none on the CPU, where ``ranks``
    processes share the cores), send it ``config`` (its ``Engine.from_pretrained`` arguments) and start the
    thread that puts its messages into ``inbox`` as ``(index, message)``."""
    try:  # before the process starts: a send that fails after would leave it running
        pickle.dumps(config)
    except Exception as e:  # (pickle raises several kinds)
        raise TypeError(f"the replicas' engine arguments go to other processes and must be picklable: {e}") from e
    ours, theirs = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env |= {FD_ENV: str(theirs.fileno()), FRONT_ENV: str(os.getpid())}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    try:
        process = start_interpreter(_ENTRY, env, cores_shared_by=ranks, pass_fds=(theirs.fileno(),))
    finally:
        theirs.close()
    conn = Connection(ours.detach())
    replica = ReplicaHandle(index, process, conn)
    conn.send((CONFIG, config))
    threading.Thread(target=_read_messages, args=(conn, index, inbox, replica), daemon=True,
                     name=f"atom_core-replica-{index}").start()
    return replica


def _read_messages(conn: Connection, index: int, inbox: queue.Queue, replica: ReplicaHandle) -> None:
    """A reader thread: every message of replica ``index`` into ``inbox`` as it comes (so a replica never
    waits for the front to read), then CLOSED when its socket closes."""
    try:
        while True:
            message = conn.recv()
            replica.last_heard = time.monotonic()
            if message[0] == FATAL:
                replica.fatal = message[1]
            inbox.put((index, message))
    except (EOFError, OSError):
        inbox.put((index, (CLOSED,)))


def stop_replicas(replicas: list[ReplicaHandle], state: dict) -> None:
    """Tell every replica to leave, wait up to STOP_TIMEOUT, kill and reap what is left. Holds no
    reference to the front (it runs when the front is dropped, or at exit)."""
    state["stopping"] = True
    for replica in replicas:
        if replica.process.poll() is None:
            try:
                replica.conn.send((SHUTDOWN,))
            except (OSError, ValueError):  # gone already: killed below if still there
                pass
    stop_processes([r.process for r in replicas], STOP_TIMEOUT)
    for replica in replicas:
        replica.conn.close()


# ---- the replica process --------------------------------------------------------------------------------------------

def replica_main() -> None:
    """A replica started by a ``DataParallelEngine``: build the engine it was given, then serve the front
    until it says shutdown (or its socket closes)."""
    conn = Connection(int(os.environ[FD_ENV]))
    watch_parent(int(os.environ[FRONT_ENV]))  # the front is gone: nothing is left to serve
    try:
        _, config = conn.recv()
    except (EOFError, OSError):  # the front is gone before it sent the engine's arguments
        os._exit(1)
    try:
        if config["device"] == "cpu":
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        lock_step, parallel = None, None
        if config.get("dp_attention") is not None:  # one DP rank of the replicas' world (engine/dp_attention.py)
            parallel, lock_step = join_world(config["dp_attention"], config["device"], config["step_timeout"])
        engine = Engine.from_pretrained(config["path"], dtype=config["dtype"], device=config["device"],
                                        load_format=config["load_format"], quantization=config["quantization"],
                                        tensor_parallel_size=config["tensor_parallel_size"],
                                        expert_parallel=config["expert_parallel"],
                                        step_timeout=config["step_timeout"], parallel=parallel,
                                        **config["engine_args"])
    except BaseException as error:  # noqa: BLE001 - reported to the front (a missing file too), then the process ends
        traceback.print_exc()
        try:
            conn.send((START_FAILED, f"{type(error).__name__}: {error}"[:2000]))
        except (OSError, ValueError):  # the front is gone: nobody to tell
            pass
        finally:
            os._exit(1)
    conn.send((READY, {"max_model_len": engine.max_model_len, "max_logprobs": engine.max_logprobs,
                       "logprobs_mode": engine.logprobs_mode,
                       "default_sampling_params": engine.default_sampling_params,
                       "generation_defaults": engine.generation_defaults,
                       "eos_token_ids": engine.eos_token_ids, "config": engine.model.config,
                       "counters": _counters(engine), "pid": os.getpid()}))
    code = 1
    try:
        served = _serve(engine, conn) if lock_step is None else _serve_in_lock_step(engine, conn, lock_step)
        code = 0 if served else 1
    except (EOFError, OSError):  # the front is gone
        pass
    except BaseException as error:  # a failure of this loop itself: tell the front why before leaving
        try:
            conn.send((FATAL, f"{type(error).__name__}: {error}"[:2000]))
        except (OSError, ValueError):
            pass
        raise
    finally:
        engine.shutdown()  # (its worker ranks, if any, are stopped and reaped here)
        conn.close()
        if lock_step is not None and code == 0:  # (after a failure the peers may be gone: no collective)
            lock_step.close()
    # Nothing is left to clean up: skip the interpreter's teardown (seconds of torch's exit handlers).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _weight_group_call(engine: Engine, method: str, kwargs: dict) -> tuple[LoadReport | None, str]:
    """The engine's weight-update group ``method`` (one of ``WEIGHT_GROUP_METHODS``) with ``kwargs``: (its result,
    "" when done, else why it failed)."""
    from atom_core.engine.weight_sync import error_status

    if method not in WEIGHT_GROUP_METHODS:
        return None, f"ValueError: no weight-group method {method!r}"
    try:
        return getattr(engine, method)(**kwargs), ""
    except Exception as error:  # noqa: BLE001 - told to the front, which names this replica
        return None, error_status(error)


def _sleep_or_wake(engine: Engine, message: dict) -> str:
    """The engine's ``sleep(level)`` or ``wake_up(tags)`` of ``message``; "" when done, else why it failed."""
    from atom_core.engine.weight_sync import error_status

    try:
        if "sleep" in message:
            engine.sleep(message["sleep"])
        elif engine.is_sleeping:
            engine.wake_up(message["wake"])
    except Exception as error:  # noqa: BLE001 - told to the front, which names this replica
        return error_status(error)
    return ""


class _Session:
    """What the replica's loop keeps between commands and steps."""

    def __init__(self, engine: Engine, conn: Connection, lock_step: LockStep | None) -> None:
        self.engine, self.conn, self.lock_step = engine, conn, lock_step
        self.watched: dict[int, Request] = {}  # sequences whose next output carries extras (_outputs_message)
        self.last_counters = time.monotonic()
        self.timing = {"steps": 0, "step_seconds": 0.0}  # engine.step() calls and the time spent in them

    def handle(self, command: tuple) -> bool:
        """Carry out one command of the front; True for shutdown."""
        engine, conn = self.engine, self.conn
        if command[0] == ADD:
            _, group_id, token_ids, params = command
            engine._next_id = group_id  # the front's id, unique over the replicas (it reserved n ids)
            try:
                engine.add_request(token_ids, params)
            except Exception as error:  # noqa: BLE001 - the front checked it; what only the engine knows
                conn.send((STEP_ERROR, [group_id], f"(add_request) {type(error).__name__}: {error}"))
                return False
            for request in engine._requests[group_id]:
                self.watched[request.request_id] = request
        elif command[0] == ABORT:
            engine.abort(command[1])
            _forget_finished(self.watched)
        elif command[0] == STATS:
            conn.send((STATS, self.counters()))
        elif command[0] == RESET_PREFIX_CACHE:
            conn.send((RESET_PREFIX_CACHE, engine.reset_prefix_cache()))
        elif command[0] == LOAD_WEIGHTS:
            rounds = _WeightRounds(conn)
            conn.send((LOAD_WEIGHTS, *rounds.load(engine, command[1])))
            return rounds.shutdown
        elif command[0] == WEIGHTS:
            pass  # a round sent before the front heard that this replica's load had ended (refused): dropped
        elif command[0] == SLEEP:  # DataParallelEngine.sleep / wake_up (engine/dp_sleep.py)
            conn.send((SLEEP, _sleep_or_wake(engine, command[1])))
        elif command[0] == WEIGHT_GROUP:  # DataParallelEngine's weight-update group (engine/dp_weights.py)
            conn.send((WEIGHT_GROUP, *_weight_group_call(engine, *command[1])))
        elif command[0] == SHUTDOWN:
            return True
        return False

    def healthy(self) -> bool:
        """Whether the engine can still step (``Engine.check_health``); if not, the front is told why (FATAL)."""
        try:
            self.engine.check_health()
        except DistributedEngineError as error:
            self.conn.send((FATAL, f"{type(error).__name__}: {error}"))
            return False
        return True

    def counters(self) -> dict:
        """The engine's counters and the loop's timing (in lock step, also the forwards run for the peers)."""
        extra = {} if self.lock_step is None else {"idle_forwards": self.lock_step.idle_forwards}
        return _counters(self.engine, self.timing | extra)

    def step(self) -> bool:
        """One engine step and its outputs to the front; False when the engine can no longer run. In lock
        step, exactly one forward: a step that ran none (it failed before its forward, or had nothing to
        schedule) is followed by an idle forward; one that failed after its forward began is fatal, as
        the peers may wait inside that forward's exchange."""
        engine, conn = self.engine, self.conn
        start, forwards = time.perf_counter(), engine.runner.num_forwards
        try:
            outputs = engine.step()
        except DistributedEngineError as error:  # its own worker ranks failed: this replica cannot go on
            conn.send((FATAL, f"{type(error).__name__}: {error}"))
            return False
        except Exception as error:  # noqa: BLE001 - the step's requests finished with "error"; others go on
            if self.lock_step is not None and engine.runner.num_forwards != forwards:
                conn.send((FATAL, f"DP attention: a step failed inside its forward, where the peer replicas "
                                  f"exchange tokens ({type(error).__name__}: {error})"[:2000]))
                return False
            if self.lock_step is not None:
                self.lock_step.idle(engine)
            _forget_finished(self.watched)
            conn.send((STEP_ERROR, list(engine.failed_request_ids), f"{type(error).__name__}: {error}"))
            return True
        if self.lock_step is not None and engine.runner.num_forwards == forwards:
            self.lock_step.idle(engine)
        self.timing["steps"] += 1
        self.timing["step_seconds"] += time.perf_counter() - start
        now = time.monotonic()
        counters = None
        if now - self.last_counters >= COUNTERS_EVERY_S or not engine.has_unfinished_requests():
            counters, self.last_counters = self.counters(), now
        conn.send(_outputs_message(outputs, self.watched) + (counters,))
        return True


class _LoadStopped(Exception):
    """The front stopped this replica's weight load: another replica refused a round, or the caller's
    iterable failed (``{"abort": why}``), or the front shut down."""


class _WeightRounds:
    """A replica's side of ``DataParallelEngine.load_weights``: ``pairs()`` is the generator its one
    ``Engine.load_weights`` call reads (so its report, ``process_weights_after_loading`` and prefix-cache reset
    cover every round), taking the front's rounds one at a time: it holds one round's tensors at most (views into
    that round's shared file: ``load_named_tensors`` copies them into the model)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.shutdown = False  # the front said shutdown during the load: the replica leaves after it

    def load(self, engine: Engine, options: dict) -> tuple[LoadReport | None, str]:
        """``engine.load_weights`` over the rounds: (its report, "") or (None, the error's text). The engine
        serves on either way (a refused tensor stops the load there, as ``Engine.load_weights`` does)."""
        try:
            return engine.load_weights(self.pairs(), **options), ""
        except Exception as error:  # noqa: BLE001 - the front raises it, naming this replica
            return None, f"{type(error).__name__}: {error}"[:2000]

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The front's pairs, round after round, until its end (return) or its abort (_LoadStopped)."""
        while True:
            command = self.conn.recv()
            if command[0] == SHUTDOWN:
                self.shutdown = True
                raise _LoadStopped("the front shut down")
            if command[0] != WEIGHTS:
                raise RuntimeError(f"a replica loading weights got a {command[0]!r} message")
            message = command[1]
            del command
            if "abort" in message:
                raise _LoadStopped(message["abort"])
            if "end" in message:
                return
            batch = read_round(message)  # views into the round's file, mapped here (the mapping lives with them)
            del message
            yield from batch
            del batch  # (before the next round arrives)
            # Every pair of the round is taken (loaded; or, with TP workers, in the engine's own stream to
            # them, which reports a refusal in a later round or at the end): the front may send the next.
            self.conn.send((WEIGHTS,))


def _serve(engine: Engine, conn: Connection) -> bool:
    """The replica's loop: take the front's commands (without waiting while requests run), step, send the
    step's outputs. Returns True when the front said shutdown, False when the engine can no longer run. While
    idle it checks its engine's health every HEALTH_EVERY_S (a worker rank of its own that died): the process
    then leaves, so the front's health check sees it before any request is routed there."""
    session = _Session(engine, conn, None)
    while True:
        busy = engine.has_unfinished_requests()
        while not busy or conn.poll():
            if not busy and not conn.poll(HEALTH_EVERY_S):
                if not session.healthy():
                    return False
                continue
            if session.handle(conn.recv()):
                return True
            busy = engine.has_unfinished_requests()
        if not session.step():
            return False


def _serve_in_lock_step(engine: Engine, conn: Connection, lock_step: LockStep) -> bool:
    """``_serve`` for a DP-attention rank (``engine/dp_attention.py``): between the front's commands the ranks
    agree; every rank steps when any has work (its own step, or an idle forward), and all leave together.

    A weight load (``LOAD_WEIGHTS``) waits for the next agreement and runs on every rank after it: a rank that
    loaded at once could keep its peer waiting in the agreement while the front waits for that peer's answer
    to a round. The load itself has no collective (each rank keeps its own experts' tensors)."""
    session = _Session(engine, conn, lock_step)
    leaving, anyone_busy, load = False, False, None
    last_health = time.monotonic()
    while True:
        wait = 0.0 if anyone_busy or engine.has_unfinished_requests() else IDLE_WAIT_S
        while not leaving and load is None and conn.poll(wait):
            command = conn.recv()
            if command[0] == LOAD_WEIGHTS:
                load = command  # carried out after the agreement (see above)
            else:
                leaving = session.handle(command)
            wait = 0.0
        busy = engine.has_unfinished_requests()
        try:
            anyone_busy, anyone_leaving, anyone_loading = lock_step.agree(busy, leaving, load is not None)
        except Exception as error:  # noqa: BLE001 - a peer is gone or out of step: this world cannot go on
            conn.send((FATAL, f"DP attention: the replicas' agreement before a step failed, a peer replica is gone "
                              f"or hung ({type(error).__name__}: {error})"[:2000]))
            return False
        if anyone_leaving:
            return True
        if anyone_loading:  # every rank: the front sent the load to each
            load = load or _next_load(session, conn)
            leaving = load is None or session.handle(load)
            load = None
            continue
        if not anyone_busy:
            if time.monotonic() - last_health >= HEALTH_EVERY_S:
                if not session.healthy():
                    return False
                last_health = time.monotonic()
            continue
        if not busy:
            lock_step.idle(engine)
        elif not session.step():
            return False


def _next_load(session: _Session, conn: Connection) -> tuple | None:
    """This rank's ``LOAD_WEIGHTS`` command, once a peer has one (the front sends it to every replica),
    carrying out the front's commands that come before it; None if the front says shutdown first."""
    while True:
        command = conn.recv()
        if command[0] == LOAD_WEIGHTS:
            return command
        if session.handle(command):
            return None


def _forget_finished(watched: dict[int, Request]) -> None:
    """Drop the sequences that finished without an output saying so (aborted, or failed in a step)."""
    for sequence_id in [i for i, request in watched.items() if request.finished]:
        del watched[sequence_id]


def _counters(engine: Engine, timing: dict | None = None) -> dict:
    """A replica engine's counters (``DataParallelEngine.replica_stats``); ``timing``: its steps so far."""
    bm = engine.block_manager
    prefix = bm.stats
    return {"unfinished": engine._num_unfinished(), "unfinished_ids": sorted(engine._requests),
            "num_preemptions": engine.num_preemptions,
            "free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks,
            "prefix_cache": (prefix.queries, prefix.hits, prefix.query_tokens, prefix.hit_tokens),
            "device": str(engine.device), "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
            **(timing or {"steps": 0, "step_seconds": 0.0})}


def _outputs_message(outputs: StepOutputs, watched: dict[int, Request]) -> tuple:
    """One step's outputs for the front: (OUTPUTS, sequence ids, new tokens int64 [K], token counts int64
    [K], extras {sequence id: (log-prob, its rank, top log-probs, (prompt log-probs, their ranks, prompt top)
    or None, prefix-cache hits or None)} for the watched sequences (a first token, or log-probs asked for),
    finishes [(sequence id, reason, stop reason, final text tokens, final text chars, prefix-cache hits)])."""
    requests = outputs._requests
    sequence_ids = [r.request_id for r in requests]
    extras = {}
    if watched:
        for i, sequence_id in enumerate(sequence_ids):
            request = watched.get(sequence_id)
            if request is None:
                continue
            num_output = int(outputs._num_tokens[i]) - request.num_prompt_tokens
            first = num_output == 1
            logprob = rank = top = None
            if request.logprobs is not None:
                logprob, rank = request.logprobs[num_output - 1], request.logprob_ranks[num_output - 1]
                top = None if request.top_logprobs is None else request.top_logprobs[num_output - 1]
            prompt = None
            if first and request.prompt_logprobs is not None:
                prompt = (list(request.prompt_logprobs), list(request.prompt_logprob_ranks),
                          None if request.prompt_top_logprobs is None else list(request.prompt_top_logprobs))
            extras[sequence_id] = (logprob, rank, top, prompt, request.num_cached_tokens if first else None)
            if request.logprobs is None:
                del watched[sequence_id]
    finishes = []
    for i, reason in outputs._finish_reasons.items():
        request = requests[i]
        watched.pop(request.request_id, None)
        detokenizer = request.detokenizer
        finishes.append((request.request_id, reason, request.stop_reason,
                         None if detokenizer is None else detokenizer.final_tokens,
                         None if detokenizer is None else detokenizer.final_chars, request.num_cached_tokens))
    return (OUTPUTS, sequence_ids, np.asarray(outputs._new_token_ids, dtype=np.int64),
            np.asarray(outputs._num_tokens, dtype=np.int64), extras, finishes)
