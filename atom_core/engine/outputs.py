"""What the engine hands back: one ``RequestOutput`` per request that got a token in a step.

A step's outputs come as ``StepOutputs``, a sequence that builds each ``RequestOutput`` when it is
read: a step of 256 decode rows costs no Python objects for outputs nobody looks at. An output
carries the step's new tokens, and its request with how many tokens the request had generated
at that step: ``token_ids`` and ``logprobs`` are sliced from the request only when read, so
streaming ``new_token_ids`` never copies the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from atom_core.engine.request import Request


class RequestOutput:
    """A request's generated part as of one step.

    Attributes:
        request_id: the id ``add_request`` returned.
        finish_reason: None while running, else "stop" (EOS, a stop token or a stop string),
            "length" (max_tokens or max_model_len), "abort", or "error" (the step that ran it raised).
        finished: ``finish_reason is not None``.
        text: the decoded output once finished ("" before, or without a tokenizer).
        num_output_tokens: tokens generated up to and including this step.
        new_token_ids: the tokens this step added.

    ``token_ids`` (everything generated, the prompt excluded) and ``logprobs`` are new lists taken
    from the request when read.
    """

    __slots__ = ("_request", "num_output_tokens", "finish_reason", "text", "new_token_ids")

    def __init__(self, request: Request, num_output_tokens: int, new_token_ids: list[int],
                 finish_reason: str | None = None):
        self._request = request
        self.num_output_tokens = num_output_tokens
        self.new_token_ids = new_token_ids
        self.finish_reason = finish_reason
        self.text = request.text if finish_reason is not None else ""

    @property
    def request_id(self) -> int:
        return self._request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._request.prompt_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        start = self._request.num_prompt_tokens
        return self._request.token_ids[start:start + self.num_output_tokens]

    @property
    def logprobs(self) -> list[float] | None:
        logprobs = self._request.logprobs
        return None if logprobs is None else logprobs[:self.num_output_tokens]

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, num_output_tokens={self.num_output_tokens}, "
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

    def finished(self) -> list[RequestOutput]:
        """Outputs of the requests that finished this step (built without touching the others)."""
        return [self[i] for i in sorted(self._finish_reasons)]

    def __repr__(self) -> str:
        return f"StepOutputs({len(self)} outputs, {len(self._finish_reasons)} finished)"
