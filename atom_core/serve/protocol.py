"""The OpenAI request bodies the server accepts (pydantic models), and their ``SamplingParams``.

Parsing is strict (``model_validate_json`` in strict mode): a string where a number belongs, a
bool where an int belongs, NaN or infinity, an unknown enum value or a number outside its range
is a 400 naming the field. Fields OpenAI's API defines keep their names and ranges (temperature
[0, 2], penalties [-2, 2], top_logprobs <= 20, ...); vLLM's extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ...) are
accepted too, and vLLM's prompt fields (``truncate_prompt_tokens``, ``add_special_tokens``, chat's
``continue_final_message``, ``chat_template``, ...) and ``prompt_logprobs`` / ``return_tokens_as_token_ids``.
vLLM fields that change the prompt or the output and that are not implemented are refused by name
(``REFUSED_FIELDS``); other unknown fields (OpenAI's ``metadata``, ``store``, ...) are ignored, as OpenAI's
own server does for fields it retired and vLLM does for fields it does not know (``IGNORED_FIELDS`` lists
the vLLM and OpenAI ones, with why ignoring them changes nothing).

Structured output, on both endpoints: OpenAI's ``response_format`` (``{"type": "text"}``,
``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``)
and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` or
``structured_outputs`` (a dict of ``StructuredOutputsParams`` fields); at most one of them.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from atom_core.engine.sampling_params import SamplingParams, StructuredOutputsParams

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias value; larger ones are clamped to it
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
SEED_MODULUS = 2**64  # an int64 seed (OpenAI allows negative ones) maps to the engine's [0, 2**64)

__all__ = ["ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "IGNORED_FIELDS", "REFUSED_FIELDS",
           "RequestError", "TokenizeChatRequest", "TokenizeCompletionRequest", "parse_request"]

# vLLM's request fields that change the prompt or the output and that this server does not implement: a request
# that sets one to anything but a no-op value (null always is one) is refused with a 400 naming it, instead of
# running as if it were not there. name -> (no-op values, why). (Chat's ``echo`` only: completions implement it.)
REFUSED_FIELDS: dict[str, tuple[tuple, str]] = {
    "echo": ((False,), "chat echo (the reply prefixed with the final message) is not implemented"),
    "use_beam_search": ((False,), "beam search is not implemented"),
    "logprob_token_ids": ((), "log-probs of chosen token ids are not implemented (use logprobs / top_logprobs)"),
    "prompt_embeds": ((), "prompt embeddings are not taken: send text or token ids"),
    "return_token_ids": ((False,), "token ids in the choices are not implemented (logprobs with "
                                   "return_tokens_as_token_ids gives the output's)"),
    "return_prompt_text": ((False,), "the rendered prompt text in the response is not implemented"),
    "priority": ((0,), "requests are served first come, first served (no priority scheduling)"),
    "watermarking": ((False,), "watermarking is not implemented"),
    "thinking_token_budget": ((-1,), "a thinking budget is not implemented"),
    "repetition_detection": ((), "repetition detection is not implemented"),
    "cache_salt": ((), "the prefix cache takes no salt: requests with the same prefix share its blocks"),
    "kv_transfer_params": ((), "KV transfer (disaggregated serving) is not implemented"),
    "ec_transfer_params": ((), "encoder-cache transfer is not implemented"),
    "vllm_xargs": (({},), "there are no custom extensions to read them"),
    "logits_processors": (([],), "custom logits processors are not loaded by the server"),
    "guided_whitespace_pattern": ((), "the JSON grammar's whitespace cannot be chosen"),
    "structural_tag": ((), "structural tags are not implemented"),
    "mm_processor_kwargs": (({},), "multimodal input is not supported"),
    "media_io_kwargs": (({},), "multimodal input is not supported"),
    "lora_request": ((), "LoRA adapters are not supported"),
    "stream_options.continuous_usage_stats": ((False,), "usage in every chunk is not implemented "
                                                        "(include_usage gives it in the last one)"),
}

# Fields a vLLM or OpenAI client may send that the server ignores, and why that changes nothing here (the
# docs list these; any other unknown field is ignored too).
IGNORED_FIELDS: dict[str, str] = {
    "user, metadata, store, service_tier, safety_identifier, prompt_cache_key": "OpenAI bookkeeping: no effect on "
                                                                                "the output",
    "spaces_between_special_tokens": "only slow tokenizers insert such spaces (vLLM too); atom's are fast "
                                     "(tokenizer.json)",
    "detokenize": "not a vLLM request field (SamplingParams only): vLLM's server ignores it too",
    "include_reasoning, parallel_tool_calls": "vLLM reads them only with a reasoning / tool-call parser; none here",
    "length_penalty, early_stopping": "beam search only (use_beam_search is refused)",
    "guided_decoding_backend": "the backend only; the constraint is the same (xgrammar compiles it)",
    "request_id, session_id": "name the request for routing and logs; the output is the same",
    "stream_interval": "how many tokens a streamed chunk batches; the text is the same",
    "return_token_offsets, return_mm_kwargs, routed_experts_prompt_start": "vLLM reads them on other endpoints "
                                                                           "or with flags this server has not",
}


class RequestError(ValueError):
    """A request the server refuses with 400: ``message`` and the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def _check_stop(value):
    if value is None or isinstance(value, str):
        value = None if value is None else [value]
    elif not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("must be a string or a list of strings")
    if value is not None:
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in value):
            raise ValueError(f"each stop string holds 1 to {MAX_STOP_STRING_CHARS} characters")
    return value


