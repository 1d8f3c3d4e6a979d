"""``POST /v1/completions``: text or token-id prompts (one or a batch), streamed or not.

Choice ``i * n + j`` is prompt i's sequence j (OpenAI's order). ``echo`` puts the prompt before
the text (with ``logprobs``, the prompt's tokens lead the log-probs: the first has none, as in
OpenAI's legacy API and vLLM). ``logprobs=N``: per token its text, log-prob, the N most likely
alternatives plus the chosen one (``{text: log-prob}``), and its text offset: the characters of the token
strings before it (vLLM's; with echo the prompt's tokens count, a BOS the tokenizer added included).

vLLM's extras: ``max_tokens=0`` with ``echo`` scores the prompt only (the prompt, its log-probs with
``logprobs``, ``finish_reason`` "length", no completion tokens: one token is sampled and dropped, as vLLM
does); ``prompt_logprobs=N`` gives each choice vLLM's ``prompt_logprobs`` list; ``truncate_prompt_tokens``
keeps the prompt's last k tokens (echo still returns a text prompt as sent, as vLLM's does);
``add_special_tokens``; ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import replace

from atom_core.engine.async_engine import EngineClosedError, EngineStepError
from atom_core.engine.request_stream import RequestStream
from atom_core.serve.common import (SSE_DONE, APIError, ServerContext, choice_chunk, json_str, logprob, now,
                                    prompt_logprobs_json, request_id, sse, sse_head, stream_error_event,
                                    token_id_text, truncate_ids, usage)
from atom_core.serve.protocol import CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class _Prompt:
    __slots__ = ("token_ids", "text")

    def __init__(self, token_ids: list[int], text: str | None):
        self.token_ids, self.text = token_ids, text


class CompletionJob:
    """One completion request from parsing to its response."""

    def __init__(self, ctx: ServerContext, req: CompletionRequest):
        self.ctx, self.req = ctx, req
        ctx.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (best-of selection is not supported)", param="best_of")
        if req.logprobs is not None and req.logprobs > ctx.max_logprobs:
            raise APIError(400, f"logprobs={req.logprobs}: at most {ctx.max_logprobs}", param="logprobs")
        # max_tokens=0: the prompt alone (with echo), from a run of one token that is then dropped (vLLM's way)
        self.echo_only = req.max_tokens == 0
        if self.echo_only and not req.echo:
            raise APIError(400, "max_tokens=0 needs echo=true (it returns the prompt and its log-probs only)",
                           param="max_tokens")
        if self.echo_only and req.min_tokens:
            raise APIError(400, f"min_tokens={req.min_tokens} needs max_tokens >= min_tokens, got max_tokens=0",
                           param="min_tokens")
        self.num_prompt_top = ctx.prompt_top_logprobs(req.prompt_logprobs)
        self.token_text = token_id_text if req.return_tokens_as_token_ids else ctx.token_text
        requested = DEFAULT_MAX_TOKENS if req.max_tokens is None else max(req.max_tokens, 1)
        truncate = ctx.truncation(req.truncate_prompt_tokens, req.truncation_side, requested)
        self.prompts: list[_Prompt] = []
        for p in req.prompt:
            if isinstance(p, str):
                self.prompts.append(_Prompt(ctx.encode(p, add_special_tokens=req.add_special_tokens,
                                                       truncate=truncate), p))
            else:
                ctx.check_token_ids(p)
                self.prompts.append(_Prompt(list(p) if truncate is None else truncate_ids(list(p), *truncate), None))
        # Each prompt's own max_tokens: without one in the request, the default capped by that prompt's room.
        max_tokens = [ctx.max_tokens_for(None if req.max_tokens is None else requested, len(p.token_ids),
                                         DEFAULT_MAX_TOKENS) for p in self.prompts]
        self.echo_logprobs = req.echo and req.logprobs is not None
        # The engine computes the prompt's log-probs once, with the most alternatives either use asks for.
        asked = [n for n in (req.logprobs if self.echo_logprobs else None,
                             None if req.stream else self.num_prompt_top) if n is not None]
        self.params = req.sampling_params(max_tokens=max_tokens[0], logprobs=req.logprobs,
                                          prompt_logprobs=max(asked) if asked else None, default=ctx.default_params)
        self.prompt_params = [self.params if m == self.params.max_tokens else replace(self.params, max_tokens=m)
                              for m in max_tokens]
        self.id = request_id("cmpl")
        self.created = now()
        self.streams: list[RequestStream] = []
        self._head = sse_head({"id": self.id, "object": "text_completion", "created": self.created,
                               "model": ctx.config.model_name})

    async def start(self) -> None:
        self.streams = await self.ctx.add_requests([p.token_ids for p in self.prompts], self.prompt_params,
                                                   structured_param=self.req.structured_output()[1])

    def abort(self) -> None:
        """Abort the requests still running (the response ended early: idempotent)."""
        for stream in self.streams:
            stream.abort()

    def _echo_text(self, i: int) -> str:
        prompt = self.prompts[i]
        if prompt.text is None:
            tok = self.ctx.tokenizer
            prompt.text = "" if tok is None else tok.decode(prompt.token_ids, skip_special_tokens=False)
        return prompt.text

    def _logprobs(self, token_ids, values, tops, offset: int) -> dict:
        """OpenAI's completion log-probs of some tokens, their text offsets starting at ``offset``."""
        text = self.token_text
        tokens = [text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = []
        num_top = self.req.logprobs  # (prompt positions may hold more: prompt_logprobs asked for more)
        for k in range(len(token_ids)):
            entry = {} if tops is None or tops[k] is None else {
                text(t): logprob(v) for t, v in itertools.islice(tops[k].items(), num_top)}
            if values[k] is not None:
                entry.setdefault(tokens[k], logprob(values[k]))
            top.append(entry or None)
        return {"tokens": tokens, "token_logprobs": [logprob(v) for v in values], "top_logprobs": top,
                "text_offset": offsets}

    def _output_offset(self, i: int) -> int:
        """Where prompt i's output tokens' text offsets start: after the prompt tokens' strings when their
        log-probs lead (the offsets run over the tokens' strings, as vLLM's: a BOS the tokenizer added counts),
        else 0."""
        if not self.echo_logprobs or self.echo_only:
            return 0
        text = self.token_text
        return sum(len(text(t)) for t in self.prompts[i].token_ids)

    def _prompt_logprobs(self, i: int, out) -> dict:
        prompt = self.prompts[i].token_ids
        values = out.prompt_logprobs or [None] * len(prompt)
        tops = out.prompt_top_logprobs
        return self._logprobs(prompt, values, tops, 0)

    def _vllm_prompt_logprobs(self, i: int, out) -> list:
        """The choice's ``prompt_logprobs`` (vLLM's shape: ``prompt_logprobs_json``)."""
        return prompt_logprobs_json(self.prompts[i].token_ids, out.prompt_logprobs, out.prompt_logprob_ranks,
                                    out.prompt_top_logprobs, self.num_prompt_top, self.ctx.token_text)

    @staticmethod
    def _join(a: dict | None, b: dict) -> dict:
        if a is None:
            return b
        return {key: a[key] + b[key] for key in b}

    # ---- non-streaming

    async def response(self) -> dict:
        n = self.params.n
        finals = {}
        async for i, out in self.ctx.outputs(self.streams):
            if out.finished:
                finals[i * n + out.index] = (i, out)
        choices = []
        completion_tokens = 0
        for index in sorted(finals):
            i, out = finals[index]
            prefix = self._echo_text(i) if self.req.echo else ""
            if self.echo_only:  # the prompt alone: the token run to score it is dropped
                logprobs = self._prompt_logprobs(i, out) if self.echo_logprobs else None
                choice = {"index": index, "text": prefix, "logprobs": logprobs, "finish_reason": "length",
                          "stop_reason": None}
            else:
                completion_tokens += out.num_output_tokens
                logprobs = None
                if self.req.logprobs is not None:
                    logprobs = self._logprobs(out.token_ids, out.logprobs, out.top_logprobs, self._output_offset(i))
                    if self.echo_logprobs:
                        logprobs = self._join(self._prompt_logprobs(i, out), logprobs)
                choice = {"index": index, "text": prefix + out.text, "logprobs": logprobs,
                          "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
            if self.num_prompt_top is not None:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(i, out)
            choices.append(choice)
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.ctx.config.model_name, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens)}

    # ---- streaming

    def chunk(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
              stop_reason: str | int | None) -> str:
        """One streamed choice: ``sse`` of ``{"id", "object", "created", "model", "choices": [{"index",
        "text", "logprobs", "finish_reason", "stop_reason"}]}``, written from the request's head."""
        return choice_chunk(self._head, index, f'"text":{json_str(text)}', logprobs, finish_reason, stop_reason)

    async def events(self) -> AsyncIterator[str]:
        n = self.params.n
        offsets: dict[int, int] = {}  # choice -> the text offset of its next output token
        completion_tokens = 0
        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        echo, with_logprobs = self.req.echo, self.req.logprobs is not None
        echo_only = self.echo_only
        streams = self.streams
        more_ready = self.ctx.more_ready
        chunk = self.chunk
        pending: list[str] = []
        try:
            async for i, out in self.ctx.outputs(streams):
                index = i * n + out.index
                finish_reason, stop_reason = out.finish_reason, out.stop_reason
                if echo_only:  # the prompt once per choice, then its end; the token run to score it is dropped
                    first = index not in offsets
                    offsets[index] = 0
                    text = self._echo_text(i) if first else ""
                    logprobs = self._prompt_logprobs(i, out) if first and self.echo_logprobs else None
                    finish_reason, stop_reason = (None if finish_reason is None else "length"), None
                else:
                    text, logprobs = out.new_text, None
                    if finish_reason is not None:
                        completion_tokens += out.num_output_tokens
                if not echo_only and (echo or with_logprobs):  # (else: the text as it is, no offsets to keep)
                    if index not in offsets:
                        offsets[index] = self._output_offset(i)
                        if echo:
                            text = self._echo_text(i) + text
                            if self.echo_logprobs:
                                logprobs = self._prompt_logprobs(i, out)
                    if with_logprobs:
                        new = self._logprobs(out.new_token_ids, out.new_logprobs, out.new_top_logprobs,
                                             offsets[index])
                        logprobs = self._join(logprobs, new)
                    offsets[index] += len(out.new_text)
                pending.append(chunk(index, text, logprobs, finish_reason, stop_reason))
                if not more_ready(streams):  # else: one write for the outputs already here
                    yield "".join(pending)
                    pending.clear()
            if pending:
                yield "".join(pending)
                pending.clear()
            if include_usage:
                prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
                yield sse({"id": self.id, "object": "text_completion", "created": self.created,
                           "model": self.ctx.config.model_name, "choices": [],
                           "usage": usage(prompt_tokens, completion_tokens)})
        except (EngineStepError, EngineClosedError) as e:
            yield "".join(pending) + stream_error_event(e)
        yield SSE_DONE
