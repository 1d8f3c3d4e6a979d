"""``AsyncEngine``: an asyncio front for an ``Engine``, stepped by one background thread.

    async_engine = AsyncEngine(Engine.from_pretrained())
    async for out in async_engine.generate("Return the number of", SamplingParams(max_tokens=16)):
        print(out.new_text, end="")
    await async_engine.shutdown()

Threads. The engine is single-threaded: one thread, the *step thread*, makes every call into it
(``add_request``, ``abort``, ``step`` and any function given to ``submit``). The event loop never
touches the engine: it appends commands (add, abort, call) to a list guarded by a condition, and
the step thread applies all queued commands between two steps, in the order they came, then runs
one step. With nothing unfinished it sleeps on the condition. After each step it reads what every
output added (token ids, text, log-probs: the engine's ``RequestOutput`` is read lazily from the
request, so it is never read from another thread) into plain records and hands them to the loop
in one ``call_soon_threadsafe`` per step. A blocking ``step()`` therefore never runs on the loop.

A request's life: ``add_request`` counts it as *waiting* (at most ``max_waiting_requests``, else
``QueueFullError``), queues the add and returns a ``RequestStream`` once the step thread has
added it (``ValueError`` / ``TypeError`` from ``Engine.add_request`` are raised there); it is
*running* from its first output until all its ``n`` sequences finish. Cancelling the consumer,
``stream.abort()`` or ``AsyncEngine.abort(request_id)`` aborts it in the engine (its blocks are
freed before the next step). A step that raises finishes the requests it ran with reason
"error" (``Engine.step``); their streams raise ``EngineStepError`` and the loop goes on serving.

Structured output: a request's grammar is compiled before its add is queued, on one of
``COMPILE_THREADS`` threads of the async engine's own (``Engine.compile_structured``), and handed to
``Engine.add_request``: a new schema (tens of milliseconds at a 150k vocabulary; the first one also
builds the compiler over the vocabulary; a schema of a thousand optional properties, seconds) never
holds up the steps of the running requests, nor, on threads apart from asyncio's default executor, the
work other requests do there (a server's tokenization). A constraint that does not compile raises its
``ValueError`` from ``add_request`` as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from atom_core.engine.engine import Engine
from atom_core.engine.request import prompt_text_of
from atom_core.engine.request_stream import RequestStream, StreamOutput, _Delta
from atom_core.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_WAITING_REQUESTS = 1024
COMPILE_THREADS = 2  # grammar compiles at once (each may take seconds: a schema of many optional properties)


class QueueFullError(RuntimeError):
    """``max_waiting_requests`` requests are already waiting for their first token (an HTTP server
    answers 503)."""


class EngineStepError(RuntimeError):
    """A step that ran this request raised; the request was finished with reason "error". The
    step's exception is ``__cause__``."""


class EngineClosedError(RuntimeError):
    """The ``AsyncEngine`` is shut down (or its step thread died): no request runs any more."""


@dataclass(frozen=True)
class AsyncEngineStats:
    """A snapshot for monitoring. Request counts are the async engine's own (requests, not their
    n sequences): *waiting* = accepted, no token yet; *running* = a token out, not all finished.
    Block and prefix-cache figures are the engine's as of the last step (``kv_cache_usage`` =
    blocks in use / blocks; prefix-cache counts are full prompt blocks looked up / served)."""

    num_waiting: int
    num_running: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    num_step_errors: int
    num_preemptions: int

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class _Live:
    """A request the step thread has added to the engine and not seen finish."""

    __slots__ = ("stream", "finished_indices")

    def __init__(self, stream: RequestStream):
        self.stream = stream
        self.finished_indices: set[int] = set()


