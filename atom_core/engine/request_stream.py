"""The consumer side of an ``AsyncEngine`` request: ``RequestStream`` (what ``add_request`` returns:
async-iterate it for ``StreamOutput``s), and the records the step thread hands to the loop (``_Delta``:
what one step added to one sequence) and the loop keeps per sequence (``_Sequence``).

Everything here runs on the event loop except ``_Delta``'s construction (the step thread's). A stream
holds its outputs in a deque; a consumer with nothing to read waits on a future of its own, which the
next delivery resolves. The stream's last item is ``_END`` (every sequence finished, or aborted) or an
exception (``EngineStepError`` / ``EngineClosedError`` of ``async_engine``), and stays there:
iterating again ends (raises) again.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from atom_core.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom_core.engine.async_engine import AsyncEngine

__all__ = ["RequestStream", "StreamOutput"]


@dataclass(slots=True)
class _Delta:
    """What one step added to one sequence: made on the step thread from a ``RequestOutput`` (not frozen:
    a frozen dataclass pays an ``object.__setattr__`` per field, on the step thread, per output)."""

    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None
    new_top_logprobs: list[dict[int, float]] | None
    num_output_tokens: int
    finish_reason: str | None
    stop_reason: str | int | None
    time: float
    prompt_token_ids: list[int] | None  # a sequence's first output only
    num_cached_tokens: int  # its finishing output only
    prompt_logprobs: list | None  # a sequence's first output, when asked for
    prompt_top_logprobs: list | None
    new_logprob_ranks: list[int] | None = None  # with new_logprobs
    prompt_logprob_ranks: list | None = None  # with prompt_logprobs


class _Sequence:
    """One sequence's outputs so far, kept on the loop side (appended to only)."""

    __slots__ = ("pieces", "token_ids", "logprobs", "logprob_ranks", "top_logprobs", "num_cached_tokens",
                 "prompt_logprobs", "prompt_logprob_ranks", "prompt_top_logprobs", "first_time", "last_time",
                 "finished")

    def __init__(self, params: SamplingParams):
        self.pieces: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.logprob_ranks: list[int] | None = [] if params.logprobs is not None else None
        self.top_logprobs: list[dict[int, float]] | None = [] if params.logprobs else None
        self.num_cached_tokens = 0
        self.prompt_logprobs = self.prompt_logprob_ranks = self.prompt_top_logprobs = None
        self.first_time: float | None = None
        self.last_time: float | None = None
        self.finished = False


