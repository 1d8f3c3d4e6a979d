"""A request's state as it moves through the engine: its tokens, its status, its outputs so far.

A ``Request`` is a plain record. The scheduler's running batch holds the running requests'
progress (tokens computed, blocks, a token still being sampled on the device); the request holds
what is known for good: its prompt, the tokens sampled for it so far, its log-probs and, once it
ends, why.
"""

from __future__ import annotations

import enum

from atom_core.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"    # not in the pool (new, or preempted: its KV is recomputed on return)
    RUNNING = "running"    # holds blocks and a row of the running batch
    FINISHED = "finished"


class Request:
    """Prompt and sampled tokens of one generation.

    Attributes:
        request_id: the id ``Engine.add_request`` returned.
        prompt_token_ids: the prompt.
        token_ids: prompt then every token sampled so far (the engine appends; read it, do not
            modify it).
        params: its ``SamplingParams``; seed: the seed its draws use.
        length_limit: ``min(prompt + max_tokens, max_model_len)``, the token count at which it
            stops for length (set by the scheduler at ``add``).
        status, finish_reason ("stop", "length", "abort" once finished), text (the decoded output
            once finished, with a tokenizer), logprobs (one per output token when asked for).
        num_cached_tokens: prompt tokens served by the prefix cache at its last admission.
        num_preemptions: times it was sent back to recompute.
        row: its row in the scheduler's running batch while it runs, else None.
    """

    __slots__ = ("request_id", "prompt_token_ids", "token_ids", "params", "seed", "length_limit", "status",
                 "finish_reason", "logprobs", "text", "num_cached_tokens", "num_preemptions", "row")

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.length_limit = len(self.prompt_token_ids) + params.max_tokens
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.row: int | None = None

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
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return f"Request(id={self.request_id}, status={self.status.value}, tokens={self.num_tokens})"
