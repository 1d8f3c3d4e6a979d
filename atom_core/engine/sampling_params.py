"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a request's tokens and when to stop.

    temperature 0 is greedy. top_k -1 (or 0) keeps the whole vocabulary; top_p 1.0 and min_p 0.0
    turn those filters off. ``seed`` makes the request's draws reproducible whatever its batch
    mates. ``logprobs``: when set (any int >= 0), each output token carries its log-probability
    under the model (log-softmax of the raw logits).
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

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "must be a number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            bad("top_k", "must be -1 (off) or an int >= 1")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an int >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", "must be None or an int >= 0")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", "must be None or an int >= 0")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            bad("stop", "must be a non-empty string or a list of them")
        if any(not isinstance(t, int) or t < 0 for t in (self.stop_token_ids or ())):
            bad("stop_token_ids", "must be a list of token ids >= 0")
        object.__setattr__(self, "stop_strings", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
