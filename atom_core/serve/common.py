"""What the endpoints share: the server's settings and state, OpenAI-style errors, prompt and
length checks, adding requests, reading their outputs (with the metrics), log-prob formatting, SSE.

Per streamed token the event loop reads an output, records it in the metrics and writes a chunk; the
step thread waits for the GIL meanwhile, so that path is kept short: one async-generator layer over a
single stream, and chunks written from a per-request head (``sse_head``) plus the JSON of what
changed (``json_value``), the same bytes as ``sse`` of the whole payload.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from atom_core.engine.async_engine import AsyncEngine, EngineClosedError, EngineStepError, QueueFullError
from atom_core.engine.sleep_mode import EngineAsleepError
from atom_core.engine.distributed import DistributedEngineError
from atom_core.engine.request_stream import RequestStream, StreamOutput
from atom_core.engine.sampling_params import SamplingParams
from atom_core.serve.metrics import ServerMetrics
from atom_core.serve.protocol import sampling_param_of

_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # what sse writes (json.dumps' arguments)
json_str = json.encoder.encode_basestring  # a str as _COMPACT writes it (ensure_ascii=False)

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
MIN_LOGPROB = -9999.0  # JSON has no -inf: a log-prob below this is reported as this (vLLM's floor)
SSE_DONE = "data: [DONE]\n\n"

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ServerConfig:
    """Server settings (``atom-core serve`` flags).

    ``max_output_tokens``: the most ``max_tokens`` a request may ask (default: max_model_len).
    ``chat_template``: a template (the source text) used instead of the model's own.
    ``trust_request_chat_template``: a chat request may bring its own ``chat_template`` (vLLM's
    ``--trust-request-chat-template``; refused otherwise: the template runs on the server).
    ``model_aliases``: more names a request may give for the model (vLLM's ``--served-model-name a b``:
    ``a`` is ``model_name``, the one responses give); /v1/models lists them after it.
    ``enable_rl_endpoints``: the routes of ``atom_core.serve.rl_routes`` (weight updates, sleep mode).
    ``allowed_origins`` / ``allowed_methods`` / ``allowed_headers`` / ``allow_credentials``: the CORS answer to
    browsers (vLLM's flags and defaults: every origin, method and header; no credentials).
    """

    model_name: str = "atom_core"
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_output_tokens: int | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    enable_rl_endpoints: bool = False
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass
class ServerContext:
    async_engine: AsyncEngine
    config: ServerConfig
    metrics: ServerMetrics
    _token_texts: dict[int, str] = field(default_factory=dict)

    def __post_init__(self):
        engine = self.async_engine.engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model.config.vocab_size
        self.max_logprobs = engine.max_logprobs
        self.default_params: SamplingParams = engine.default_sampling_params
        # generation_config.json's max_new_tokens: a chat request's max_tokens when it gives none (vLLM's default;
        # completions keep OpenAI's 16, as vLLM's do). None: the room the context leaves.
        self.default_max_tokens: int | None = engine.generation_defaults.get("max_tokens")
        limit = self.config.max_output_tokens
        self.max_output_tokens = self.max_model_len if limit is None else min(limit, self.max_model_len)

    # ---- prompts and lengths

    def encode(self, text: str, param: str = "prompt", *, add_special_tokens: bool = True,
               truncate: tuple[int, str] | None = None) -> list[int]:
        """``text``'s token ids (with the special tokens the tokenizer adds, unless not ``add_special_tokens``),
        ``truncate`` = (k, side) cut as transformers' truncation cuts (``truncate_ids``)."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (tokenizer.json): send token-id prompts", param=param)
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if truncate is not None and truncate[0] < len(token_ids):
            plain = token_ids if not add_special_tokens else self.tokenizer.encode(text, add_special_tokens=False)
            token_ids = truncate_ids(token_ids, *truncate, plain=plain)
        if not token_ids:
            raise APIError(400, "the prompt is empty (no tokens)", param=param)
        return token_ids

    def prompt_top_logprobs(self, prompt_logprobs: int | None) -> int | None:
        """The top alternatives per prompt token that vLLM's ``prompt_logprobs`` asks for (-1: the whole
        vocabulary), or None; a 400 above the engine's ``max_logprobs``."""
        top = self.vocab_size if prompt_logprobs == -1 else prompt_logprobs
        if top is not None and top > self.max_logprobs:
            raise APIError(400, f"prompt_logprobs={prompt_logprobs}: at most {self.max_logprobs}",
                           param="prompt_logprobs")
        return top

    def truncation(self, k: int | None, side: str | None, max_tokens: int,
                   max_tokens_param: str = "max_tokens") -> tuple[int, str] | None:
        """vLLM's ``truncate_prompt_tokens`` as (tokens to keep, side): k of them (-1: as many as
        max_model_len leaves beside the request's ``max_tokens``, 0 when it gives none), kept from the
        end ("left" truncation, vLLM's default) or the start ("right"). A k above that room is a 400."""
        if k is None:
            return None
        room = self.max_model_len - max_tokens
        keep = room if k == -1 else k
        if not 1 <= keep <= room:
            raise APIError(400, f"truncate_prompt_tokens={k} keeps {keep} tokens: it must keep 1 to max_model_len - "
                                f"{max_tokens_param} = {self.max_model_len} - {max_tokens} = {room}",
                           param="truncate_prompt_tokens")
        return keep, side or "left"

    def check_token_ids(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)

    def max_tokens_for(self, requested: int | None, num_prompt_tokens: int, default: int | None,
                       param: str = "max_tokens", prompt_param: str = "prompt") -> int:
        """The request's max_tokens, checked against the server's limit and the context length; without
        one, ``default`` (completions: 16; chat: generation_config.json's max_new_tokens, ``default_max_tokens``)
        capped by the room the context leaves and the server's limit; ``default`` None = all that room."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"the prompt has {num_prompt_tokens} tokens; this model's context is "
                                f"max_model_len={self.max_model_len} tokens (prompt + output)",
                           param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return min(room, self.max_output_tokens, room if default is None else default)
        if requested > self.max_output_tokens:
            raise APIError(400, f"{param}={requested} exceeds this server's limit of {self.max_output_tokens}",
                           param=param)
        if requested > room:
            raise APIError(400, f"the prompt has {num_prompt_tokens} tokens and {param}={requested}: "
                                f"{num_prompt_tokens + requested} exceeds max_model_len={self.max_model_len}",
                           param=param, code="context_length_exceeded")
        return requested

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")

    # ---- running requests

    async def add_requests(self, prompts: list[list[int]], params: list[SamplingParams],
                           structured_param: str | None = None) -> list[RequestStream]:
        """One stream per prompt, prompt i with ``params[i]``; on any refusal the ones already added are
        aborted. A structured-output constraint the engine refuses (a schema, regex or grammar that does not
        compile) is a 400 naming ``structured_param``, the request field that asked for it."""
        streams: list[RequestStream] = []
        try:
            for token_ids, prompt_params in zip(prompts, params, strict=True):
                streams.append(await self.async_engine.add_request(token_ids, prompt_params))
        except BaseException as e:
            for stream in streams:
                stream.abort()
            if isinstance(e, QueueFullError):
                self.metrics.rejected.labels(reason="queue_full").inc()
                raise APIError(503, str(e), code="queue_full") from None
            if isinstance(e, EngineClosedError):
                raise APIError(503, str(e), code="shutting_down") from None
            if isinstance(e, EngineAsleepError):  # (an RL loop's trainer holds the GPU: retry after /wake_up)
                raise APIError(503, str(e), code="engine_asleep") from None
            if isinstance(e, DistributedEngineError):  # a worker rank or replica failed: nothing runs any more
                raise APIError(503, str(e), code="engine_failed") from None
            if isinstance(e, (ValueError, TypeError)):
                self.metrics.rejected.labels(reason="invalid").inc()
                param = sampling_param_of(str(e))
                if structured_param and param and param.startswith("structured_outputs"):
                    param = structured_param
                raise APIError(400, str(e), param=param) from None
            raise
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        return streams

    async def outputs(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamOutput]]:
        """(stream number, output) of every stream as they come; records the metrics. Leaving early
        (an exception, cancellation on a client disconnect) aborts the streams still running."""
        errored: set[int] = set()
        reasons: dict[int, str] = {}
        observe = self.metrics.observe
        try:
            if len(streams) == 1:  # read here: no generator layers in between (one per token each)
                stream = streams[0]
                next_output = stream.__anext__
                while True:
                    try:
                        out = await next_output()
                    except StopAsyncIteration:
                        break
                    except (EngineStepError, EngineClosedError):
                        errored.add(0)
                        raise
                    observe(out, stream)
                    if out.finish_reason is not None:
                        reasons[0] = out.finish_reason
                    yield 0, out
            else:
                async for i, out in _tag_errors(_merged(streams), errored):
                    observe(out, streams[i])
                    if out.finished:
                        reasons[i] = out.finish_reason
                    yield i, out
        finally:
            for i, stream in enumerate(streams):
                if i in errored:
                    self.metrics.request_ended(stream, "error")
                elif stream.finished and not stream.aborted and all(s.finished for s in stream.sequences):
                    self.metrics.request_ended(stream, reasons.get(i, "stop"))
                else:
                    stream.abort()
                    self.metrics.request_ended(stream, "abort")

    @staticmethod
    def more_ready(streams: list[RequestStream]) -> bool:
        """Whether another output is already queued: a stream then sends its events in one write."""
        for stream in streams:
            if stream.num_ready:
                return True
        return False

    # ---- log-probs

    def token_text(self, token_id: int) -> str:
        """A token as text (special tokens included); "token_id:N" without a tokenizer (vLLM's form)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._token_texts[token_id] = text
        return text


def truncate_ids(token_ids: list[int], k: int, side: str, plain: list[int] | None = None) -> list[int]:
    """``token_ids`` cut to k tokens: the last k ("left") or the first k ("right"). With ``plain`` (the same
    text encoded without special tokens), transformers' rule for a text prompt: the special tokens the tokenizer
    added (a BOS) stay, and the text's tokens are cut to k minus their number."""
    num_special = 0 if plain is None else len(token_ids) - len(plain)
    if 0 < num_special < k:
        start = next((i for i in range(num_special + 1) if token_ids[i:i + len(plain)] == plain), None)
        if start is not None:
            kept = k - num_special
            text = plain[-kept:] if side == "left" else plain[:kept]
            return token_ids[:start] + text + token_ids[start + len(plain):]
    return token_ids[-k:] if side == "left" else token_ids[:k]


async def _merged(streams: list[RequestStream]):
    """Several streams interleaved in arrival order (a completion request with several prompts)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                item.stream_index = i
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _tag_errors(source, errored: set[int]):
    try:
        async for item in source:
            yield item
    except (EngineStepError, EngineClosedError) as e:
        errored.add(getattr(e, "stream_index", 0))
        raise


def logprob(value: float | None) -> float | None:
    if value is None:
        return None
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else float(value)


def token_id_text(token_id: int) -> str:
    """A token written as vLLM's ``return_tokens_as_token_ids`` writes it."""
    return f"token_id:{token_id}"


def prompt_logprobs_json(token_ids, values, ranks, tops, num_top: int, token_text) -> list:
    """vLLM's ``prompt_logprobs``: None for the first token, then per prompt token ``{token id: {"logprob",
    "rank", "decoded_token"}}`` for the token itself (its rank over the vocabulary: the engine's
    ``prompt_logprob_ranks``) and the ``num_top`` most likely there (ranks 1..num_top, which a token among
    them takes, as in vLLM's dict)."""
    result = []
    for k, token_id in enumerate(token_ids):
        value = None if values is None else values[k]
        if value is None:
            result.append(None)
            continue
        top = list((tops[k] or {}).items())[:num_top] if tops is not None else []
        entry = {str(token_id): {"logprob": logprob(value), "rank": ranks[k], "decoded_token": token_text(token_id)}}
        for i, (t, v) in enumerate(top):
            entry[str(t)] = {"logprob": logprob(v), "rank": i + 1, "decoded_token": token_text(t)}
        result.append(entry)
    return result


def sse(payload: dict) -> str:
    return f"data: {_COMPACT.encode(payload)}\n\n"


def sse_head(fields: dict) -> str:
    """The start of ``sse(fields | {"choices": [choice]})`` up to the choice's first key: a stream's
    chunks that carry one choice are this head, the choice's fields written with ``json_value`` in
    ``sse``'s form (``"key":value``, comma-separated), then ``SSE_CHOICE_END``."""
    body = _COMPACT.encode({**fields, "choices": [{}]})
    assert body.endswith("[{}]}")
    return "data: " + body[:-3]


SSE_CHOICE_END = "}]}\n\n"


def choice_chunk(head: str, index: int, body: str, logprobs, finish_reason: str | None,
                 stop_reason: str | int | None) -> str:
    """A streamed chunk of one choice: ``head`` (``sse_head``), ``"index"``, ``body`` (the choice's content
    field, already in ``sse``'s form: ``"text":...`` or ``"delta":{...}``), then ``"logprobs"``,
    ``"finish_reason"`` and ``"stop_reason"``: the bytes ``sse`` writes for the whole payload."""
    if logprobs is None and finish_reason is None and stop_reason is None:  # (most chunks)
        return f'{head}"index":{index},{body},"logprobs":null,"finish_reason":null,"stop_reason":null{SSE_CHOICE_END}'
    return (f'{head}"index":{index},{body},"logprobs":{json_value(logprobs)},"finish_reason":'
            f'{json_value(finish_reason)},"stop_reason":{json_value(stop_reason)}{SSE_CHOICE_END}')


def json_value(value) -> str:
    """``value`` as ``sse`` writes it inside a payload."""
    if value is None:
        return "null"
    if value.__class__ is str:
        return json_str(value)
    return _COMPACT.encode(value)


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def stream_error_event(e: BaseException) -> str:
    """The SSE event sent when a request fails after its stream started (vLLM sends the same)."""
    return sse(error_body(str(e), "server_error", code="engine_error"))
