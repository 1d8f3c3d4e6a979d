"""The ranks of a multi-rank engine: starting them, the worker loop, and stopping them.

Two ways the ranks come to exist (``Engine.from_pretrained(path, tensor_parallel_size=N)``):

- **The engine starts them.** In a process without ``torch.distributed`` (and no ``torchrun``
  environment), this process becomes rank 0: it opens a ``TCPStore`` on a free loopback port and
  starts ranks 1..N-1 as fresh Python processes (``sys.executable``, the rendezvous in their
  environment: ``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``). Each
  worker initializes the world, builds ``ParallelContext.from_world(...)``, loads its shard with
  ``load_model(path, parallel=ctx)`` and enters ``run_worker``. They are started as new interpreters
  running this module's ``worker_main`` (not ``multiprocessing``'s spawn, which re-imports the user's
  main script in every child: a script would need an ``if __name__ == "__main__"`` guard, and the
  arguments would need pickling). A worker exits when rank 0 shuts the engine down, when its
  connection to rank 0 closes (rank 0 died), or when its parent process is gone.
- **They already exist** (``torchrun``, or any launcher that set the rendezvous environment or
  initialized ``torch.distributed``): every rank runs the same script; rank 0's ``from_pretrained``
  returns the engine, the others serve rank 0's steps inside the call and return None once rank 0
  shuts the engine down (docs/architecture.md, "Several ranks", shows the script).

A caller that builds its own model and groups passes the model to ``Engine(model, ...)`` on TP rank
0 and calls ``run_worker(model)`` on the other ranks of its TP group.

Only one multi-rank engine per process at a time (the ranks share ``torch.distributed``'s default
world, which the engine creates, or the launcher did).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from atom_core.engine.distributed import (
    CONFIG,
    LOAD_WEIGHTS,
    SHUTDOWN,
    SLEEP,
    STEP,
    WARMUP,
    WEIGHT_GROUP,
    StepChannel,
    WorkerFailedError,
    control_group_for,
)

logger = logging.getLogger(__name__)

__all__ = ["RankStart", "WorkerSet", "bounded", "exit_status", "run_worker", "start_interpreter", "start_ranks",
           "stop_processes", "stop_ranks", "watch_parent", "worker_main"]

DEFAULT_STEP_TIMEOUT = 300.0  # seconds rank 0 waits for a worker within a step before WorkerFailedError
STARTUP_TIMEOUT = 1800.0  # seconds rank 0 waits for its workers to start and load (while they stay alive)
STOP_TIMEOUT = 10.0  # seconds a worker gets to leave after the shutdown message before it is killed
TEARDOWN_TIMEOUT = 30.0  # seconds destroying or aborting the process group may take before it is left behind
ARGS_ENV = "ATOM_CORE_WORKER_ARGS"
PARENT_ENV = "ATOM_CORE_PARENT_PID"
_STARTED_KEY = "atom_core/started/{rank}"
_ERROR_KEY = "atom_core/error/{rank}"
_ENTRY = "from atom_core.engine.workers import worker_main; worker_main()"


# The WorkerSet of the world this process's engine created (rank 0 of its own ranks), while it lives: another
# multi-rank engine here is refused instead of joining a world whose ranks serve the first.
_engine_world: WorkerSet | None = None


@dataclass
class WorkerSet:
    """Rank 0's handle on the other ranks: the worker processes it started (none under ``torchrun``) and
    whether it created the process group (then it destroys it when the engine stops)."""

    processes: dict[int, subprocess.Popen] = field(default_factory=dict)  # by rank
    owns_world: bool = False
    store: object = None  # the rendezvous TCPStore (workers leave their error there)
    stopping: bool = False

    def find_failure(self) -> str | None:
        """A sentence naming a worker process that has exited (they never exit while the engine runs), or None."""
        if self.stopping:
            return None
        for rank, process in self.processes.items():
            code = process.poll()
            if code is not None:
                return f"worker rank {rank} (pid {process.pid}) {exit_status(code)}{self._error_of(rank)}"
        return None

    def _error_of(self, rank: int) -> str:
        try:
            key = _ERROR_KEY.format(rank=rank)
            if self.store is not None and self.store.check([key]):
                return f": {self.store.get(key).decode(errors='replace').strip()}"
        except Exception:  # noqa: BLE001 - the store went with the failure: the exit status says enough
            pass
        return ""

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Wait up to ``timeout`` s for the workers to leave, then kill the ones still there, and reap them."""
        self.stopping = True
        stop_processes(self.processes.values(), timeout)

    def close(self) -> None:
        """Give up at once (a failed start) or finish (a worker rank whose engine stopped): kill the processes
        still running, reap them, destroy the process group when this process made it."""
        self.stopping = True
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        self.stop(timeout=0.0)
        self.destroy_world()

    def destroy_world(self) -> None:
        global _engine_world
        if _engine_world is self:
            _engine_world = None
        if self.owns_world:
            import torch.distributed as dist

            self.owns_world = False
            if dist.is_initialized():
                bounded(dist.destroy_process_group, "destroying the engine's process group")


