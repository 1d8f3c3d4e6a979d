"""A request's state as it moves through the engine: tokens, progress in the KV pool, status."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from atom_core.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom_core.engine.running_batch import RunningBatch


class Status(enum.Enum):
    WAITING = "waiting"    # not in the pool (new, or preempted: its KV is recomputed on return)
    RUNNING = "running"    # holds blocks; computes prompt chunks, then one token per step
    FINISHED = "finished"


class Request:
    """Token ids (prompt then output) and how many of them have KV in the pool.

    While the request runs it holds a slot of a ``RunningBatch``, which is then the truth for its
    tokens and progress (a decode step updates all slots at once); ``token_ids``, ``num_tokens``
    and ``num_computed_tokens`` read it. Out of the batch they are plain values.
    """

    __slots__ = ("request_id", "prompt_token_ids", "params", "seed", "status", "num_cached_tokens",
                 "finish_reason", "logprobs", "text", "num_preemptions", "slot", "running_batch",
                 "_token_ids", "_num_computed_tokens")

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.status = Status.WAITING
        self.num_cached_tokens = 0    # tokens served by the prefix cache at admission
        self.finish_reason: str | None = None
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.num_preemptions = 0
        self.slot: int | None = None  # row in running_batch while running
        self.running_batch: RunningBatch | None = None
        self._token_ids = list(prompt_token_ids)  # while running: a prefix of the slot's tokens
        self._num_computed_tokens = 0

    # ------------------------------------------------------------------ slot of a running batch

    def attach(self, batch: RunningBatch, slot: int) -> None:
        """Called by ``RunningBatch.add``: from now on the slot holds the tokens and progress."""
        self.running_batch, self.slot = batch, slot

    def detach(self) -> None:
        """Called by ``RunningBatch.remove``: take the tokens and progress back as plain values."""
        self._token_ids = self.token_ids
        self._num_computed_tokens = int(self.running_batch.num_computed_tokens[self.slot])
        self.running_batch = self.slot = None

    # ------------------------------------------------------------------ tokens and progress

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens: the request's own list (read it, do not modify it)."""
        if self.slot is not None:  # tokens sampled since the last read are only in the slot
            self._token_ids.extend(self.running_batch.read_tokens(self.slot, len(self._token_ids)))
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        if self.slot is not None:
            return int(self.running_batch.num_tokens[self.slot])
        return len(self._token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Leading tokens whose KV is in the pool (0 while waiting)."""
        if self.slot is not None:
            return int(self.running_batch.num_computed_tokens[self.slot])
        return self._num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self.slot is not None:
            self.running_batch.num_computed_tokens[self.slot] = value
        else:
            self._num_computed_tokens = value

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
