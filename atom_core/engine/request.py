"""A request's state as it moves through the engine: its tokens, its status, its outputs so far.

A ``Request`` is a plain record of one output sequence (a prompt with ``n > 1`` is ``n`` requests
sharing a ``group_id``). The scheduler's running batch holds the running requests' progress
(tokens computed, blocks, a token still being sampled on the device); the request holds what is
known for good: its prompt, the tokens sampled for it so far, its log-probs, its detokenizer and,
once it ends, why. ``prompt_text_of`` says what text a prompt was given as (the outputs' ``prompt``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

from atom_core.engine.detokenizer import Detokenizer, OutputTokens
from atom_core.engine.sampling_params import SamplingParams, _is_int


def prompt_text_of(prompt, prompt_text: str | None = None) -> str | None:
    """A request's ``prompt``: ``prompt_text`` when given (the text of token ids), else the text the prompt
    was given as (a string, or vLLM's ``{"prompt": text}``), else None. TypeError for a ``prompt_text``
    that is not a string."""
    if prompt_text is not None:
        if not isinstance(prompt_text, str):
            raise TypeError(f"prompt_text must be a string, got {type(prompt_text).__name__}")
        return prompt_text
    if isinstance(prompt, Mapping):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


class Status(enum.Enum):
    WAITING = "waiting"    # not in the pool (new, or preempted: its KV is recomputed on return)
    RUNNING = "running"    # holds blocks and a row of the running batch
    FINISHED = "finished"


class Request:
    """Prompt and sampled tokens of one generated sequence.

    Attributes:
        request_id: its own id (unique; the block manager's key).
        group_id, index: the id ``Engine.add_request`` returned and which of the prompt's ``n``
            sequences this is (``group_id == request_id`` and ``index == 0`` for the first).
        prompt_token_ids: the prompt.
        prompt: the prompt's text when it was given as text (for a chat, the rendered conversation), else None.
        token_ids: prompt then every token sampled so far (the engine appends; read it, do not
            modify it).
        params: its ``SamplingParams``; seed: the seed its draws use.
        length_limit: ``min(prompt + max_tokens, max_model_len)``, the token count at which it
            stops for length (set by the scheduler at ``add``).
        status, finish_reason ("stop", "length", "abort", "error" once finished), stop_reason (the
            stop string or stop token id that ended it, else None).
        detokenizer: its ``Detokenizer`` (None without a tokenizer, or with ``detokenize=False``); ``text``: the
            decoded output.
        logprobs: one float per output token when asked for; logprob_ranks: each one's rank among the
            vocabulary (``engine.logprobs.token_ranks``), with them; top_logprobs: one {token id:
            log-prob} of the ``params.logprobs`` most likely tokens per output token (when > 0).
        prompt_logprobs, prompt_logprob_ranks, prompt_top_logprobs: the same per prompt token (None for
            the first).
        num_prompt_logprobs_scheduled: prompt positions whose log-probs a launched step computes.
        processing: what it adds to its logits (``logits_processing.RequestProcessing``) or None.
        grammar: its structured output's ``GrammarState`` (``engine.structured_output``) while it
            is unfinished, else None.
        num_cached_tokens: prompt tokens served by the prefix cache at its first admission.
        num_preemptions: times it was sent back to recompute.
        row: its row in the scheduler's running batch while it runs, else None.
    """

    __slots__ = ("request_id", "group_id", "index", "prompt", "prompt_token_ids", "token_ids", "params", "seed",
                 "length_limit", "status", "finish_reason", "stop_reason", "logprobs", "logprob_ranks",
                 "top_logprobs", "prompt_logprobs", "prompt_logprob_ranks", "prompt_top_logprobs",
                 "num_prompt_logprobs_scheduled", "detokenizer", "processing", "grammar", "num_cached_tokens",
                 "num_preemptions", "row", "_output_view")

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int, *,
                 group_id: int | None = None, index: int = 0, tokenizer=None, prompt: str | None = None):
        self.request_id = request_id
        self.group_id = request_id if group_id is None else group_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.length_limit = len(self.prompt_token_ids) + params.max_tokens
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.logprob_ranks: list[int] | None = [] if params.logprobs is not None else None
        self.top_logprobs: list[dict[int, float]] | None = [] if params.logprobs else None
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_logprob_ranks: list[int | None] | None = None
        self.prompt_top_logprobs: list[dict[int, float] | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no log-prob
            self.prompt_logprob_ranks = [None]
            self.prompt_top_logprobs = [None] if params.prompt_logprobs else None
        self.num_prompt_logprobs_scheduled = 0
        self.detokenizer = None if tokenizer is None else self.make_detokenizer(tokenizer)
        self.processing = None  # its RequestProcessing (logits_processing), set when it is added
        self.grammar = None  # its GrammarState (structured output), set when it is added
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.row: int | None = None
        self._output_view = None

    def make_detokenizer(self, tokenizer) -> Detokenizer | None:
        """Its ``Detokenizer`` over ``tokenizer``; None when its parameters ask for token ids only (``detokenize``)."""
        params = self.params
        if not params.detokenize:
            return None
        return Detokenizer(tokenizer, self.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                           stop_strings=params.stop_strings,
                           include_stop_str_in_output=params.include_stop_str_in_output)

    @property
    def num_tokens(self) -> int:
        """Tokens known so far (prompt + sampled)."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def output_tokens(self) -> OutputTokens:
        """The output tokens as a view of ``token_ids`` (no copy), indexed from the first output token."""
        if self._output_view is None:
            self._output_view = OutputTokens(self.token_ids, len(self.prompt_token_ids))
        return self._output_view

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def visible_chars(self, num_output_tokens: int, finished: bool) -> int:
        """Characters of text shown after ``num_output_tokens`` (see ``Detokenizer.visible_chars``)."""
        return self.detokenizer.visible_chars(self.output_tokens, num_output_tokens, finished)

    @property
    def text(self) -> str:
        """The decoded output so far (the final text once a stop rule ended it); "" without a tokenizer."""
        detokenizer = self.detokenizer
        if detokenizer is None:
            return ""
        done = self.finished or detokenizer.final_tokens is not None
        return detokenizer.text(self.visible_chars(self.num_output_tokens, done))

    def __repr__(self) -> str:
        return f"Request(id={self.request_id}, status={self.status.value}, tokens={self.num_tokens})"


def request_ids_of(request_id: int | Iterable[int]) -> list[int]:
    """``abort``'s argument as ids: an int (Python or numpy, not a bool), or an iterable of them. Anything else
    (a vLLM-style string id) raises TypeError: it can name no request of an engine, whose ids are ints."""
    if _is_int(request_id):
        return [int(request_id)]
    ids = list(request_id) if isinstance(request_id, Iterable) and not isinstance(request_id, (str, bytes)) else None
    if ids is None or not all(_is_int(i) for i in ids):
        raise TypeError(f"request_id must be an int that add_request returned, or an iterable of them; got "
                        f"{request_id!r}")
    return [int(i) for i in ids]
