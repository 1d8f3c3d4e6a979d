"""A request's state as it moves through the engine: tokens, progress in the KV pool, status."""

from __future__ import annotations

import enum

from atom_core.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"    # not in the pool (new, or preempted: its KV is recomputed on return)
    RUNNING = "running"    # holds blocks; computes prompt chunks, then one token per step
    FINISHED = "finished"


class Request:
    """Token ids (prompt then output) and how many of them have KV in the pool."""

    __slots__ = ("request_id", "prompt_token_ids", "token_ids", "params", "seed", "status",
                 "num_computed_tokens", "num_cached_tokens", "finish_reason", "logprobs", "text",
                 "num_preemptions")

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated, appended in place
        self.params = params
        self.seed = seed
        self.status = Status.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the pool
        self.num_cached_tokens = 0    # of those, served by the prefix cache at admission
        self.finish_reason: str | None = None
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.num_preemptions = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

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
        return (f"Request(id={self.request_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
