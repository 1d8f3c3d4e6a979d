"""What the engine hands back: one ``RequestOutput`` per sequence that got a token in a step.

A step's outputs come as ``StepOutputs``, a sequence that builds each ``RequestOutput`` when it is
read: a step of 256 decode rows costs no Python objects for outputs nobody looks at. An output
carries the step's new tokens, and its request with how many tokens the request had generated
at that step: ``token_ids``, ``logprobs`` and the text are taken from the request only when read,
so streaming ``new_token_ids`` never copies the whole output, and the text of a request is
decoded (incrementally, a few tokens per step) only when someone reads it.

``n`` sequences per prompt: each sequence is its own ``RequestOutput``, with the prompt's
``request_id`` (what ``add_request`` returned) and its ``index`` (0..n-1). ``Engine.generate``
returns one ``RequestOutput`` per prompt: that of sequence 0, whose ``outputs`` lists all n
(vLLM's ``RequestOutput.outputs``); a step's outputs have ``outputs == [self]``.

An output is vLLM's ``RequestOutput`` and its ``CompletionOutput`` in one object (``out.outputs[0].text``
reads as in vLLM); how its fields differ from vLLM's: docs/sampling.md, "RequestOutput".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from atom_core.engine.request import Request


class RequestOutput:
    """One sequence's generated part as of one step.

    Attributes:
        request_id: the id ``add_request`` returned (shared by a prompt's ``n`` sequences).
        prompt: the prompt's text when it was given as text (for ``chat``, the rendered conversation), else
            None (given as token ids).
        index: which of the prompt's sequences this is (0 when ``n == 1``).
        finish_reason: None while running, else "stop" (EOS, a stop token or a stop string),
            "length" (max_tokens or max_model_len), or "error" (the step that ran it raised). An aborted
            request gets no further output (its ``Request.finish_reason`` is "abort").
        finished: ``finish_reason is not None``.
        stop_reason: once finished by a stop string or a stop token id, that string or id (vLLM's);
            None for EOS and the other reasons.
        num_output_tokens: tokens generated up to and including this step.
        new_token_ids: the tokens this step added.

    Read when accessed (from the request, as of this step):
        token_ids: everything generated (the prompt excluded).
        text: the decoded output so far ("" without a tokenizer). While running it holds back the
            last ``max(len(stop)) - 1`` characters of a request with stop strings (they may be the
            start of one); once finished it is the final text (stop string and stop token's text
            excluded unless ``include_stop_str_in_output``; never ending inside a character).
        new_text: the characters this step added to ``text``: the ``new_text`` of every step of a
            sequence, concatenated, is its final ``text``.
        logprobs: one log-prob per output token (``SamplingParams.logprobs`` set), else None.
        logprob_ranks: with ``logprobs``, each output token's rank by the same values (vLLM's
            ``Logprob.rank``): how many tokens of the vocabulary have a value at least its own, itself
            included (1 for the most likely; a token tied with others gets the last of their places, as
            vLLM counts ``>=``). A sampled token outside ``top_logprobs`` ranks above their number.
            None without ``logprobs``.
        cumulative_logprob: the sum (``math.fsum``) of ``logprobs``; None when they are (vLLM V1's rule).
        top_logprobs: per output token, {token id: log-prob} of the ``logprobs`` most likely
            tokens, most likely first (None unless ``logprobs > 0``).
        prompt_logprobs: per prompt token, its log-prob given the tokens before it (None for the
            first); prompt_logprob_ranks: each one's rank (as ``logprob_ranks``; None for the first);
            prompt_top_logprobs: the ``prompt_logprobs`` most likely tokens there. None unless asked for
            (``SamplingParams.prompt_logprobs``).
        outputs: the prompt's sequences, in index order (see the module docstring).
        num_cached_tokens: prompt tokens its first admission took from the prefix cache (as vLLM
            reports it: a recompute after a preemption does not change it).
        metrics: None (vLLM V1's offline ``LLM`` gives None too, its stats being off; no request here records
            its arrival or first-token time).
    """

    __slots__ = ("_request", "num_output_tokens", "finish_reason", "new_token_ids", "_group")

    def __init__(self, request: Request, num_output_tokens: int, new_token_ids: list[int],
                 finish_reason: str | None = None):
        self._request = request
        self.num_output_tokens = num_output_tokens
        self.new_token_ids = new_token_ids
        self.finish_reason = finish_reason
        self._group: list[RequestOutput] | None = None

    @property
    def request_id(self) -> int:
        return self._request.group_id

    @property
    def index(self) -> int:
        return self._request.index

    @property
    def prompt(self) -> str | None:
        return self._request.prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._request.prompt_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_reason(self) -> str | int | None:
        return self._request.stop_reason if self.finish_reason == "stop" else None

    @property
    def token_ids(self) -> list[int]:
        start = self._request.num_prompt_tokens
        return self._request.token_ids[start:start + self.num_output_tokens]

    @property
    def text(self) -> str:
        request = self._request
        if request.detokenizer is None:
            return ""
        return request.detokenizer.text(request.visible_chars(self.num_output_tokens, self.finished))

    @property
    def new_text(self) -> str:
        request = self._request
        if request.detokenizer is None:
            return ""
        end = request.visible_chars(self.num_output_tokens, self.finished)
        start = request.visible_chars(self.num_output_tokens - len(self.new_token_ids), False)
        return request.detokenizer.chars(start, end)

    @property
    def logprobs(self) -> list[float] | None:
        logprobs = self._request.logprobs
        return None if logprobs is None else logprobs[:self.num_output_tokens]

    @property
    def cumulative_logprob(self) -> float | None:
        logprobs = self._request.logprobs  # summed when read: a step costs nothing for it
        return None if logprobs is None else math.fsum(logprobs[:self.num_output_tokens])

    @property
    def logprob_ranks(self) -> list[int] | None:
        ranks = self._request.logprob_ranks
        return None if ranks is None else ranks[:self.num_output_tokens]

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        top = self._request.top_logprobs
        return None if top is None else top[:self.num_output_tokens]

    @property
    def prompt_logprobs(self) -> list[float | None] | None:
        values = self._request.prompt_logprobs
        return None if values is None else list(values)

    @property
    def prompt_logprob_ranks(self) -> list[int | None] | None:
        ranks = self._request.prompt_logprob_ranks
        return None if ranks is None else list(ranks)

    @property
    def prompt_top_logprobs(self) -> list[dict[int, float] | None] | None:
        values = self._request.prompt_top_logprobs
        return None if values is None else list(values)

    @property
    def outputs(self) -> list[RequestOutput]:
        return [self] if self._group is None else list(self._group)

    @property
    def num_cached_tokens(self) -> int:
        return self._request.num_cached_tokens

    @property
    def metrics(self) -> None:
        return None

    def __repr__(self) -> str:
        index = f", index={self.index}" if self.index else ""
        return (f"RequestOutput(request_id={self.request_id}{index}, num_output_tokens={self.num_output_tokens}, "
                f"finish_reason={self.finish_reason!r})")


class StepOutputs(Sequence):
    """The outputs of one step, built on access: ``outputs[i]`` is a ``RequestOutput``.

    Args:
        requests: the requests that got a token this step.
        new_token_ids: int [N], the token each one got.
        num_tokens: int [N], each one's token count (prompt + generated) after this step.
        finish_reasons: index into ``requests`` -> reason, for those that finished this step.
    """

    __slots__ = ("_requests", "_new_token_ids", "_num_tokens", "_finish_reasons", "_new_token_list")

    def __init__(self, requests: list[Request], new_token_ids: np.ndarray, num_tokens: np.ndarray,
                 finish_reasons: dict[int, str]):
        if not len(requests) == len(new_token_ids) == len(num_tokens):
            raise ValueError(f"{len(requests)} requests but {len(new_token_ids)} new tokens and "
                             f"{len(num_tokens)} token counts")
        self._requests = requests
        self._new_token_ids = new_token_ids
        self._num_tokens = num_tokens
        self._finish_reasons = finish_reasons
        self._new_token_list: list[int] | None = None  # new_token_ids as Python ints, made on first access

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = range(len(self))[index]  # normalizes negative indices, raises IndexError past the end
        if self._new_token_list is None:
            self._new_token_list = self._new_token_ids.tolist()
        request = self._requests[i]
        return RequestOutput(request, int(self._num_tokens[i]) - request.num_prompt_tokens,
                             [self._new_token_list[i]], self._finish_reasons.get(i))

    def __iter__(self):
        """The outputs in order (what a streaming consumer reads every step: no per-index checks)."""
        new_tokens, reasons = self._new_token_ids.tolist(), self._finish_reasons
        for i, (request, num_tokens) in enumerate(zip(self._requests, self._num_tokens.tolist())):
            yield RequestOutput(request, num_tokens - request.num_prompt_tokens, [new_tokens[i]], reasons.get(i))

    def finished(self) -> list[RequestOutput]:
        """Outputs of the requests that finished this step (built without touching the others)."""
        return [self[i] for i in sorted(self._finish_reasons)]

    def __repr__(self) -> str:
        return f"StepOutputs({len(self)} outputs, {len(self._finish_reasons)} finished)"