def sampling_param_of(message: str) -> str | None:
    """The field a "SamplingParams.<field>=...: why" (or "SamplingParams.<field>: why") message names."""
    if not message.startswith("SamplingParams."):
        return None
    return re.split(r"[=:\s]", message.removeprefix("SamplingParams."), maxsplit=1)[0] or None


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Body(_Strict):
    """A request body (or a part of one that REFUSED_FIELDS names into): unknown fields are kept in
    ``model_extra`` for ``refuse_unimplemented`` to read."""

    model_config = ConfigDict(extra="allow")


def refuse_unimplemented(req: _Body) -> None:
    """RequestError naming the first REFUSED_FIELDS field ``req`` sets to something else than a no-op value."""
    for name, (no_ops, why) in REFUSED_FIELDS.items():
        *parents, field = name.split(".")
        part = req
        for parent in parents:
            part = getattr(part, parent, None)
        extra = getattr(part, "model_extra", None) or {}
        if field not in extra:
            continue
        value = extra[field]
        if value is None or any(type(value) is type(v) and value == v for v in no_ops):
            continue
        raise RequestError(f"{name}: not supported by this server: {why}", param=name.split(".")[0],
                           code="unsupported")


def _null_is_default(cls, value, info):
    """A field OpenAI declares nullable: null means its default (clients write unset fields as null)."""
    return cls.model_fields[info.field_name].default if value is None else value


