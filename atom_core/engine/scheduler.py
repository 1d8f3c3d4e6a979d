"""Continuous batching: which requests run this step, and how many tokens each computes.

Each step is a list of rows (request, query length). Running requests come first, in admission
order (in slot order when all of them decode): a decode row computes one token, a request still
in its prompt computes its next chunk.
Waiting requests are then admitted while the token budget, the sequence cap and the pool allow;
a prompt longer than the remaining budget is chunked. When the pool cannot grow a running
request, the newest running request is preempted: its blocks are freed and it waits to be
recomputed from its tokens so far (prompt + output), which leaves its output unchanged.

The running requests' tokens, progress and block tables live in a ``RunningBatch`` (numpy, one
dense slot per request). When every running request is decoding — the common step — the
scheduler handles them with array operations and touches in Python only the few rows whose next
token starts a new block. ``update`` records what the step computed, also vectorized.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from atom_core.cache import BlockManager
from atom_core.engine.request import Request, Status
from atom_core.engine.running_batch import RunningBatch


@dataclass
class ScheduledStep:
    """Rows of one step: ``requests[i]`` (in slot ``slots[i]`` of the running batch) computes
    ``query_lens[i]`` tokens starting at its ``num_computed_tokens``.

    Attributes:
        requests: the rows' requests.
        slots: int64 [B], their running-batch slots.
        query_lens: int64 [B], tokens each row computes this step (>= 1).
        preempted: requests sent back to waiting by this step.
        dense: the rows are slots ``0 .. B-1`` in order (``slots == arange(B)``), so per-slot
            arrays are read through views: ``array[step.rows]``.
    """

    requests: list[Request] = field(default_factory=list)
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    query_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    preempted: list[Request] = field(default_factory=list)
    dense: bool = False

    @property
    def rows(self) -> slice | np.ndarray:
        """Index of the rows into a per-slot array: a slice (a view) when dense, else ``slots``."""
        return slice(0, len(self.requests)) if self.dense else self.slots

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    def __len__(self) -> int:
        return len(self.requests)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.batch = RunningBatch(max_num_seqs, max_model_len, block_manager.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (the batch keeps them in slot order)

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        preempted: list[Request] = []
        dense = self._all_running_decode(budget)
        if dense:  # rows in slot order: every running request, one token each
            self._grow_decode_rows(preempted)
            requests = list(self.batch.requests)
            query_lens = np.ones(len(requests), dtype=np.int64)
        else:  # rows in admission order, under the budget
            requests, running_lens = self._schedule_running_rows(budget, preempted)
            query_lens = np.array(running_lens, dtype=np.int64)
        budget -= len(requests) if dense else sum(running_lens)

        # Admit waiting requests, unless this step had to preempt (the pool is already too tight).
        # They take the next slots, so a dense step stays dense.
        admitted_lens = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting[0]
            q = self._admit(request, budget)
            if q is None:
                break
            requests.append(request)
            admitted_lens.append(q)
            budget -= q
        if admitted_lens:
            query_lens = np.concatenate([query_lens, np.array(admitted_lens, dtype=np.int64)])
        if dense:
            slots = np.arange(len(requests), dtype=np.int64)
        else:  # read after every preemption: a preemption moves the last slot's request
            slots = np.fromiter((r.slot for r in requests), dtype=np.int64, count=len(requests))
        return ScheduledStep(requests, slots, query_lens, preempted, dense)

    def _all_running_decode(self, budget: int) -> bool:
        """Every running request computes exactly one token (its last sampled one) and all fit the budget."""
        n, batch = len(self.running), self.batch
        if n == 0 or n > budget:
            return False
        # A running request always has a token left to compute (num_tokens - num_computed >= 1).
        return int((batch.num_tokens[:n] - batch.num_computed_tokens[:n]).max()) == 1

    def _grow_decode_rows(self, preempted: list[Request]) -> None:
        """Give a block to each decoding row whose token starts a new one, oldest first; when the
        pool runs dry, the rest go one by one, preempting from the newest (as in the general case)."""
        batch, bm, n = self.batch, self.block_manager, len(self.running)
        # A decode row writes token num_tokens - 1: it needs num_tokens slots, one block more than
        # it holds when num_tokens = num_pages * block_size + 1.
        short = (batch.num_tokens[:n] > batch.num_pages[:n] * bm.block_size).nonzero()[0]
        if short.size == 0:
            return
        if short.size > bm.num_free_blocks:  # some must preempt: serve the oldest first
            short = short[np.argsort(batch.admission_order[short])]
        requests = [batch.requests[i] for i in short.tolist()]
        new_block_ids = bm.append_block_each([r.request_id for r in requests])
        batch.append_block_each(short[:len(new_block_ids)], new_block_ids)
        for request in requests[len(new_block_ids):]:
            if request.slot is None:
                continue  # preempted for an older row
            if not self._grow_or_preempt(request, int(batch.num_tokens[request.slot]), preempted):
                break

    def _schedule_running_rows(self, budget: int, preempted: list[Request]) -> tuple[list[Request], list[int]]:
        """Rows and query lengths of the running requests, in admission order, under ``budget``
        (the general case: prompts in progress, or more rows than the budget)."""
        requests, query_lens = [], []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_computed = request.num_computed_tokens
            q = min(request.num_tokens - num_computed, budget)
            if not self._grow_or_preempt(request, num_computed + q, preempted):
                break  # request itself was preempted: nothing after it is left
            requests.append(request)
            query_lens.append(q)
            budget -= q
            i += 1
        return requests, query_lens

    def _grow_or_preempt(self, request: Request, num_tokens_total: int, preempted: list[Request]) -> bool:
        """Grow ``request``'s table to ``num_tokens_total`` tokens, preempting the newest running
        requests until it fits; False when ``request`` itself had to go."""
        bm = self.block_manager
        while not bm.append_slots(request.request_id, num_tokens_total):
            victim = self.running[-1]  # newest; never one already scheduled (those are older)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        num_pages = int(self.batch.num_pages[request.slot])
        if num_tokens_total > num_pages * bm.block_size:
            self.batch.append_blocks(request.slot, bm.block_table(request.request_id, start=num_pages))
        return True

    def _admit(self, request: Request, budget: int) -> int | None:
        """Move the head of the queue into the batch; its query length, or None if it does not fit."""
        bm = self.block_manager
        cached = bm.allocate(request.request_id, request.token_ids)
        if cached is None:
            return None
        self.waiting.popleft()
        request.status = Status.RUNNING
        request.num_cached_tokens = cached
        self.batch.add(request, bm.block_table(request.request_id), cached)
        self.running.append(request)
        return min(request.num_tokens - cached, budget)

    # ------------------------------------------------------------------ after the step

    def update(self, step: ScheduledStep, sampled_token_ids: np.ndarray) -> np.ndarray:
        """Record a step that ran: each row computed its query tokens; a row that reached its last
        token appends its sampled token; blocks that became full are published to the prefix cache.

        Args:
            step: what ``schedule`` returned.
            sampled_token_ids: int [B], the token sampled from each row's last position (ignored for
                rows still in their prompt).

        Returns:
            int64 [N], indices into the step's rows of the rows that got a new token.
        """
        batch, rows, query_lens = self.batch, step.rows, step.query_lens
        new_computed = batch.num_computed_tokens[rows] + query_lens
        batch.num_computed_tokens[rows] = new_computed
        produced = (new_computed == batch.num_tokens[rows]).nonzero()[0]
        if len(produced) == len(step):  # every row (always so in a decode step)
            produced_rows, produced_slots, tokens = rows, step.slots, sampled_token_ids
        else:
            produced_rows = produced_slots = step.slots[produced]
            tokens = sampled_token_ids[produced]
        batch.token_ids[produced_slots, batch.num_tokens[produced_rows]] = tokens
        batch.num_tokens[produced_rows] += 1

        if self.block_manager.enable_prefix_caching:
            self._publish_filled_blocks(step, new_computed)
        return produced

    def _publish_filled_blocks(self, step: ScheduledStep, new_computed: np.ndarray) -> None:
        """Publish the blocks the step filled (``new_computed``: int64 [B], each row's computed
        tokens after the step) to the prefix cache."""
        batch, bm, query_lens = self.batch, self.block_manager, step.query_lens
        block_size = bm.block_size
        filled = (new_computed // block_size > (new_computed - query_lens) // block_size).nonzero()[0]
        if len(filled) == 0:
            return
        if step.num_tokens == len(step):  # one token per row: each filled row filled one block
            first_token = new_computed[filled] - block_size
            block_tokens = batch.token_ids[step.slots[filled, None], first_token[:, None] + np.arange(block_size)]
            bm.publish_next_blocks([step.requests[i].request_id for i in filled.tolist()],
                                   (first_token // block_size).tolist(), block_tokens)
        else:
            for i in filled.tolist():
                request, num_computed = step.requests[i], int(new_computed[i])
                bm.publish(request.request_id, batch.token_ids[request.slot, :num_computed], num_computed)

    # ------------------------------------------------------------------ leaving the batch

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        self.batch.remove(request)

    def _preempt(self, request: Request) -> None:
        self._stop_running(request)
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out (finished or aborted) and free its blocks."""
        if request.status is Status.RUNNING:
            self._stop_running(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
