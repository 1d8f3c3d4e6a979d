"""One engine over several ranks: what rank 0 sends its workers each step, how every rank gets the
sampled tokens, and the errors a rank that stops answering turns into.

Rank 0 (the *driver*, tensor-parallel rank 0) owns the scheduler, the block manager, sampling and
the user-facing API. The other ranks of its TP group (the *workers*) hold their shard of the model
and a KV pool of the same shape, and run exactly the forward rank 0 runs. Per step:

1. rank 0 sends the step's small inputs (``StepInputs``: input ids, query / cached lengths, block
   tables, pending positions and sources, prompt log-prob positions, the CUDA-graph bucket) to
   every worker: ONE broadcast of one packed byte tensor over a CPU (gloo) *control group* of the
   TP group's ranks, sent asynchronously (rank 0 goes on with its own forward at once). A message
   larger than ``INLINE_BYTES`` (a long prefill, very wide block tables) takes a second broadcast
   of the remainder.
2. every rank builds the same token layout from those inputs and runs the same forward (the same
   graph on a GPU); the layers' collectives run over the model's TP group (NCCL / gloo).
3. rank 0 samples (with its logits processing and penalty state); the sampled token ids [B] int64
   are broadcast from rank 0 over the TP group, on the device, so each worker holds them where
   the next step's pending tokens are gathered (``ScheduledStep.pending_*``) without the host
   waiting: async scheduling works unchanged. Sampling once and broadcasting (rather than every
   rank sampling with the same seeds) keeps the sampling inputs, the logits processing and the
   penalties' token state on rank 0 alone, and makes agreement hold by construction instead of
   depending on bit-identical logits and sampling kernels on every rank.

Why a gloo broadcast (and not shared memory): the same code serves ranks on one host and ranks on
several (``torchrun --nnodes``), a worker waiting for the next step blocks in ``recv`` instead of
spinning a core, and a dead peer or a timeout surfaces as an error of the call. Its cost is one
loopback round of a small message per step, off the device's critical path with async scheduling
(measured figures: docs/architecture.md, "Several ranks").

Failures. A worker that dies or stops answering must not hang rank 0: every wait of rank 0 on a
worker is bounded by ``step_timeout`` seconds (the control-group sends are polled against it, the
TP group's collectives carry it as their timeout, and on a GPU ``collect`` polls the step's event
against it), and the processes rank 0 started are checked while it waits. It then raises
``WorkerFailedError``, and the engine stops its workers; every later call raises
``DistributedEngineError``.

Legend: B = rows of the step, T = its tokens, P = block-table pages, N = pending tokens,
M = prompt log-prob positions.
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from atom_core.engine.cuda_graphs import DECODE, MIXED, Bucket
from atom_core.ops import comm

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from atom_core.models.parallel import ParallelContext

__all__ = ["DistributedEngineError", "StepChannel", "StepInputs", "WorkerFailedError"]

STEP, WARMUP, SHUTDOWN, CONFIG, LOAD_WEIGHTS, WEIGHT_GROUP, SLEEP = 1, 2, 3, 4, 5, 6, 7
KIND_NAMES = {STEP: "step", WARMUP: "warmup", SHUTDOWN: "shutdown", CONFIG: "config", LOAD_WEIGHTS: "load_weights",
              WEIGHT_GROUP: "weight_group",  # join / update from / close a weight-update group
              SLEEP: "sleep"}  # sleep mode: sleep at a level, or wake tags (engine.sleep_mode)
_PAYLOAD_KINDS = (CONFIG, LOAD_WEIGHTS, WEIGHT_GROUP, SLEEP)  # messages whose body is a pickled payload
HEADER_FIELDS = 16  # int64 each: kind, B, T, P, N, M, bucket kind, bucket tokens, bucket rows, payload bytes
HEADER_BYTES = 8 * HEADER_FIELDS
STATUS_BYTES = 4096  # a rank's status in ``exchange_status`` (utf-8, cut to this)
INLINE_BYTES = 128 * 1024  # the first broadcast's fixed size: a decode step of 256 rows x 120 pages fits
ONE_SHOT_ENV = "ATOM_CORE_ONE_SHOT_ALL_REDUCE"  # "1" on every rank: small TP all-reduces on the one-shot kernel
CONTROL_GROUP_TIMEOUT = datetime.timedelta(days=365)  # a worker waits for the next step as long as rank 0 idles
_BUCKET_KINDS = {None: 0, DECODE: 1, MIXED: 2}
_POLL_SPIN_S = 0.002  # a wait polls without sleeping this long, then sleeps POLL_SLEEP_S between polls
_POLL_SLEEP_S = 1e-4
# What torch.distributed's gloo / NCCL backends raise (plain RuntimeErrors) when a peer is gone or late.
_COLLECTIVE_FAILURE = re.compile(r"gloo|nccl|timed out|connection (closed|reset)|pair closure|broken pipe|"
                                 r"DistBackendError|peer", re.IGNORECASE)
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


class DistributedEngineError(RuntimeError):
    """The ranks of a multi-rank engine can no longer run in step (a worker failed, or rank 0 raised
    in the middle of a step); the engine has stopped its workers. Build a new engine."""


class WorkerFailedError(DistributedEngineError):
    """A worker rank died or did not answer within ``step_timeout`` seconds; the message names it when
    rank 0 started it (its pid and exit status)."""


@dataclass(slots=True)
class StepInputs:
    """What every rank needs to run one step's forward (rank 0 makes it from the ``ScheduledStep``).

    input_ids: int64 [T] (pending tokens are 0, filled on the device); query_lens, cached_lens: int64
    [B]; block_tables: int32 [B, P]; pending_positions / pending_sources: int64 [N] or None;
    prompt_logprob_indices: int64 [M], the token positions whose logits the step computes for prompt
    log-probs (their LM-head gathers are collectives too), or None; bucket: the CUDA graph the step
    replays (None: eagerly).
    """

    input_ids: np.ndarray
    query_lens: np.ndarray
    cached_lens: np.ndarray
    block_tables: np.ndarray
    pending_positions: np.ndarray | None = None
    pending_sources: np.ndarray | None = None
    prompt_logprob_indices: np.ndarray | None = None
    bucket: Bucket | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.input_ids) == len(self.query_lens)

    def __len__(self) -> int:
        return len(self.query_lens)


def encode(kind: int, inputs: StepInputs | None = None, payload: bytes = b"") -> np.ndarray:
    """One message as uint8 [HEADER_BYTES + payload bytes]: a header of int64 fields, then (for a step)
    input_ids, query_lens, cached_lens, pending positions, pending sources, prompt log-prob indices
    (int64 each), and the block tables (int32, row-major) last."""
    header = np.zeros(HEADER_FIELDS, dtype=np.int64)
    header[0] = kind
    if inputs is None:
        body = np.frombuffer(payload, dtype=np.uint8)
    else:
        rows, pages = inputs.block_tables.shape
        pending = inputs.pending_positions
        prompt = inputs.prompt_logprob_indices
        bucket = inputs.bucket
        header[1:9] = (rows, inputs.num_tokens, pages, -1 if pending is None else len(pending),
                       -1 if prompt is None else len(prompt), _BUCKET_KINDS[None if bucket is None else bucket.kind],
                       0 if bucket is None else bucket.num_tokens, 0 if bucket is None else bucket.num_rows)
        parts = [inputs.input_ids, inputs.query_lens, inputs.cached_lens]
        if pending is not None:
            parts += [pending, inputs.pending_sources]
        if prompt is not None:
            parts.append(prompt)
        body = np.concatenate([np.ascontiguousarray(p, dtype=np.int64).view(np.uint8) for p in parts]
                              + [np.ascontiguousarray(inputs.block_tables, dtype=np.int32).reshape(-1).view(np.uint8)])
    header[9] = len(body)
    return np.concatenate([header.view(np.uint8), body])


def decode(header: np.ndarray, body: np.ndarray) -> tuple[int, StepInputs | bytes | None]:
    """``encode``'s inverse: (kind, StepInputs for a step / the payload bytes for a config or a weight load /
    None)."""
    kind = int(header[0])
    if kind in _PAYLOAD_KINDS:
        return kind, body.tobytes()
    if kind != STEP:
        return kind, None
    rows, tokens, pages, num_pending, num_prompt, bucket_kind, bucket_tokens, bucket_rows = (int(v) for v in header[1:9])
    offset = 0

    def take(count: int, dtype) -> np.ndarray:
        nonlocal offset
        size = count * np.dtype(dtype).itemsize
        out = body[offset:offset + size].view(dtype).copy()  # the receive buffer is reused by the next message
        offset += size
        return out

    input_ids, query_lens, cached_lens = take(tokens, np.int64), take(rows, np.int64), take(rows, np.int64)
    pending_positions = pending_sources = prompt = None
    if num_pending >= 0:
        pending_positions, pending_sources = take(num_pending, np.int64), take(num_pending, np.int64)
    if num_prompt >= 0:
        prompt = take(num_prompt, np.int64)
    block_tables = take(rows * pages, np.int32).reshape(rows, pages)
    kinds = {v: k for k, v in _BUCKET_KINDS.items()}
    bucket = None if bucket_kind == 0 else Bucket(kinds[bucket_kind], bucket_tokens, bucket_rows)
    return kind, StepInputs(input_ids, query_lens, cached_lens, block_tables, pending_positions, pending_sources,
                            prompt, bucket)


def control_group_for(parallel: ParallelContext) -> ProcessGroup:
    """A gloo group over the ranks of ``parallel.tp_group`` for the engine's host messages (created by
    those ranks only: rank 0's ``Engine`` and each worker's ``run_worker`` call it at the same point).
    Its timeout is long: a worker waits for the next step for as long as rank 0 stays idle."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(parallel.tp_group)
    return dist.new_group(ranks, backend="gloo", timeout=CONTROL_GROUP_TIMEOUT, use_local_synchronization=True)


def looks_like_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is what torch.distributed raises for a peer that is gone or late."""
    import torch.distributed as dist

    return isinstance(error, getattr(dist, "DistError", ())) or (
        isinstance(error, RuntimeError) and bool(_COLLECTIVE_FAILURE.search(str(error))))


class StepChannel:
    """The per-step link between rank 0 and the workers of one TP group (see the module docstring).

    Args:
        parallel: this rank's context (its ``tp_group`` carries the sampled tokens).
        control_group: the gloo group of the same ranks (``control_group_for``).
        device: this rank's device (the sampled tokens live there).
        dtype: the model's activation dtype (``ops.comm.enable_one_shot_all_reduce`` for the TP group).
        step_timeout: seconds rank 0 waits for a worker before raising ``WorkerFailedError``.
        find_failure: rank 0's check of its workers' processes: a sentence naming a dead one, or None.
    """

    def __init__(self, parallel: ParallelContext, control_group: ProcessGroup, device, *, dtype: torch.dtype,
                 step_timeout: float, find_failure: Callable[[], str | None] | None = None):
        import torch.distributed as dist

        self._dist = dist
        self.parallel = parallel
        self.is_driver = parallel.tp_rank == 0
        self.control_group = control_group
        self.device_group = parallel.tp_group
        self.src = dist.get_process_group_ranks(parallel.tp_group)[0]  # global rank of TP rank 0
        self.device = torch.device(device)
        self.step_timeout = float(step_timeout)
        self.find_failure = find_failure or (lambda: None)
        self.failure: str | None = None  # why the ranks are out of step, once they are
        self._buffer = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
        self._buffer_np = self._buffer.numpy()
        self._sends: list = []  # (work, tensor) of rank 0's sends not known complete
        # This rank's captured CUDA graphs (``StepGraphs``, set by its runner): they hold the TP group's
        # NCCL communicator until released (``release_device_state``).
        self.graphs = None
        # Small all-reduces of the model's activations (dtype) through the one-shot kernel (``ops.comm``)
        # where every rank's environment says ATOM_CORE_ONE_SHOT_ALL_REDUCE=1; NCCL otherwise (the default).
        self.one_shot_all_reduce = comm.enable_one_shot_all_reduce(
            parallel.tp_group, dtype, self.device, want=os.environ.get(ONE_SHOT_ENV) == "1")

    # ------------------------------------------------------------------ rank 0

    def send(self, kind: int, inputs: StepInputs | None = None, payload: bytes = b"") -> None:
        """Broadcast a message to the workers without waiting for them (the previous message's send is
        waited for first, bounded by ``step_timeout``: its buffer is reused)."""
        self.check_usable()
        message = encode(kind, inputs, payload)
        self.wait_sends()
        n = min(len(message), INLINE_BYTES)
        self._buffer_np[:n] = message[:n]
        try:
            self._sends.append((self._dist.broadcast(self._buffer, self.src, group=self.control_group,
                                                     async_op=True), None))
            if len(message) > INLINE_BYTES:
                rest = torch.from_numpy(message[INLINE_BYTES:].copy())
                self._sends.append((self._dist.broadcast(rest, self.src, group=self.control_group,
                                                         async_op=True), rest))
        except BaseException as error:
            raise self.fail(error) from error

    def send_object(self, obj) -> None:
        """Send a picklable object (the runner's configuration, once at start)."""
        self.send(CONFIG, payload=pickle.dumps(obj))

    def wait_sends(self, timeout: float | None = None) -> None:
        """Wait until the workers have received every message sent (within ``timeout``, default
        ``step_timeout``)."""
        for work, _ in self._sends:
            self.wait_work(work, "the previous message to the workers", timeout)
        self._sends.clear()

    def wait_work(self, work, what: str, timeout: float | None = None) -> None:
        """Wait for a collective's ``work`` within ``timeout`` (default ``step_timeout``), checking the
        workers meanwhile."""
        deadline = time.monotonic() + (self.step_timeout if timeout is None else timeout)
        spin_until = time.monotonic() + _POLL_SPIN_S
        while not work.is_completed():
            self._check_deadline(deadline, what)
            if time.monotonic() > spin_until:
                time.sleep(_POLL_SLEEP_S)
        try:
            work.wait()
        except BaseException as error:
            raise self.fail(error) from error

    def wait_event(self, event) -> None:
        """``event.synchronize()`` (a step's results on a GPU), bounded by ``step_timeout``: a worker that
        died or hangs leaves the step's collectives, and so the event, incomplete forever."""
        if event.query():
            return
        deadline = time.monotonic() + self.step_timeout
        spin_until = time.monotonic() + _POLL_SPIN_S
        while not event.query():
            self._check_deadline(deadline, "the step's device work (its collectives wait for every rank)")
            if time.monotonic() > spin_until:
                time.sleep(_POLL_SLEEP_S)

    def _check_deadline(self, deadline: float, what: str) -> None:
        failure = self.find_failure()
        if failure is not None:
            raise self._broken(WorkerFailedError(f"{failure}; rank 0 was waiting for {what}"))
        if time.monotonic() > deadline:
            raise self._broken(WorkerFailedError(
                f"no answer from the worker ranks within step_timeout={self.step_timeout:g} s while waiting for "
                f"{what}: a worker hangs or died"))

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` (on this rank's device) into every worker's tensor of the same shape and dtype,
        over the TP group (queued on the device stream on a GPU: the host does not wait): a step's sampled
        tokens, or ``Engine.load_weights``' new weights' bytes."""
        self._dist.broadcast(tensor, self.src, group=self.device_group)

    def _wait_collective(self, work, what: str) -> None:
        """Rank 0 waits for a control-group collective at most ``step_timeout`` (``wait_work``); a worker as
        long as it takes."""
        if self.is_driver:
            self.wait_work(work, what)
        else:
            work.wait()

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (every rank calls it): the KV pool's block count."""
        t = torch.tensor([value], dtype=torch.int64)
        work = self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.control_group, async_op=True)
        self._wait_collective(work, "the workers' KV pool sizes")
        return int(t.item())

    def exchange_status(self, status: str) -> list[str]:
        """Every rank's ``status`` (empty: fine; else why it failed, cut to ``STATUS_BYTES``), indexed by TP
        rank (every rank calls it; rank 0 waits at most ``step_timeout``)."""
        data = status.encode()[:STATUS_BYTES]
        mine = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.zeros_like(mine) for _ in range(self._dist.get_world_size(self.control_group))]
        work = self._dist.all_gather(gathered, mine, group=self.control_group, async_op=True)
        self._wait_collective(work, "the workers' status")
        return [bytes(t.numpy()).rstrip(b"\0").decode(errors="replace") for t in gathered]

    # ------------------------------------------------------------------ failures

    def check_usable(self) -> None:
        if self.failure is not None:
            raise DistributedEngineError(f"this multi-rank engine can no longer run: {self.failure}")

    def _broken(self, error: DistributedEngineError) -> DistributedEngineError:
        self.failure = self.failure or str(error)
        return error

    def fail(self, error: BaseException) -> BaseException:
        """Mark the ranks out of step after ``error`` was raised during a step (or a send); returns the
        error to raise: a ``WorkerFailedError`` naming the dead worker when one died or the error is a
        collective's failure, else ``error`` itself (rank 0's own)."""
        if isinstance(error, DistributedEngineError):
            return self._broken(error)
        collective = looks_like_collective_failure(error)
        failure = self.find_failure()
        if failure is None and collective:  # a killed process closes its sockets just before it is reaped
            deadline = time.monotonic() + 1.0
            while failure is None and time.monotonic() < deadline:
                time.sleep(0.01)
                failure = self.find_failure()
        if failure is not None:
            return self._broken(WorkerFailedError(f"{failure} during a step ({type(error).__name__}: {error})"))
        if collective:
            late = _TIMED_OUT.search(str(error)) is not None
            return self._broken(WorkerFailedError(
                ("a worker rank did not answer in time: a collective of the step timed out (a worker hangs or died)"
                 if late else "a worker rank failed: a collective of the step failed") + f" ({error})"))
        self.failure = f"rank 0 raised in the middle of a step ({type(error).__name__}: {error})"
        return error

    def release_device_state(self) -> None:
        """Destroy this rank's CUDA graphs: NCCL's destroy and abort of a communicator wait until no graph
        that captured its collectives is left (a graph still running is freed once its kernels end, which
        an abort makes them do); then drop the group's one-shot all-reduce buffer, which the graphs read."""
        if self.graphs is not None:
            self.graphs.release()
        comm.disable_one_shot_all_reduce(self.device_group)

    def abort(self) -> None:
        """Best effort, after a failure: abort the TP group's communicator so that device work waiting on
        a dead rank ends (NCCL); gloo needs nothing (its pending calls fail when the peer's sockets close)."""
        if self.device.type != "cuda":
            return
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group(self.device_group)
        except Exception:  # noqa: BLE001 - nothing more can be done for a communicator that is gone
            pass

    # ------------------------------------------------------------------ workers

    def recv(self) -> tuple[int, StepInputs | bytes | None]:
        """A worker's next message from rank 0 (blocks until it comes): (kind, StepInputs / payload / None)."""
        self._dist.broadcast(self._buffer, self.src, group=self.control_group)
        header = self._buffer_np[:HEADER_BYTES].view(np.int64)
        size = int(header[9])
        body = self._buffer_np[HEADER_BYTES:HEADER_BYTES + size]
        if HEADER_BYTES + size > INLINE_BYTES:
            rest = torch.empty(HEADER_BYTES + size - INLINE_BYTES, dtype=torch.uint8)
            self._dist.broadcast(rest, self.src, group=self.control_group)
            body = np.concatenate([self._buffer_np[HEADER_BYTES:], rest.numpy()])
        return decode(header.copy(), body)

    def receive_tokens(self, num_rows: int) -> torch.Tensor:
        """The tokens rank 0 sampled this step (int64 [B], on this rank's device)."""
        tokens = torch.empty(num_rows, dtype=torch.int64, device=self.device)
        self._dist.broadcast(tokens, self.src, group=self.device_group)
        return tokens
