"""When a request stops, in one place.

A request stops after a token when:

- the token is an EOS id (unless ``ignore_eos``) or one of its ``stop_token_ids`` -> "stop";
- its decoded output contains one of its stop strings -> "stop" (the text ends before it);
- it has ``max_tokens`` output tokens or ``max_model_len`` tokens in all -> "length"
  (``length_limit``: known in advance, so the scheduler never computes past it).

The engine checks every new token of every row at once for EOS and the length limit; only rows
that may stop, or that have stop strings, stop token ids or logprobs, are looked at in Python.
"""

from __future__ import annotations

import numpy as np

from atom_core.engine.request import Request

INCOMPLETE_CHARACTER = "\ufffd"  # what decoding gives for the bytes of a character not yet complete


class StopRule:
    """The stop conditions of one engine: its EOS ids, ``max_model_len`` and tokenizer (or None)."""

    def __init__(self, eos_token_ids, max_model_len: int, tokenizer=None):
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

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

    def finish_reason(self, request: Request) -> str | None:
        """Why ``request`` stops after its last token (setting its final ``text``), or None.

        The final text, as vLLM gives it: without a stop string or the stop token's text (the
        token itself stays in ``token_ids``), and without a last character whose UTF-8 bytes the
        output has not completed (a byte-level tokenizer decodes those as U+FFFD).
        """
        params, token = request.params, request.token_ids[-1]
        if params.stop_strings and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
            hits = [i for i in (text.find(s) for s in params.stop_strings) if i >= 0]
            if hits:
                request.text = text[: min(hits)]  # the stop string is not part of the text
                return "stop"
        output = request.output_token_ids
        if (not params.ignore_eos and token in self._eos_token_ids) or token in (params.stop_token_ids or ()):
            reason, output = "stop", output[:-1]  # the stop token's text is not part of the text
        elif request.num_tokens >= request.length_limit:
            reason = "length"
        else:
            return None
        if self.tokenizer is not None:
            request.text = self.tokenizer.decode(output).rstrip(INCOMPLETE_CHARACTER)
        return reason
