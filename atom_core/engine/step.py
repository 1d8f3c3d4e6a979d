"""What the scheduler hands the runner for one step (``ScheduledStep``), and what recording the
step's sampled tokens did (``StepRecord``).

Legend: B = rows of the step, T = its tokens, N = rows that get a sampled token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from atom_core.engine.logits_processing import LogitsProcessing
from atom_core.engine.request import Request


@dataclass(slots=True)
class SamplingInputs:
    """Per-row parameters of ``ops.sample`` (numpy, [B]); top_k / top_p / min_p are None when off
    in every row (the op then skips that filter). ``processing``: the penalties, biases and bans
    applied to the logits first, None when no row uses any."""

    temperature: np.ndarray  # float32
    top_k: np.ndarray | None  # int32
    top_p: np.ndarray | None  # float32
    min_p: np.ndarray | None  # float32
    seeds: np.ndarray  # int64
    offsets: np.ndarray  # int64, the row's output tokens so far (its draw index)
    processing: LogitsProcessing | None = None


@dataclass(slots=True)
class PromptLogprobsInputs:
    """The prompt positions whose log-probs a step computes (M positions in all).

    requests: the requests they belong to, in step order; token_indices: int64 [M], the positions
    in the step's tokens (their hidden states give the logits); target_ids: int64 [M], the prompt
    token each position predicts; counts: positions per request; num_top: the most top
    alternatives any of them wants (0 = none).
    """

    requests: list[Request]
    token_indices: np.ndarray
    target_ids: np.ndarray
    counts: list[int]
    num_top: int


@dataclass(slots=True)
class ScheduledStep:
    """One step: ``requests[i]`` computes ``query_lens[i]`` tokens after its ``cached_lens[i]``.

    Attributes:
        step_id: the step's number (``pending_step`` of the rows it leaves pending).
        requests: the rows' requests.
        rows: their running-batch rows: a slice ``0:B`` when they are rows 0..B-1 in order, else int64 [B].
        query_lens: int64 [B], tokens each row computes (>= 1).
        cached_lens: int64 [B], tokens of each row already in the pool.
        num_tokens: int, ``sum(query_lens)``.
        block_tables: int32 [B, P], the rows' pool blocks (P = the longest row's pages).
        input_ids: int64 [T], the tokens computed; a pending token is 0 here and is filled on the
            device from the previous step's sampled tokens: ``input_ids[pending_positions[j]] =
            previous_sampled[pending_sources[j]]`` (both int64 [N], or None when no token is pending).
        sampling: the rows' sampling parameters.
        want_logprobs: whether any row asked for log-probs.
        num_top_logprobs: the most top alternatives any row wants per token (0 = none).
        prompt_logprobs: the prompt positions whose log-probs this step computes, or None.
        produces: int64 [N], indices (into the rows) of the rows whose last token this step
            computes, so they get a sampled token; the others are mid-prompt.
        preempted: requests sent back to waiting by this step.
        row_version: the batch's removal count when the step was made (rows are valid while unchanged).
        new_token_index: int64 [N], the index the produced rows' new token takes in their tokens.
        stop_flags: (length_limit, stops_at_eos, checks_every_token) of the produced rows.
        token_lists: the rows' ``token_ids`` lists (in row order), for ``record``'s append.
    """

    step_id: int
    requests: list[Request]
    rows: slice | np.ndarray
    query_lens: np.ndarray
    cached_lens: np.ndarray
    num_tokens: int
    block_tables: np.ndarray
    input_ids: np.ndarray
    pending_positions: np.ndarray | None
    pending_sources: np.ndarray | None
    sampling: SamplingInputs
    want_logprobs: bool
    num_top_logprobs: int = 0
    prompt_logprobs: PromptLogprobsInputs | None = None
    preempted: list[Request] = field(default_factory=list)
    row_version: int = 0
    produces: np.ndarray | None = None
    new_token_index: np.ndarray | None = None
    stop_flags: tuple | None = None
    token_lists: list | None = None

    @property
    def is_decode(self) -> bool:
        """Every row computes one token."""
        return self.num_tokens == len(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def __bool__(self) -> bool:
        return bool(self.requests)


@dataclass(slots=True)
class StepRecord:
    """What a step's sampled tokens did: the requests that got a token (in step order), the token,
    their token count after it, and index -> finish reason for those that stopped."""

    requests: list[Request]
    tokens: np.ndarray
    num_tokens: np.ndarray
    finish_reasons: dict[int, str]