def bounded(fn, what: str, timeout: float = TEARDOWN_TIMEOUT) -> bool:
    """Run ``fn()`` (a teardown that can block in a communication library) on a daemon thread and wait up
    to ``timeout`` s: True if it finished. A failure or an overrun is logged, never raised: the engine is
    stopping either way, and a call still blocked is left to the process's exit."""
    done = threading.Event()

    def run():
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - after a failure the communicators may be gone already
            logger.warning("%s: %s", what, error)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="atom_core-teardown").start()
    if done.wait(timeout):
        return True
    logger.warning("%s did not finish within %g s; it is left to the process's exit", what, timeout)
    return False


def exit_status(code: int) -> str:
    """How a child process ended, from its return code: "exited with code 1", "was killed by SIGKILL"."""
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def stop_processes(processes: Iterable[subprocess.Popen], timeout: float) -> None:
    """Wait up to ``timeout`` s (in all) for ``processes`` to leave, then kill the ones still there, and
    reap them all."""
    processes = list(processes)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def start_interpreter(entry: str, env: dict[str, str], *, cores_shared_by: int | None = None,
                      pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start ``python -c entry`` as a fresh interpreter (not ``multiprocessing``'s spawn: the user's script
    is not imported again) with ``env`` and: ``PYTHONPATH`` that imports this same atom_core, the backend
    this process prefers (``set_default_backend``), and, when ``cores_shared_by`` processes share the
    cores, its share of them (``OMP_NUM_THREADS``, unless this process has it set)."""
    from atom_core.ops.dispatch import default_backend

    package_root = str(Path(__file__).resolve().parents[2])
    env = env | {"PYTHONPATH": os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    if default_backend() is not None:
        env["ATOM_CORE_BACKEND"] = default_backend()
    if cores_shared_by is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cores_shared_by))
    return subprocess.Popen([sys.executable, "-c", entry], env=env, pass_fds=pass_fds)


def watch_parent(parent_pid: int) -> None:
    """End this process (exit code 1) once its parent ``parent_pid`` is gone: a daemon thread checks every
    0.5 s (a child the engine started has nothing left to serve then)."""
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True,
                     name="atom_core-parent-watch").start()


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def stop_ranks(channel: StepChannel, workers: WorkerSet | None) -> None:
    """End a multi-rank engine (its ``shutdown``, its finalizer, or after a failure): tell the workers to
    leave (while the ranks are still in step), stop the processes rank 0 started, destroy the process
    group when rank 0 made it. Holds no reference to the engine (it runs when the engine is dropped)."""
    if workers is not None:
        workers.stopping = True  # from here on a worker's exit is expected
    if channel.failure is None:
        try:
            channel.send(SHUTDOWN)
            channel.wait_sends(timeout=STOP_TIMEOUT)
        except Exception:  # noqa: BLE001 - a worker already gone: the processes are stopped below anyway
            pass
    channel.release_device_state()  # (NCCL destroys or aborts a communicator only once its graphs are gone)
    if channel.failure is not None:
        bounded(channel.abort, "aborting the engine's TP communicator")
    graceful = channel.failure is None
    channel.failure = channel.failure or "the engine was shut down"
    if workers is not None:
        if graceful:
            workers.stop()
            workers.destroy_world()
        else:  # the ranks are out of step: nothing will leave on its own
            workers.close()


# ---- starting the ranks -------------------------------------------------------------------------------------------

@dataclass
class RankStart:
    """This process's place among the ranks (``start_ranks``): its parallel context and device; on rank 0
    the ``WorkerSet`` of the others (the engine's ``workers``)."""

    parallel: object  # ParallelContext
    device: torch.device
    workers: WorkerSet

    @property
    def is_driver(self) -> bool:
        return self.parallel.tp_rank == 0

    def close(self) -> None:
        """Give up (a failed start) or finish (a worker whose engine stopped): see ``WorkerSet.close``."""
        self.workers.close()


def _world_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from a launcher's environment (torchrun's variables), or None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def _world_timeout(device_type: str, step_timeout: float) -> datetime.timedelta:
    # gloo's collectives fail after it: the bound of rank 0's waits inside a step. NCCL's watchdog would
    # end the process after it, so it gets more than the engine's own bound (its polling raises first).
    return datetime.timedelta(seconds=step_timeout * (2 if device_type == "cuda" else 1))


def _rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device(device_type)
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def start_ranks(*, tensor_parallel_size: int, expert_parallel: bool | str, device, step_timeout: float,
                worker_args: dict) -> RankStart:
    """Join or create the world of ``tensor_parallel_size`` ranks and build this rank's parallel context.

    An initialized ``torch.distributed`` world, or a launcher's environment (``WORLD_SIZE`` / ``RANK``),
    is joined; otherwise this process is rank 0 and starts the others (``worker_args``: what they load,
    see ``worker_main``). Raises ValueError for a world that is not one TP group (data parallelism is a
    later part) or more GPU ranks than GPUs.
    """
    import torch.distributed as dist

    from atom_core.models import ParallelContext

    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
    device_type = torch.device(device).type
    workers = WorkerSet()
    env = _world_env()
    if dist.is_initialized() and _engine_world is not None:
        # That world is another engine's, whose ranks serve it: joining it would wait for them forever.
        raise RuntimeError("one multi-rank engine per process at a time: this process already runs one (its "
                           "tensor-parallel world); shut it down (engine.shutdown(), or leave its with block) "
                           "before building another, or use data_parallel_size for several")
    if dist.is_initialized():
        rank, world, local_rank = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    elif env is not None:
        rank, world, local_rank = env
        _check_world(world, tensor_parallel_size)
        _init_from_env(rank, world, device_type, step_timeout)
        workers.owns_world = True
    else:
        rank, world, local_rank = 0, tensor_parallel_size, 0
        if device_type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size={world} on CUDA needs {world} GPUs (one per rank), this "
                             f"machine shows {torch.cuda.device_count()}")
        workers = _spawn_workers(world, device_type, step_timeout, worker_args)
    try:
        _check_world(world, tensor_parallel_size)
        device = _rank_device(device_type, local_rank)
        parallel = ParallelContext.from_world(tensor_parallel_size=tensor_parallel_size,
                                              expert_parallel=expert_parallel)
    except BaseException:
        workers.close()
        raise
    return RankStart(parallel, device, workers)