class StreamOutput:
    """One sequence's output as of one step, as a ``RequestStream`` yields it (the names of
    ``RequestOutput``).

    Attributes:
        request_id: the stream's request id (a string).
        index: which of the request's ``n`` sequences (0..n-1).
        new_token_ids, new_text: what this step added (the ``new_text`` of a sequence's outputs,
            concatenated, is its final ``text``).
        new_logprobs, new_logprob_ranks, new_top_logprobs: the log-probs of the new tokens, their ranks
            and top alternatives (``SamplingParams.logprobs``; ``RequestOutput`` says what a rank is).
        num_output_tokens: tokens generated so far.
        finish_reason: None while running, else "stop", "length", or "error" where the request's rules together
            allowed no next token (``stop_rule``); an abort, and a step that failed, end the stream instead
            of reaching it.
        stop_reason: the stop string or stop token id that ended it (None otherwise).
        time: ``time.monotonic()`` when the step thread read this step's tokens.
        first_time: ``time`` of the sequence's first output (time to first token = ``first_time -
            stream.arrival_time``); previous_time: ``time`` of its previous output (None for the first).

    Read when accessed (a snapshot of this step): ``text`` (cumulative: the whole text so far, as vLLM's
    default ``RequestOutputKind.CUMULATIVE`` gives it; ``new_text`` is this step's part), ``token_ids``,
    ``logprobs``, ``logprob_ranks``, ``top_logprobs``, ``cumulative_logprob`` (their ``math.fsum``; None
    without ``SamplingParams.logprobs``); ``prompt_logprobs`` / ``prompt_logprob_ranks`` /
    ``prompt_top_logprobs`` (``SamplingParams.prompt_logprobs``: known from the sequence's first output on);
    ``num_cached_tokens`` (once finished); ``prompt`` (the prompt's text when it was given as text, else None).

    ``outputs`` is ``[self]``: vLLM's ``AsyncLLM`` streams a request with ``n > 1`` as one output per
    sequence and step too, each holding that one sequence, so a vLLM loop's ``out.outputs[0].text`` reads
    this sequence's text so far.
    """

    __slots__ = ("request_id", "index", "new_token_ids", "new_text", "new_logprobs", "new_logprob_ranks",
                 "new_top_logprobs", "num_output_tokens", "finish_reason", "stop_reason", "time", "first_time",
                 "previous_time", "_stream", "_sequence", "_num_pieces")

    def __init__(self, stream: RequestStream, sequence: _Sequence, delta: _Delta, previous_time: float | None):
        self.request_id = stream.request_id
        self.index = delta.index
        self.new_token_ids = delta.new_token_ids
        self.new_text = delta.new_text
        self.new_logprobs = delta.new_logprobs
        self.new_logprob_ranks = delta.new_logprob_ranks
        self.new_top_logprobs = delta.new_top_logprobs
        self.num_output_tokens = delta.num_output_tokens
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason
        self.time = delta.time
        self.first_time = sequence.first_time
        self.previous_time = previous_time
        self._stream = stream
        self._sequence = sequence
        self._num_pieces = len(sequence.pieces)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt(self) -> str | None:
        return self._stream.prompt

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return self._stream.prompt_token_ids

    @property
    def outputs(self) -> list[StreamOutput]:
        return [self]

    @property
    def text(self) -> str:
        return "".join(self._sequence.pieces[:self._num_pieces])

    @property
    def token_ids(self) -> list[int]:
        return self._sequence.token_ids[:self.num_output_tokens]

    @property
    def logprobs(self) -> list[float] | None:
        values = self._sequence.logprobs
        return None if values is None else values[:self.num_output_tokens]

    @property
    def cumulative_logprob(self) -> float | None:
        values = self._sequence.logprobs
        return None if values is None else math.fsum(values[:self.num_output_tokens])

    @property
    def logprob_ranks(self) -> list[int] | None:
        values = self._sequence.logprob_ranks
        return None if values is None else values[:self.num_output_tokens]

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        values = self._sequence.top_logprobs
        return None if values is None else values[:self.num_output_tokens]

    @property
    def num_cached_tokens(self) -> int:
        return self._sequence.num_cached_tokens

    @property
    def prompt_logprobs(self) -> list | None:
        return self._sequence.prompt_logprobs

    @property
    def prompt_logprob_ranks(self) -> list | None:
        return self._sequence.prompt_logprob_ranks

    @property
    def prompt_top_logprobs(self) -> list | None:
        return self._sequence.prompt_top_logprobs

    def __repr__(self) -> str:
        return (f"StreamOutput(request_id={self.request_id!r}, index={self.index}, "
                f"num_output_tokens={self.num_output_tokens}, finish_reason={self.finish_reason!r})")


_END = object()  # the stream's last item: every sequence finished, or the request was aborted


