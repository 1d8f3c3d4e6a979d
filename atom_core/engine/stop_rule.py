"""When a request stops, in one place.

A request stops after a token when:

- the token is an EOS id (unless ``ignore_eos``) or one of its ``stop_token_ids`` -> "stop"
  (``min_tokens`` keeps them from being sampled earlier: they are masked on the device;
  ``stop_reason`` is None for the model's own EOS token and the id for any other, as vLLM reports
  the EOS ids that only generation_config.json names);
- its decoded output contains one of its stop strings -> "stop" (the text ends before it, or
  after it with ``include_stop_str_in_output``; not checked before ``min_tokens`` tokens);
- it has ``max_tokens`` output tokens or ``max_model_len`` tokens in all -> "length"
  (``length_limit``: known in advance, so the scheduler never computes past it);
- its rules together allowed no token (a grammar and ``allowed_token_ids`` / ``bad_words`` / ``min_tokens``
  that exclude each other; the sampler then gives token 0) -> "error", the text without that token: seen as
  an EOS or stop token inside ``min_tokens``, or a token its grammar refused.

The engine checks every new token of every row at once for EOS and the length limit; only rows
that may stop, or that have stop strings, stop token ids or logprobs, are looked at in Python.
Stop strings are searched in the characters each token adds (plus a tail of the longest stop
string's length - 1), decoded incrementally (``engine.detokenizer``): O(1) per step. The text of
a request without stop strings is decoded only when read.
"""

from __future__ import annotations

import numpy as np

from atom_core.engine.detokenizer import INCOMPLETE_CHARACTER  # noqa: F401 (re-exported)
from atom_core.engine.request import Request


NO_TOKEN_ALLOWED = "error"  # the finish reason of a request whose rules together allowed no next token


class StopRule:
    """The stop conditions of one engine: its EOS ids, ``max_model_len`` and tokenizer (or None).

    The EOS ids: those given here (config.json's) and the tokenizer's ``eos_token``, which vLLM stops on. The
    model's own EOS token (its stop_reason is None) is the tokenizer's ``eos_token`` where the tokenizer names
    one, else each of the EOS ids given here; EOS ids added later report their id.
    """

    def __init__(self, eos_token_ids, max_model_len: int, tokenizer=None):
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        named = getattr(tokenizer, "eos_token_id", None)
        # vLLM stops on the tokenizer's eos_token whatever config.json names (a chat fine-tune's <|im_end|>)
        self.eos_token_ids = set(eos_token_ids) | ({named} if named is not None else set())
        self.model_eos_token_ids = frozenset({named} if named is not None else self._eos_token_ids)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids) -> None:
        self._eos_token_ids = frozenset(int(t) for t in token_ids)
        self._eos_array = np.array(sorted(self._eos_token_ids), dtype=np.int64)

    def length_limit(self, request: Request) -> int:
        """Token count (prompt + output) at which ``request`` stops for length."""
        return min(request.num_prompt_tokens + request.params.max_tokens, self.max_model_len)

    def may_stop(self, tokens: np.ndarray, num_tokens: np.ndarray, length_limit: np.ndarray,
                 stops_at_eos: np.ndarray, checks_every_token: np.ndarray) -> np.ndarray:
        """bool [N]: rows that must be looked at after getting ``tokens`` (int [N]), having then
        ``num_tokens`` tokens; the other arrays are the rows' per-request flags and limits."""
        maybe = checks_every_token | (num_tokens >= length_limit)
        eos = self._eos_array
        if len(eos):
            is_eos = tokens == eos[0] if len(eos) == 1 else np.isin(tokens, eos)
            maybe |= is_eos & stops_at_eos
        return maybe

    def no_token_allowed(self, request: Request) -> str:
        """``request``'s last token was drawn from a row where its rules (a grammar, ``allowed_token_ids``,
        ``bad_words``, ``min_tokens``) together allowed no token, which the sampler answers with token 0: it
        finishes with "error", its text without that token."""
        detokenizer = self._detokenizer_of(request)
        if detokenizer is not None:
            detokenizer.finish(request.num_output_tokens - 1)
        return NO_TOKEN_ALLOWED

    def _detokenizer_of(self, request: Request):
        """``request``'s detokenizer, made here for a request made outside the engine (None without a tokenizer,
        or with ``detokenize=False``)."""
        if request.detokenizer is None and self.tokenizer is not None:
            request.detokenizer = request.make_detokenizer(self.tokenizer)
        return request.detokenizer

    def finish_reason(self, request: Request) -> str | None:
        """Why ``request`` stops after its last token, or None; when it stops, its detokenizer is
        told where the final text ends (decoded when read).

        The final text, as vLLM gives it: without a stop string or the stop token's text (the
        token itself stays in ``token_ids``) unless ``include_stop_str_in_output``, and without a
        last character whose UTF-8 bytes the output has not completed.
        """
        params, token = request.params, request.token_ids[-1]
        detokenizer = self._detokenizer_of(request)
        num_output = request.num_output_tokens
        is_eos = not params.ignore_eos and token in self._eos_token_ids
        if is_eos or token in (params.stop_token_ids or ()):
            if num_output <= params.min_tokens:  # min_tokens banned it: every token was banned (NO_TOKEN_ALLOWED)
                return self.no_token_allowed(request)
            request.stop_reason = None if is_eos and token in self.model_eos_token_ids else token
            if detokenizer is not None:
                detokenizer.finish(num_output if params.include_stop_str_in_output else num_output - 1)
            return "stop"
        if params.stop_strings and detokenizer is not None:
            detokenizer.decode_until(request.output_tokens, num_output)
            hit = detokenizer.find_stop() if num_output > params.min_tokens else detokenizer.skip_stop_search()
            if hit is not None:
                request.stop_reason, final_chars = hit
                detokenizer.finish(num_output, final_chars)
                return "stop"
        if request.num_tokens >= request.length_limit:
            return "length"
        return None
