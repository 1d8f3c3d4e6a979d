"""Per-request sampling settings, validated at construction: a value that passes here never fails a step."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1
SEED_LIMIT = 2**64  # seeds are 64-bit: 0 <= seed < 2**64 (torch.Generator's range)


def _is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a request's tokens and when to stop.

    temperature 0 is greedy; it must be finite and at most float32's largest value. top_k -1 (or 0)
    keeps the whole vocabulary; top_p 1.0 and min_p 0.0 turn those filters off. ``seed`` (0 <= seed
    < 2**64) makes the request's draws reproducible whatever its batch mates. ``logprobs``: when
    set (any int >= 0), each output token carries its log-probability under the model
    (log-softmax of the raw logits). ``stop``: strings that end the output (not included in the
    text); ``stop_token_ids``: tokens that end it (the token is in ``token_ids``; its text is
    not, as in vLLM). Ints may be Python or numpy ints; bools are refused everywhere.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: list[str] | tuple[str, ...] | str | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    seed: int | None = None
    logprobs: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        def as_type(name, value):
            object.__setattr__(self, name, value)

        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or not 0 <= t <= FLOAT32_MAX:
            bad("temperature", f"must be a finite number in [0, {FLOAT32_MAX:.4g}] (0 = greedy)")
        as_type("temperature", float(t))
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            bad("top_k", "must be -1 (off) or an int >= 1")
        as_type("top_k", int(self.top_k))
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be a number in (0, 1]")
        as_type("top_p", float(self.top_p))
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be a number in [0, 1]")
        as_type("min_p", float(self.min_p))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an int >= 1")
        as_type("max_tokens", int(self.max_tokens))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            bad("ignore_eos", "must be a bool")
        if self.seed is not None:
            if not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
                bad("seed", "must be None or an int in [0, 2**64)")
            as_type("seed", int(self.seed))
        if self.logprobs is not None:
            if not _is_int(self.logprobs) or self.logprobs < 0:
                bad("logprobs", "must be None or an int >= 0")
            as_type("logprobs", int(self.logprobs))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is not None and not isinstance(stop, (list, tuple)):
            bad("stop", "must be a string or a list of strings")
        stop = tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            bad("stop", "must be a non-empty string or a list of them")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in ids)):
            bad("stop_token_ids", "must be a list of token ids (ints >= 0)")
        if ids is not None:
            as_type("stop_token_ids", [int(t) for t in ids])
        object.__setattr__(self, "stop_strings", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seed_int64(self) -> int | None:
        """The seed as the int64 with the same 64 bits (what the sampling op takes)."""
        if self.seed is None:
            return None
        return self.seed - SEED_LIMIT if self.seed >= 2**63 else self.seed