class StreamOptions(_Body):
    include_usage: bool = False

    _include_usage_null = field_validator("include_usage", mode="before")(classmethod(_null_is_default))


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's. ``strict`` is accepted either way: the output always
    follows the schema (xgrammar's strict mode: no properties the schema does not name)."""

    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class _SamplingFields(_Body):
    """Sampling fields the two endpoints share (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Any = None
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=100.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    # vLLM's prompt and log-prob fields: keep the last (or first) k prompt tokens (-1: as many as the context
    # leaves beside max_tokens); the prompt's log-probs (-1: the whole vocabulary); log-prob tokens as "token_id:N"
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1, lt=2**63)
    truncation_side: Optional[Literal["left", "right"]] = None
    prompt_logprobs: Optional[int] = Field(None, ge=-1)
    return_tokens_as_token_ids: Optional[bool] = None
    # structured output: OpenAI's response_format, or vLLM's extras
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None

    _openai_nullable = field_validator("n", "stream", mode="before")(classmethod(_null_is_default))

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):  # as OpenAI and vLLM refuse it
            raise ValueError("only allowed with stream: true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value, info: ValidationInfo):
        if value is not None and value != 0 and info.data.get("stream"):  # vLLM's rule (a stream has no place for them)
            raise ValueError("not available with stream: true")
        return value

    @field_validator("guided_json", mode="plain")
    @classmethod
    def _guided_json(cls, value):
        if value is not None and not isinstance(value, (dict, str)):
            raise ValueError("must be a JSON schema (an object) or its JSON text")
        return value

    def structured_output(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's ``StructuredOutputsParams`` and the field that asked (None, None without);
        RequestError naming the field."""
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_object":
                asked.append(("response_format", {"json_object": True}))
            elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise RequestError("response_format: type 'json_schema' needs json_schema.schema", "response_format")
            else:
                asked.append(("response_format", {"json": fmt.json_schema.schema_}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs))
        if not asked:
            return None, None
        if len(asked) > 1:
            names = [name for name, _ in asked]
            raise RequestError(f"structured output: at most one of response_format (json), guided_json, guided_regex, "
                               f"guided_choice, guided_grammar and structured_outputs, got {names}", names[1])
        param, fields = asked[0]
        try:
            return StructuredOutputsParams(**fields), param
        except TypeError as e:
            raise RequestError(f"{param}: not StructuredOutputsParams fields ({e})", param) from None
        except ValueError as e:
            message = str(e).removeprefix("SamplingParams.structured_outputs")
            raise RequestError(f"{param}{'' if message.startswith(':') else ' '}{message}", param) from None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value):
        return _check_stop(value)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for key in value:
            if not key.isdigit():
                raise ValueError(f"keys are token ids (decimal strings), got {key!r}")
        return {int(k): max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, v)) for k, v in value.items()}

    def sampling_params(self, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        default: SamplingParams | None = None) -> SamplingParams:
        """The engine's parameters for this request; unset fields take ``default`` (the model's
        generation_config) where it has them. Raises RequestError naming the field."""
        default = default or SamplingParams()
        structured, _ = self.structured_output()

        def pick(value, fallback):
            return fallback if value is None else value

        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, temperature=pick(self.temperature, default.temperature),
                top_p=pick(self.top_p, default.top_p), top_k=pick(self.top_k, default.top_k),
                min_p=pick(self.min_p, default.min_p),
                seed=None if self.seed is None else self.seed % SEED_MODULUS,
                presence_penalty=pick(self.presence_penalty, 0.0), frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=pick(self.repetition_penalty, default.repetition_penalty),
                logit_bias=self.logit_bias or None, stop=self.stop, stop_token_ids=self.stop_token_ids,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                structured_outputs=structured)
        except ValueError as e:
            raise RequestError(str(e), param=sampling_param_of(str(e))) from None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: Any
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: with echo only (the prompt scored, nothing generated)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    suffix: Optional[str] = None
    add_special_tokens: bool = True  # vLLM's: what the tokenizer adds to a text prompt (a BOS)

    _echo_null = field_validator("echo", mode="before")(classmethod(_null_is_default))

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value):
        """-> a non-empty list of prompts, each a string or a non-empty list of token ids."""
        why = "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError(why + " (non-empty)")
        if all(_is_token_id(t) for t in value):
            return [value]
        if all(isinstance(p, str) for p in value):
            return value
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
            return value
        raise ValueError(why + " (token ids are ints >= 0, lists non-empty)")


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # tool_calls, reasoning_content ...: passed to the template

    role: str = Field(min_length=1)
    content: Optional[Any] = None
    name: Optional[str] = None

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value):
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            parts = []
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("content parts must be {'type': 'text', 'text': str} (only text is supported)")
                parts.append(part["text"])
            return "\n".join(parts)  # as vLLM joins text parts
        raise ValueError("content must be a string or a list of text parts")


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Any] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    # vLLM's extras: the template's inputs, the template itself (with --trust-request-chat-template), and
    # whether the tokenizer's special tokens are added to the rendered text (the template writes its own)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: Optional[list[dict[str, Any]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = False

    _logprobs_null = field_validator("logprobs", mode="before")(classmethod(_null_is_default))

    def conversation(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class TokenizeCompletionRequest(_Body):
    """``POST /tokenize`` of a text (vLLM's): its token ids as /v1/completions would run them."""

    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """``POST /tokenize`` of a conversation (vLLM's): its token ids as /v1/chat/completions would run them."""

    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's): the text of token ids."""

    model: Optional[str] = None
    tokens: list[int]


def parse_request(model: type[_Strict], body: bytes) -> Any:
    """``model`` parsed from a JSON body; RequestError (with ``param``) for malformed JSON or a bad field."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        if error["type"] == "json_invalid":
            raise RequestError(f"the body is not valid JSON: {error['msg']}", code="invalid_json") from None
        if not error["loc"]:
            raise RequestError(f"the body must be a JSON object: {error['msg']}") from None
        loc = [str(part) for part in error["loc"]]
        message = error["msg"].removeprefix("Value error, ")
        raise RequestError(f"{'.'.join(loc)}: {message}", param=loc[0]) from None
    refuse_unimplemented(request)
    return request