def _check_world(world: int, tensor_parallel_size: int) -> None:
    if world != tensor_parallel_size:
        raise ValueError(f"the world has {world} ranks but tensor_parallel_size={tensor_parallel_size}: an engine "
                         "runs over one tensor-parallel group (data parallelism over several is not built yet)")


def _init_from_env(rank: int, world: int, device_type: str, step_timeout: float) -> None:
    import torch.distributed as dist

    timeout = _world_timeout(device_type, step_timeout)
    parent = os.environ.get(PARENT_ENV)
    if parent is None:  # torchrun or another launcher
        dist.init_process_group(_backend(device_type), init_method="env://", rank=rank, world_size=world,
                                timeout=timeout)
        return
    # Started by an engine: say so on its store first (it waits for that, watching this process, before
    # it joins the world itself), and leave when the parent is gone.
    watch_parent(int(parent))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                          datetime.timedelta(seconds=STARTUP_TIMEOUT))
    store.set(_STARTED_KEY.format(rank=rank), "1")
    dist.init_process_group(_backend(device_type), store=store, rank=rank, world_size=world, timeout=timeout)


def _spawn_workers(world: int, device_type: str, step_timeout: float, worker_args: dict) -> WorkerSet:
    """Rank 0 of a world it creates: start ranks 1..world-1, wait until each has started (watching that
    it stays alive), join the world."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, True, datetime.timedelta(seconds=STARTUP_TIMEOUT),
                          wait_for_workers=False)
    global _engine_world
    workers = WorkerSet(store=store, owns_world=True)
    _engine_world = workers
    base_env = os.environ | {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), PARENT_ENV: str(os.getpid()),
        ARGS_ENV: json.dumps(worker_args | {"step_timeout": step_timeout})}
    try:
        for rank in range(1, world):  # on the CPU the ranks share the cores
            workers.processes[rank] = start_interpreter(_ENTRY, base_env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
                                                        cores_shared_by=world if device_type == "cpu" else None)
        keys = [_STARTED_KEY.format(rank=rank) for rank in range(1, world)]
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not store.check(keys):
            failure = workers.find_failure()
            if failure is not None:
                raise WorkerFailedError(f"{failure} while starting")
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"the worker ranks did not start within {STARTUP_TIMEOUT:g} s")
            time.sleep(0.01)
        dist.init_process_group(_backend(device_type), store=store, rank=0, world_size=world,
                                timeout=_world_timeout(device_type, step_timeout))
    except BaseException:
        workers.close()
        raise
    return workers


def worker_main() -> None:
    """A worker rank started by an engine (``_spawn_workers``): join the world, load this rank's shard,
    serve rank 0's steps until it shuts the engine down. A failure is left on the rendezvous store (rank 0
    names it in its ``WorkerFailedError``) and ends the process with code 1."""
    from atom_core.models import load_model

    args = json.loads(os.environ[ARGS_ENV])
    rank = int(os.environ["RANK"])
    if args["device"] == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    start = None
    try:
        start = start_ranks(tensor_parallel_size=args["tensor_parallel_size"],
                            expert_parallel=args["expert_parallel"], device=args["device"],
                            step_timeout=args["step_timeout"], worker_args={})
        model = load_model(args["path"], dtype=args["dtype"], device=start.device, load_format=args["load_format"],
                           quantization=args["quantization"], parallel=start.parallel)
        run_worker(model)
    except BaseException as error:  # noqa: BLE001 - reported to rank 0, then the process ends
        _report_error(rank, error)
        traceback.print_exc()
        os._exit(1)
    if start is not None:
        start.close()


def _report_error(rank: int, error: BaseException) -> None:
    try:
        import torch.distributed as dist

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                              datetime.timedelta(seconds=5))
        store.set(_ERROR_KEY.format(rank=rank), f"{type(error).__name__}: {error}"[:2000])
    except Exception:  # noqa: BLE001 - rank 0 is gone too, or its store: the exit status is all it gets
        pass


# ---- the worker loop ----------------------------------------------------------------------------------------------

def run_worker(model) -> None:
    """Serve rank 0's engine with this rank's shard of ``model`` until rank 0 shuts it down.

    ``model`` is split over a TP group (``model.parallel``, this rank not its rank 0) whose rank 0 builds
    ``Engine(model_shard, ...)`` at the same time: both sides make the engine's control group, rank 0
    sends the runner's configuration, every rank sizes its KV pool and they agree on the smallest, then
    each step's ``StepInputs`` arrive and this rank runs the same forward and receives the sampled
    tokens; between steps, rank 0's ``Engine.load_weights`` streams new weights into this rank's shard
    (``engine.weight_sync``), and its weight-update group calls make this rank join a trainer's group and
    receive new weights from it (``engine.weight_group``). Returns when rank 0 shuts the engine down; raises
    when rank 0 dies (its connection closes).
    """
    from atom_core.engine.kv_pool import plan_pool
    from atom_core.engine.runner import ModelRunner
    from atom_core.engine.weight_group import WeightGroupWorker

    parallel = getattr(model, "parallel", None)
    if parallel is None or parallel.tp_size == 1 or parallel.tp_group is None:
        raise ValueError("run_worker serves a model split over a TP group (load_model(..., parallel=ctx) with "
                         "ctx.tp_size > 1 and its tp_group); a single-rank model needs no worker")
    if parallel.tp_rank == 0:
        raise ValueError("TP rank 0 runs the Engine itself (Engine(model, ...)); run_worker is for the other ranks")
    device = next(model.parameters()).device
    channel = StepChannel(parallel, control_group_for(parallel), device, dtype=model.dtype,
                          step_timeout=DEFAULT_STEP_TIMEOUT)
    kind, payload = channel.recv()
    if kind == SHUTDOWN:
        return
    if kind != CONFIG:
        raise RuntimeError(f"a worker expected the engine's configuration first, got message kind {kind}")
    config = pickle.loads(payload)
    try:
        spec, extra_specs, plan = plan_pool(model, device, **config["pool"])
    except BaseException:
        channel.agree_min(-1)  # rank 0 raises too, instead of waiting for this rank
        raise
    agreed = channel.agree_min(plan.num_blocks)
    if agreed < 0:
        return  # rank 0 could not build its engine (it raised there)
    if agreed != plan.num_blocks:
        spec, extra_specs, plan = plan_pool(model, device, **config["pool"] | {"num_kv_blocks": agreed})
    pool = config["pool"]
    runner = ModelRunner(model, spec, plan, extra_specs=extra_specs, device=device, max_num_seqs=pool["max_num_seqs"],
                         max_num_batched_tokens=pool["max_num_batched_tokens"], max_model_len=pool["max_model_len"],
                         enforce_eager=config["enforce_eager"], channel=channel)
    logger.info("worker rank %d: %s, KV pool of %d blocks", parallel.tp_rank, parallel.describe(), plan.num_blocks)
    weight_group = WeightGroupWorker(model, channel)
    try:
        _serve(model, channel, runner, weight_group)
    finally:
        weight_group.close()


def _serve(model, channel: StepChannel, runner, weight_group) -> None:
    """``run_worker``'s loop: each message of rank 0 until its shutdown."""
    from atom_core.engine.sleep_mode import SleepWorker
    from atom_core.engine.weight_sync import load_weights_worker

    sleep = SleepWorker(model, runner, channel)
    while True:
        kind, inputs = channel.recv()
        if kind == STEP:
            runner.run_worker_step(inputs)
        elif kind == WARMUP:
            runner.warm_forward()
        elif kind == LOAD_WEIGHTS:  # new weights for this rank's shard (rank 0's Engine.load_weights)
            load_weights_worker(model, channel, pickle.loads(inputs))
        elif kind == WEIGHT_GROUP:  # join, update from, or leave a trainer's weight-update group
            weight_group.handle(pickle.loads(inputs))
        elif kind == SLEEP:  # sleep mode: this rank's pool, graphs and weight shard (rank 0's Engine.sleep / wake_up)
            sleep.handle(pickle.loads(inputs))
        elif kind == SHUTDOWN:
            channel.release_device_state()  # before the process group goes (see StepChannel.release_device_state)
            return
        else:
            raise RuntimeError(f"a worker got an unknown message kind {kind}")
