"""The running requests' progress in numpy arrays, one row per request, kept across steps.

Owned by the scheduler: nothing else writes it. A request takes the next row when it is
admitted; rows stay dense: when a request leaves, the request in the last row moves into the
hole. So the running requests are always rows ``0 .. num_rows-1`` and a step over all of them
reads every per-row array through a view (``num_tokens[:n]``) and updates it in place — no
Python loop over requests, no gather.

A row's last token may still be on the device: the step that samples it has been launched but
its result not yet read (the engine schedules one step ahead). Such a token is counted in
``num_tokens`` and its place in that step's sampled tokens is ``pending_index``; the request's
own ``token_ids`` gets it when the step's result is read.

Legend: S = rows (max_num_seqs), L = max_model_len, P = ceil(L / block_size) pages.
"""

from __future__ import annotations

import numpy as np

from atom_core.engine.request import Request

INT32_MAX = 2**31 - 1


class RunningBatch:
    """Per-row arrays of the running requests (rows ``0 .. num_rows-1`` are in use).

    Attributes:
        requests: the request in each used row, ``requests[row]``.
        token_lists: ``requests[row].token_ids`` for each used row (the list objects themselves).
        num_tokens: int64 [S], tokens known or being sampled (prompt + output).
        num_computed_tokens: int64 [S], leading tokens whose KV is in the pool (or being written
            by a launched step).
        num_prompt_tokens: int64 [S].
        last_token: int64 [S], the row's last known token (what a decode row computes next,
            unless it is pending).
        pending_index: int64 [S], for a row whose last token is still being sampled: its index in
            the sampled tokens of step ``pending_step``; else -1.
        pending_step: int64 [S], the step number ``pending_index`` refers to.
        block_table: int32 [S, P], the pool blocks of the request's pages, -1 after ``num_pages``
            (and in free rows).
        num_pages: int64 [S], blocks the request holds.
        num_published_blocks: int64 [S], leading blocks the prefix cache knows.
        admission_order: int64 [S], increases with each admission (a re-admitted request is newest).
        temperature: float32 [S]; top_k: int32 [S]; top_p: float32 [S]; min_p: float32 [S];
        seed: int64 [S]: sampling parameters, in the dtypes ``ops.sample`` takes.
        length_limit: int64 [S], the token count at which the request stops for length.
        checks_every_token: bool [S], stop strings, stop token ids or logprobs: each new token
            is looked at in Python (the others only when they may stop).
        stops_at_eos: bool [S], ``not ignore_eos``.
        wants_logprobs: bool [S]; num_top_logprobs: int32 [S], the top alternatives wanted per token.
        presence_penalty, frequency_penalty, repetition_penalty: float32 [S].
        token_state_slot: int64 [S], the row's slot in the runner's token state (penalties and
            allow-lists, see ``logits_processing``), -1 = none. Slots belong to requests while they
            run: a slot is taken at ``add`` (and queued in ``new_slots`` for the next step to set
            on the device) and given back at ``remove``.
        uses_token_bias: bool [S], logit_bias, bad_words or min_tokens (sparse entries per step).
        num_using_top_k, num_using_top_p, num_using_min_p, num_stopping_at_eos,
        num_wanting_logprobs, num_wanting_top_logprobs, num_wanting_prompt_logprobs,
        num_using_penalties, num_using_token_bias: used rows with that filter on / that stop on
            EOS / that want logprobs / ... (0 lets a step skip that work for every row).
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, max_pages: int):
        if max_num_seqs < 1 or max_model_len < 1 or max_pages < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}, max_model_len={max_model_len} and "
                             f"max_pages={max_pages} must all be >= 1")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        rows = max_num_seqs
        self.requests: list[Request] = []
        self.token_lists: list[list[int]] = []  # requests[row].token_ids, row by row
        self.block_table = np.full((rows, max_pages), -1, dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed_tokens = np.zeros(rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)
        self.last_token = np.zeros(rows, dtype=np.int64)
        self.pending_index = np.full(rows, -1, dtype=np.int64)
        self.pending_step = np.full(rows, -1, dtype=np.int64)
        self.num_pages = np.zeros(rows, dtype=np.int64)
        self.num_published_blocks = np.zeros(rows, dtype=np.int64)
        self.admission_order = np.zeros(rows, dtype=np.int64)
        self.temperature = np.ones(rows, dtype=np.float32)
        self.top_k = np.zeros(rows, dtype=np.int32)
        self.top_p = np.ones(rows, dtype=np.float32)
        self.min_p = np.zeros(rows, dtype=np.float32)
        self.seed = np.zeros(rows, dtype=np.int64)
        self.length_limit = np.zeros(rows, dtype=np.int64)
        self.checks_every_token = np.zeros(rows, dtype=bool)
        self.stops_at_eos = np.zeros(rows, dtype=bool)
        self.wants_logprobs = np.zeros(rows, dtype=bool)
        self.num_top_logprobs = np.zeros(rows, dtype=np.int32)
        self.presence_penalty = np.zeros(rows, dtype=np.float32)
        self.frequency_penalty = np.zeros(rows, dtype=np.float32)
        self.repetition_penalty = np.ones(rows, dtype=np.float32)
        self.token_state_slot = np.full(rows, -1, dtype=np.int64)
        self.uses_token_bias = np.zeros(rows, dtype=bool)
        # The arrays a row's state lives in (besides its block_table row).
        self._row_arrays = (self.num_tokens, self.num_computed_tokens, self.num_prompt_tokens, self.last_token,
                            self.pending_index, self.pending_step, self.num_pages, self.num_published_blocks,
                            self.admission_order, self.temperature, self.top_k, self.top_p, self.min_p, self.seed,
                            self.length_limit, self.checks_every_token, self.stops_at_eos, self.wants_logprobs,
                            self.num_top_logprobs, self.presence_penalty, self.frequency_penalty,
                            self.repetition_penalty, self.token_state_slot, self.uses_token_bias)
        self.num_using_top_k = self.num_using_top_p = self.num_using_min_p = 0
        self.num_stopping_at_eos = self.num_wanting_logprobs = self.num_wanting_top_logprobs = 0
        self.num_wanting_prompt_logprobs = self.num_using_penalties = self.num_using_token_bias = 0
        self._free_slots = list(range(rows - 1, -1, -1))  # token-state slots not held by a running request
        self.new_slots: list[tuple[Request, int]] = []  # slots taken since the last step, to set on the device
        self.num_removals = 0  # rows move only on removal: a step's rows are still valid while this is unchanged
        self._num_admitted = 0

    @property
    def num_rows(self) -> int:
        """Rows in use: the running requests are rows ``0 .. num_rows-1``."""
        return len(self.requests)

    def add(self, request: Request, block_ids: list[int], num_computed_tokens: int, num_published_blocks: int) -> int:
        """Put ``request`` (all its tokens known) in the next row with its blocks and parameters;
        returns the row."""
        if request.row is not None:
            raise ValueError(f"request {request.request_id} already holds row {request.row}")
        if len(self.requests) == self.max_num_seqs:
            raise ValueError(f"no free row: the batch already holds max_num_seqs={self.max_num_seqs} requests")
        n, num_pages = request.num_tokens, len(block_ids)
        if n > self.max_model_len:
            raise ValueError(f"request {request.request_id} has {n} tokens, more than max_model_len="
                             f"{self.max_model_len}")
        if num_pages > self.block_table.shape[1]:
            raise ValueError(f"request {request.request_id} holds {num_pages} blocks, more than the "
                             f"{self.block_table.shape[1]} pages of a row")
        if not 0 <= num_computed_tokens < n:
            raise ValueError(f"request {request.request_id}: {num_computed_tokens} of {n} tokens computed; "
                             f"a running request has at least one token to compute")
        row = len(self.requests)
        self.requests.append(request)
        self.token_lists.append(request.token_ids)
        self.block_table[row, :num_pages] = block_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_prompt_tokens[row] = request.num_prompt_tokens
        self.last_token[row] = request.token_ids[-1]
        self.pending_index[row] = -1
        self.num_pages[row] = num_pages
        self.num_published_blocks[row] = num_published_blocks
        self.admission_order[row] = self._num_admitted
        self._num_admitted += 1
        params = request.params
        self.temperature[row] = params.temperature
        self.top_k[row] = min(params.top_k, INT32_MAX)  # any top_k >= the vocabulary keeps all of it
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seed[row] = request.seed
        self.length_limit[row] = request.length_limit
        self.checks_every_token[row] = bool(params.stop_strings or params.stop_token_ids
                                            or request.logprobs is not None)
        self.stops_at_eos[row] = not params.ignore_eos
        self.wants_logprobs[row] = request.logprobs is not None
        self.num_top_logprobs[row] = params.logprobs or 0
        self.token_state_slot[row] = -1
        self.uses_token_bias[row] = False
        if params.uses_penalties or params.uses_token_bias:
            self._add_processing(request, row)
        self._count_params(request, +1)
        request.row = row
        return row

    def _add_processing(self, request: Request, row: int) -> None:
        params = request.params
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.uses_token_bias[row] = params.uses_token_bias
        if params.uses_penalties:
            slot = self._free_slots.pop()
            self.token_state_slot[row] = slot
            self.new_slots.append((request, slot))

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Add pool blocks at the end of the row's table."""
        start = int(self.num_pages[row])
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_pages[row] = start + len(block_ids)

    def append_block_each(self, rows: np.ndarray, block_ids: list[int]) -> None:
        """Add one pool block at the end of each row's table (``rows`` int [N], distinct)."""
        self.block_table[rows, self.num_pages[rows]] = block_ids
        self.num_pages[rows] += 1

    def remove(self, request: Request) -> None:
        """Free the request's row; the request in the last row moves into it, so the used rows stay
        ``0 .. num_rows-1``."""
        row = request.row
        if row is None or row >= len(self.requests) or self.requests[row] is not request:
            raise ValueError(f"request {request.request_id} holds no row of this batch")
        request.row = None
        self._count_params(request, -1)
        slot = int(self.token_state_slot[row])
        if slot >= 0:
            self._free_slots.append(slot)
            self.new_slots = [(r, s) for r, s in self.new_slots if s != slot]
        last = len(self.requests) - 1
        moved = self.requests.pop()
        moved_tokens = self.token_lists.pop()
        if row != last:
            self.requests[row] = moved
            self.token_lists[row] = moved_tokens
            moved.row = row
            for array in self._row_arrays:
                array[row] = array[last]
            self.block_table[row] = self.block_table[last]
        self.block_table[last] = -1
        self.token_state_slot[last] = -1
        self.num_removals += 1

    def _count_params(self, request: Request, sign: int) -> None:
        params = request.params
        self.num_wanting_logprobs += sign * (request.logprobs is not None)
        self.num_using_top_k += sign * (params.top_k > 0)
        self.num_using_top_p += sign * (params.top_p < 1)
        self.num_using_min_p += sign * (params.min_p > 0)
        self.num_stopping_at_eos += sign * (not params.ignore_eos)
        self.num_wanting_top_logprobs += sign * bool(params.logprobs)
        self.num_wanting_prompt_logprobs += sign * (params.prompt_logprobs is not None)
        self.num_using_penalties += sign * params.uses_penalties
        self.num_using_token_bias += sign * params.uses_token_bias