class RequestStream:
    """The outputs of one request, in step order (its n sequences interleaved): an async iterator
    of ``StreamOutput``. Iteration ends when every sequence has finished, or after ``abort()``;
    it raises ``EngineStepError`` when a step that ran the request raised, ``EngineClosedError``
    when the async engine shut down first. ``abort()`` is idempotent.

    The outputs wait in a deque; a consumer with nothing to read waits on a future of its own, which
    the next delivery resolves (an ``asyncio.Queue`` costs a few times more per output, on the loop
    that the step thread shares the GIL with)."""

    def __init__(self, owner: AsyncEngine, request_id: str, params: SamplingParams, prompt: str | None = None):
        self.request_id = request_id
        self.params = params
        self.prompt = prompt  # its text when given as text (request.prompt_text_of)
        self.arrival_time = time.monotonic()
        self.prompt_token_ids: list[int] | None = None  # known from the first output
        self.sequences = [_Sequence(params) for _ in range(params.n)]
        self.state = "waiting"  # -> "running" (first output) -> "done"
        self.aborted = False
        self._owner = owner
        self._loop = asyncio.get_running_loop()
        # StreamOutputs, then _END or the error, which stays: iterating again ends (raises) again
        self._items: deque = deque()
        self._waiters: list[asyncio.Future] = []  # consumers waiting for an item
        self._accepted: asyncio.Future = self._loop.create_future()
        self._num_finished = 0
        self.engine_id: int | None = None  # the engine's id; read and written by the step thread only

    @property
    def finished(self) -> bool:
        return self.state == "done"

    @property
    def num_ready(self) -> int:
        """Outputs the next ``__anext__`` calls return without waiting (a consumer may batch its writes); the
        end of the stream (or its error), which stays queued, is not one."""
        items = self._items
        if items and items[-1].__class__ is not StreamOutput:
            return len(items) - 1
        return len(items)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        items = self._items
        while not items:
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:  # cancelled: forget the waiter (an item that came meanwhile stays queued)
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise
        item = items[0]
        if item.__class__ is StreamOutput:
            items.popleft()
            return item
        if item is _END:
            raise StopAsyncIteration
        raise item

    def abort(self) -> None:
        """Stop the request (all its sequences) and free its blocks; a finished one is left alone."""
        self._owner._abort_stream(self)

    # (loop side, called by the owner)
    def _put(self, item) -> None:
        self._items.append(item)
        waiters = self._waiters
        if waiters:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            waiters.clear()

    def _drop_unread(self) -> None:
        """Forget the outputs delivered but not read yet (an abort: iteration ends at once)."""
        self._items.clear()

    def _end_aborted(self, now: float) -> None:
        """Finish every sequence not finished yet with reason "abort" and no new token (the engine dropped the
        request: ``AsyncEngine._end_requests_the_engine_dropped``)."""
        for index, sequence in enumerate(self.sequences):
            if not sequence.finished:
                self._on_delta(_Delta(index, [], "", None, None, len(sequence.token_ids), "abort", None, now, None, 0,
                                      None, None))

    def _on_delta(self, delta: _Delta) -> bool:
        """Record one sequence's step; returns True when this completed the request."""
        if delta.prompt_token_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = delta.prompt_token_ids
        sequence = self.sequences[delta.index]
        previous_time = sequence.last_time
        if sequence.first_time is None:
            sequence.first_time = delta.time
        sequence.last_time = delta.time
        if delta.new_text:
            sequence.pieces.append(delta.new_text)
        sequence.token_ids.extend(delta.new_token_ids)
        if sequence.logprobs is not None and delta.new_logprobs is not None:
            sequence.logprobs.extend(delta.new_logprobs)
            sequence.logprob_ranks.extend(delta.new_logprob_ranks)
        if sequence.top_logprobs is not None and delta.new_top_logprobs is not None:
            sequence.top_logprobs.extend(delta.new_top_logprobs)
        if delta.prompt_logprobs is not None:
            sequence.prompt_logprobs = delta.prompt_logprobs
            sequence.prompt_logprob_ranks = delta.prompt_logprob_ranks
            sequence.prompt_top_logprobs = delta.prompt_top_logprobs
        if delta.finish_reason is not None:
            sequence.finished = True
            sequence.num_cached_tokens = delta.num_cached_tokens
            self._num_finished += 1
        self._put(StreamOutput(self, sequence, delta, previous_time))
        if self._num_finished == self.params.n:
            self._put(_END)
            return True
        return False

    def _end(self, error: BaseException | None = None) -> None:
        self._put(_END if error is None else error)
        if not self._accepted.done():
            if error is None:  # aborted before the engine took it: add_request returns an ended stream
                self._accepted.set_result(None)
            else:
                self._accepted.set_exception(error)
                self._accepted.exception()  # marked retrieved: the awaiting add_request raises it itself