class AsyncEngine:
    """Runs an ``Engine`` on a background thread for asyncio code (see the module docstring).

    ``max_waiting_requests``: requests that may wait for their first token at once; one more
    raises ``QueueFullError`` instead of queueing without bound. The step thread starts on the
    first ``add_request`` (or ``start()``) and binds the async engine to that event loop; it runs
    in a copy of the context the ``AsyncEngine`` was built in (so ``with ops.use_backend(...)``
    around the constructor applies to its steps).
    ``shutdown()`` (or ``async with``) aborts what is left and stops the thread; the engine can
    then be used directly again.
    """

    def __init__(self, engine: Engine, *, max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS):
        if isinstance(max_waiting_requests, bool) or not isinstance(max_waiting_requests, int) \
                or max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be an int >= 0, got {max_waiting_requests!r}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._context = contextvars.copy_context()  # the step thread runs in it (ops.use_backend, ...)
        self._cond = threading.Condition()
        self._commands: list[tuple] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._closed = False  # loop side: no new request
        self._dead: BaseException | None = None  # the step thread's own failure (a bug), if any
        # loop side
        self._streams: dict[str, RequestStream] = {}
        self._num_waiting = 0
        self._num_running = 0
        # step thread side
        self._live: dict[int, _Live] = {}
        self._outbox: list[tuple] = []
        self._num_steps = 0
        self._num_step_errors = 0
        self._engine_snapshot = self._read_engine_snapshot()  # replaced whole by the step thread
        self._compile_pool: concurrent.futures.ThreadPoolExecutor | None = None  # made at the first grammar

    # ------------------------------------------------------------------ the loop side

    def start(self) -> None:
        """Start the step thread, bound to the running event loop (idempotent; one loop only)."""
        if self._thread is not None:
            if asyncio.get_running_loop() is not self._loop:
                raise RuntimeError("this AsyncEngine serves another event loop (its step thread posts there)")
            return
        if self._closed:
            raise EngineClosedError("this AsyncEngine is shut down")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._context.run, args=(self._run,), name="atom_core-step",
                                        daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """The step thread is alive and not shutting down."""
        return self._thread is not None and self._thread.is_alive() and not self._closed and self._dead is None

    def check_health(self) -> None:
        """Raise ``EngineClosedError`` when the step thread is not running, or the engine's
        ``DistributedEngineError`` when it can no longer step (a worker rank or replica process exited):
        what a server's health check reports. Safe to call from the loop while the step thread runs."""
        if not self.is_running:
            raise EngineClosedError("the engine is not running" if self._dead is None else
                                    f"the step thread died: {self._dead!r}")
        self.engine.check_health()

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Queue a prompt; returns its stream once the engine has accepted it.

        Raises ``QueueFullError`` (too many waiting), ``ValueError`` / ``TypeError`` (what
        ``Engine.add_request`` refuses, or a request id already in use), ``EngineClosedError``.
        Cancelled while waiting for the acceptance, the request is aborted."""
        if self._closed or self._dead is not None:
            raise EngineClosedError("this AsyncEngine is shut down" if self._dead is None else
                                    f"the step thread died: {self._dead!r}")
        self.start()
        params = self.engine.default_sampling_params if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        elif request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self._num_waiting} requests are waiting for their first token "
                                 f"(max_waiting_requests={self.max_waiting_requests}); try again later")
        stream = RequestStream(self, request_id, params, prompt_text_of(prompt))
        self._streams[request_id] = stream
        self._num_waiting += 1
        try:
            grammar = await self._compile_structured(params)
        except asyncio.CancelledError:
            self._abort_stream(stream)
            raise
        except BaseException:
            self._finish_stream(stream, None)
            raise
        if self._dead is not None:  # the step thread died while it compiled: nobody would take the add
            self._finish_stream(stream, EngineClosedError(f"the step thread died: {self._dead!r}"))
        if not stream.finished:  # (aborted, or the async engine shut down, while it compiled: ended)
            self._send(("add", stream, prompt, params, grammar))
        try:
            await stream._accepted
        except asyncio.CancelledError:
            self._abort_stream(stream)
            raise
        return stream

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[StreamOutput]:
        """``async for out in generate(...)``: the request's outputs as they come; leaving the loop
        early (break, an exception, cancellation) aborts the request."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request by id (unknown or finished ids are ignored)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._abort_stream(stream)

    def stats(self) -> AsyncEngineStats:
        snapshot = self._engine_snapshot
        return AsyncEngineStats(num_waiting=self._num_waiting, num_running=self._num_running,
                                num_steps=self._num_steps, num_step_errors=self._num_step_errors, **snapshot)

    def submit(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the step thread between two steps (from any thread); returns a
        ``concurrent.futures.Future`` of its result. The way to read or change the engine while
        the async engine runs. Before the step thread has started (``start``, the first ``add_request`` or
        ``run_on_engine``) the function waits for it; ``shutdown`` fails it if none starts."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead is not None:
            raise EngineClosedError(f"the step thread died: {self._dead!r}")
        with self._cond:
            if self._stopping:
                raise EngineClosedError("this AsyncEngine is shut down")
            self._commands.append(("call", fn, future))
            self._cond.notify()
        return future

    async def run_on_engine(self, fn: Callable[[Engine], Any]) -> Any:
        """``await`` form of ``submit`` (starting the step thread, as ``add_request`` does)."""
        self.start()
        return await asyncio.wrap_future(self.submit(fn))

    async def shutdown(self) -> None:
        """Abort every request, stop the step thread; open streams raise ``EngineClosedError``."""
        self._closed = True
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            await asyncio.sleep(0)  # deliveries the thread posted before it stopped
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
        with self._cond:  # functions submitted before any step thread ran them (none was started)
            commands, self._commands = self._commands, []
        for command in commands:
            if command[0] == "call" and command[2].set_running_or_notify_cancel():
                command[2].set_exception(EngineClosedError("the AsyncEngine shut down before this function ran"))
        for stream in list(self._streams.values()):
            self._finish_stream(stream, EngineClosedError("the AsyncEngine shut down before this request finished"))

    async def __aenter__(self) -> AsyncEngine:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def _compile_structured(self, params: SamplingParams):
        """The request's compiled grammar (None without structured output, or for an engine that compiles
        in its own ``add_request``), compiled on the compile threads, never on the step thread."""
        compile_structured = getattr(self.engine, "compile_structured", None)
        if params.structured_outputs is None or compile_structured is None:
            return None
        if self._compile_pool is None:
            self._compile_pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS,
                                                                       thread_name_prefix="atom_core-compile")
        return await asyncio.get_running_loop().run_in_executor(self._compile_pool, compile_structured, params)

    def _send(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _abort_stream(self, stream: RequestStream) -> None:
        if stream.finished:
            return
        stream.aborted = True
        stream._drop_unread()  # the consumer asked for no more
        self._finish_stream(stream, None)
        if self._thread is not None and self._thread.is_alive():
            self._send(("abort", stream))

    def _finish_stream(self, stream: RequestStream, error: BaseException | None) -> None:
        if stream.finished:
            return
        if stream.state == "waiting":
            self._num_waiting -= 1
        elif stream.state == "running":
            self._num_running -= 1
        stream.state = "done"
        self._streams.pop(stream.request_id, None)
        stream._end(error)

    def _deliver(self, items: list[tuple]) -> None:
        """On the loop: what the step thread posted in one round."""
        for stream, kind, payload in items:
            state = stream.state
            if state == "running" and kind == "delta":  # the common case first
                if stream._on_delta(payload):
                    self._num_running -= 1
                    stream.state = "done"
                    self._streams.pop(stream.request_id, None)
                continue
            if state == "done":  # aborted (or closed) since: drop what was in flight
                if kind == "accepted" and not stream._accepted.done():
                    stream._accepted.set_result(None)
                continue
            if kind == "accepted":
                if not stream._accepted.done():
                    stream._accepted.set_result(None)
            elif kind == "aborted":  # the engine dropped it (_end_requests_the_engine_dropped)
                if state == "waiting":
                    self._num_waiting -= 1
                else:
                    self._num_running -= 1
                stream.state = "done"
                self._streams.pop(stream.request_id, None)
                stream._end_aborted(time.monotonic())
            elif kind == "delta":
                stream.state = "running"
                self._num_waiting -= 1
                self._num_running += 1
                if stream._on_delta(payload):
                    self._num_running -= 1
                    stream.state = "done"
                    self._streams.pop(stream.request_id, None)
            else:  # "error": the add was refused, or a step failed it
                self._finish_stream(stream, payload)

    # ------------------------------------------------------------------ the step thread

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug of this module: fail every stream instead of hanging them
            logger.exception("AsyncEngine step thread died")
            self._dead = e
            for live in self._live.values():
                self._outbox.append((live.stream, "error", EngineClosedError(f"the step thread died: {e!r}")))
            with self._cond:
                commands, self._commands = self._commands, []
            for command in commands:
                if command[0] == "add":
                    self._outbox.append((command[1], "error", EngineClosedError(f"the step thread died: {e!r}")))
                elif command[0] == "call":
                    command[2].set_exception(EngineClosedError(f"the step thread died: {e!r}"))
            self._flush()

    def _serve(self) -> None:
        engine = self.engine
        # A data-parallel front's device names no GPU (its replicas own theirs): nothing to select then.
        if engine.device.type == "cuda" and engine.device.index is not None:
            import torch

            torch.cuda.set_device(engine.device)
        while True:
            with self._cond:
                while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                self._apply(command, stopping)
            if stopping:
                for engine_id, live in list(self._live.items()):
                    engine.abort(engine_id)
                    self._outbox.append((live.stream, "error", EngineClosedError(
                        "the AsyncEngine shut down before this request finished")))
                self._live.clear()
                self._flush()
                return
            if engine.has_unfinished_requests():
                self._step()
            self._engine_snapshot = self._read_engine_snapshot()
            self._flush()

    def _apply(self, command: tuple, stopping: bool) -> None:
        kind = command[0]
        if kind == "add":
            _, stream, prompt, params, grammar = command
            if stopping:
                self._outbox.append((stream, "error", EngineClosedError("the AsyncEngine is shutting down")))
                return
            try:
                if grammar is None:
                    engine_id = self.engine.add_request(prompt, params)
                else:  # compiled on a worker thread: add_request does not compile it again
                    engine_id = self.engine.add_request(prompt, params, grammar=grammar)
            except Exception as e:  # ValueError / TypeError: refused, nothing queued
                self._outbox.append((stream, "error", e))
                return
            stream.engine_id = engine_id
            self._live[engine_id] = _Live(stream)
            self._outbox.append((stream, "accepted", None))
        elif kind == "abort":
            stream = command[1]
            if stream.engine_id is not None and self._live.pop(stream.engine_id, None) is not None:
                self.engine.abort(stream.engine_id)
        elif kind == "call":
            _, fn, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:
                    future.set_exception(e)
                finally:
                    self._end_requests_the_engine_dropped()

    def _end_requests_the_engine_dropped(self) -> None:
        """After a function ran on the engine: streams whose requests it aborted (``load_weights(...,
        unfinished="abort")`` aborts every one; the engine gives them no further output) end with finish reason
        "abort" instead of waiting forever."""
        for engine_id in [engine_id for engine_id in self._live if not self.engine.is_unfinished(engine_id)]:
            self._outbox.append((self._live.pop(engine_id).stream, "aborted", None))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._num_step_errors += 1
            logger.exception("engine step failed; its requests finish with reason 'error'")
            for engine_id in self._failed_requests():
                live = self._live.pop(engine_id)
                self.engine.abort(engine_id)  # the group's sequences the step did not run
                error = EngineStepError(f"a step that ran this request raised {type(e).__name__}: {e}")
                error.__cause__ = e
                self._outbox.append((live.stream, "error", error))
            return
        self._num_steps += 1
        now = time.monotonic()
        lives, append = self._live, self._outbox.append
        for out in outputs:
            live = lives.get(out.request_id)
            if live is None:  # aborted meanwhile
                continue
            params = live.stream.params
            new_ids = out.new_token_ids
            k = len(new_ids)
            num_output_tokens = out.num_output_tokens
            finish_reason = out.finish_reason
            if finish_reason is None and num_output_tokens != k and params.logprobs is None:  # (most outputs)
                delta = _Delta(out.index, new_ids, out.new_text, None, None, num_output_tokens, None, None, now,
                               None, 0, None, None)
            else:
                finished = finish_reason is not None
                first = num_output_tokens == k  # the sequence's first output: the prompt is computed
                delta = _Delta(
                    index=out.index, new_token_ids=new_ids, new_text=out.new_text,
                    new_logprobs=out.logprobs[-k:] if params.logprobs is not None else None,
                    new_top_logprobs=out.top_logprobs[-k:] if params.logprobs else None,
                    num_output_tokens=num_output_tokens, finish_reason=finish_reason,
                    stop_reason=out.stop_reason if finished else None, time=now,
                    prompt_token_ids=list(out.prompt_token_ids) if first else None,
                    num_cached_tokens=out.num_cached_tokens if finished else 0,
                    prompt_logprobs=out.prompt_logprobs if first and params.prompt_logprobs is not None else None,
                    prompt_top_logprobs=out.prompt_top_logprobs if first and params.prompt_logprobs else None,
                    new_logprob_ranks=out.logprob_ranks[-k:] if params.logprobs is not None else None,
                    prompt_logprob_ranks=(out.prompt_logprob_ranks if first and params.prompt_logprobs is not None
                                          else None))
                if finished:
                    live.finished_indices.add(delta.index)
                    if len(live.finished_indices) == params.n:
                        del lives[out.request_id]
            append((live.stream, "delta", delta))

    def _failed_requests(self) -> list[int]:
        """Engine ids of the live requests the failed step finished (reason "error"): the engine
        names them in ``Engine.failed_request_ids``."""
        return [engine_id for engine_id in self.engine.failed_request_ids if engine_id in self._live]

    def _read_engine_snapshot(self) -> dict:
        bm = self.engine.block_manager
        prefix = bm.stats
        return dict(num_kv_blocks=bm.num_blocks, num_free_kv_blocks=bm.num_free_blocks,
                    prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
                    num_preemptions=self.engine.num_preemptions)

    def _flush(self) -> None:
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        try:
            self._loop.call_soon_threadsafe(self._deliver, items)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass
