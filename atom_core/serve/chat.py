"""``POST /v1/chat/completions``: a conversation rendered by the model's chat template, streamed or not.

The conversation goes through ``Tokenizer.apply_chat_template`` (the template ``Engine.chat``
renders): the request's ``chat_template`` (with ``--trust-request-chat-template``, as vLLM), else the
server's ``--chat-template``, else the model's. ``tools``, ``documents``, ``chat_template_kwargs``,
``reasoning_effort`` (vLLM: also ``enable_thinking``) and vLLM's ``add_generation_prompt`` /
``continue_final_message`` go to the template; the text is then encoded (``add_special_tokens``,
``truncate_prompt_tokens``). Without ``max_tokens`` the reply runs to the model's generation_config.json
``max_new_tokens``, else to the end of the context (vLLM's default). The assistant's text is returned as it is:
tool calls are not parsed out of it. ``response_format`` (json_object, json_schema) and vLLM's
``guided_*`` / ``structured_outputs`` constrain it through a grammar (docs/serving.md).

Streaming follows OpenAI's chunks: first a ``{"role": "assistant", "content": ""}`` delta per
choice, then ``{"content": ...}`` deltas with the choice's ``finish_reason`` on its last one, then
a ``usage`` chunk (``stream_options.include_usage``), then ``[DONE]``. The reply's role is "assistant",
or with ``add_generation_prompt: false`` the last message's role (vLLM's rule: the reply goes on that turn).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from atom_core.engine.async_engine import EngineClosedError, EngineStepError
from atom_core.engine.request_stream import RequestStream
from atom_core.serve.common import (SSE_DONE, APIError, ServerContext, choice_chunk, json_str, logprob, now,
                                    prompt_logprobs_json, request_id, sse, sse_head, stream_error_event,
                                    token_id_text, usage)
from atom_core.serve.protocol import ChatCompletionRequest


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest, truncate: tuple[int, str] | None = None) -> list[int]:
    """The token ids of ``req``'s conversation as the chat template writes it (the request's template where the
    server trusts it, else the server's, else the checkpoint's), ``truncate`` as ``ServerContext.encode`` takes
    it; a 400 naming the field for what the template or the request's fields refuse. (/tokenize reads it too.)"""
    from atom_core.engine.chat_template import ChatTemplateError, template_call_arguments

    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer (tokenizer.json): chat needs one", param="messages")
    if req.chat_template is not None and not ctx.config.trust_request_chat_template:
        raise APIError(400, "chat_template: a template in the request needs a server started with "
                            "--trust-request-chat-template (vLLM's rule: the template runs on the server)",
                       param="chat_template")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true "
                            "(add_generation_prompt defaults to true: send add_generation_prompt=false)",
                       param="continue_final_message")
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = template_call_arguments() & kwargs.keys()
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")
    if req.reasoning_effort is not None:  # vLLM's: the template reads it, and enable_thinking unless given
        thinking = kwargs.get("enable_thinking", req.reasoning_effort != "none")
        kwargs.update(reasoning_effort=req.reasoning_effort, enable_thinking=thinking)
    template = req.chat_template if req.chat_template is not None else ctx.config.chat_template
    try:
        text = ctx.tokenizer.apply_chat_template(
            req.conversation(), add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, chat_template=template, tools=req.tools,
            documents=req.documents, tokenize=False, **kwargs)
    except ChatTemplateError as e:
        param = "chat_template" if req.chat_template is not None else "messages"
        raise APIError(400, str(e), param=param) from None
    if not text:
        raise APIError(400, "the chat template rendered an empty prompt", param="messages")
    return ctx.encode(text, "messages", add_special_tokens=req.add_special_tokens, truncate=truncate)


class ChatJob:
    """One chat completion request from parsing to its response."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest):
        self.ctx, self.req = ctx, req
        ctx.check_model(req.model)
        # Tool calls are not parsed out of the text, so only tool_choice "none" (the tools rendered into the prompt,
        # the reply plain text) is served. "auto", which OpenAI and vLLM take when tools come without a choice,
        # would promise a tool_calls field it cannot fill: refused, as vLLM refuses it without a tool-call parser.
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if choice != "none":
            raise APIError(400, f"tool_choice={choice!r}{' (the default with tools)' if req.tool_choice is None else ''}"
                                f": tool calls are not parsed out of the reply here; send tool_choice 'none' to have "
                                f"the tools rendered into the prompt and read any call from the text",
                           param="tool_choice", code="unsupported")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and req.top_logprobs > ctx.max_logprobs:
            raise APIError(400, f"top_logprobs={req.top_logprobs}: at most {ctx.max_logprobs}", param="top_logprobs")
        self.num_prompt_top = ctx.prompt_top_logprobs(req.prompt_logprobs)
        self.token_text = token_id_text if req.return_tokens_as_token_ids else ctx.token_text
        requested, param = req.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, param = req.max_tokens, "max_tokens"
        truncate = ctx.truncation(req.truncate_prompt_tokens, req.truncation_side, requested or 0, param)
        self.prompt = chat_prompt(ctx, req, truncate)
        max_tokens = ctx.max_tokens_for(requested, len(self.prompt), ctx.default_max_tokens, param=param,
                                        prompt_param="messages")
        self.params = req.sampling_params(max_tokens=max_tokens,
                                          logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                          prompt_logprobs=None if req.stream else self.num_prompt_top,
                                          default=ctx.default_params)
        # vLLM's get_chat_request_role: without a generation prompt the reply continues the last message's turn
        self.role = "assistant" if req.add_generation_prompt else req.messages[-1].role
        self.id = request_id("chatcmpl")
        self.created = now()
        self.stream: RequestStream | None = None
        self._head = sse_head({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                               "model": ctx.config.model_name})

    async def start(self) -> None:
        self.stream = (await self.ctx.add_requests([self.prompt], [self.params],
                                                   structured_param=self.req.structured_output()[1]))[0]

    def abort(self) -> None:
        """Abort the request if it still runs (the response ended early: idempotent)."""
        if self.stream is not None:
            self.stream.abort()

    def _logprobs(self, token_ids, values, tops) -> dict | None:
        if values is None:
            return None
        text = self.token_text
        content = []
        for k, token_id in enumerate(token_ids):
            token = text(token_id)
            alternatives = [] if tops is None or tops[k] is None else [
                {"token": text(t), "logprob": logprob(v), "bytes": list(text(t).encode("utf-8"))}
                for t, v in tops[k].items()]
            content.append({"token": token, "logprob": logprob(values[k]), "bytes": list(token.encode("utf-8")),
                            "top_logprobs": alternatives})
        return {"content": content}

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.ctx.config.model_name, "choices": choices, **extra}

    async def response(self) -> dict:
        finals = {}
        async for _, out in self.ctx.outputs([self.stream]):
            if out.finished:
                finals[out.index] = out
        choices = []
        for index in sorted(finals):
            out = finals[index]
            choices.append({"index": index, "message": {"role": self.role, "content": out.text},
                            "logprobs": self._logprobs(out.token_ids, out.logprobs, out.top_logprobs)
                            if self.req.logprobs else None,
                            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        completion_tokens = sum(out.num_output_tokens for out in finals.values())
        response = {"id": self.id, "object": "chat.completion", "created": self.created,
                    "model": self.ctx.config.model_name, "choices": choices,
                    "usage": usage(len(self.prompt), completion_tokens)}
        if self.num_prompt_top is not None and finals:  # vLLM's: the response's, not a choice's
            out = finals[min(finals)]
            response["prompt_logprobs"] = prompt_logprobs_json(self.prompt, out.prompt_logprobs,
                                                               out.prompt_logprob_ranks, out.prompt_top_logprobs,
                                                               self.num_prompt_top, self.ctx.token_text)
        return response

    def delta_chunk(self, index: int, content: str, logprobs: dict | None, finish_reason: str | None,
                    stop_reason: str | int | None) -> str:
        """One streamed content delta: ``sse`` of ``self._chunk([{"index", "delta": {"content"}, "logprobs",
        "finish_reason", "stop_reason"}])``, written from the request's head."""
        return choice_chunk(self._head, index, f'"delta":{{"content":{json_str(content)}}}', logprobs,
                            finish_reason, stop_reason)

    async def events(self) -> AsyncIterator[str]:
        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        completion_tokens = 0
        with_logprobs = self.req.logprobs
        stream = self.stream
        chunk = self.delta_chunk
        pending: list[str] = []
        try:
            for index in range(self.params.n):
                yield sse(self._chunk([{"index": index, "delta": {"role": self.role, "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
            async for _, out in self.ctx.outputs([stream]):
                logprobs = (self._logprobs(out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
                            if with_logprobs else None)
                if out.finish_reason is not None:
                    completion_tokens += out.num_output_tokens
                pending.append(chunk(out.index, out.new_text, logprobs, out.finish_reason, out.stop_reason))
                if not stream.num_ready:  # else: one write for the outputs already here
                    yield "".join(pending)
                    pending.clear()
            if pending:
                yield "".join(pending)
                pending.clear()
            if include_usage:
                yield sse(self._chunk([], usage=usage(len(self.prompt), completion_tokens)))
        except (EngineStepError, EngineClosedError) as e:
            yield "".join(pending) + stream_error_event(e)
        yield SSE_DONE
