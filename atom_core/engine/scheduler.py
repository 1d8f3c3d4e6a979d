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


@dataclass(slots=True)
class ScheduledStep:
    """Rows of one step: ``requests[i]`` (in slot ``slots[i]`` of the running batch) computes
    ``query_lens[i]`` tokens starting at its ``num_computed_tokens``.

    Attributes:
        requests: the rows' requests.
        slots: int64 [B], their running-batch slots.
        query_lens: int64 [B], tokens each row computes this step (>= 1).
        num_tokens: int, ``sum(query_lens)``.
        preempted: requests sent back to waiting by this step.
        dense: the rows are slots ``0 .. B-1`` in order (``slots == arange(B)``), so per-slot
            arrays are read through views: ``array[step.rows]``.
    """

    requests: list[Request]
    slots: np.ndarray
    query_lens: np.ndarray
    num_tokens: int
    preempted: list[Request] = field(default_factory=list)
    dense: bool = False

    @property
    def rows(self) -> slice | np.ndarray:
        """Index of the rows into a per-slot array: a slice (a view) when dense, else ``slots``."""
        return slice(0, len(self.requests)) if self.dense else self.slots

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
        # Read-only 1s and 0..S-1: a dense step's query lengths and slots are views of them.
        self._ones = np.ones(max_num_seqs, dtype=np.int64)
        self._slot_numbers = np.arange(max_num_seqs, dtype=np.int64)
        self._ones.flags.writeable = self._slot_numbers.flags.writeable = False

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
            query_lens = self._ones[:len(requests)]
            num_tokens = len(requests)
        else:  # rows in admission order, under the budget
            requests, running_lens = self._schedule_running_rows(budget, preempted)
            query_lens = np.array(running_lens, dtype=np.int64)
            num_tokens = sum(running_lens)
        budget -= num_tokens

        # Admit waiting requests, unless this step had to preempt (the pool is already too tight).
        # They take the next slots, so a dense step stays dense.
        admitted_lens = []
        if self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            self.publish_computed_blocks()  # admission reads the prefix cache
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
            num_tokens += sum(admitted_lens)
        if dense:
            slots = self._slot_numbers[:len(requests)]
        else:  # read after every preemption: a preemption moves the last slot's request
            slots = np.fromiter((r.slot for r in requests), dtype=np.int64, count=len(requests))
        return ScheduledStep(requests, slots, query_lens, num_tokens, preempted, dense)

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
        requests = [batch.requests[i] for i in short.tolist()]  # before any preemption moves slots
        new_block_ids = bm.append_block_each([r.request_id for r in requests])
        batch.append_block_each(short[:len(new_block_ids)], new_block_ids)
        for request in requests[len(new_block_ids):]:  # the pool ran dry
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
        token appends its sampled token. (The blocks it filled are published later, in bulk: see
        ``publish_computed_blocks``.)

        Args:
            step: what ``schedule`` returned.
            sampled_token_ids: int [B], the token sampled from each row's last position (ignored for
                rows still in their prompt).

        Returns:
            int64 [N], indices into the step's rows of the rows that got a new token.
        """
        batch, rows = self.batch, step.rows
        batch.num_computed_tokens[rows] += step.query_lens
        produced = (batch.num_computed_tokens[rows] == batch.num_tokens[rows]).nonzero()[0]
        if len(produced) == len(step):  # every row (always so in a decode step)
            produced_rows, produced_slots, tokens = rows, step.slots, sampled_token_ids
        else:
            produced_rows = produced_slots = step.slots[produced]
            tokens = sampled_token_ids[produced]
        batch.token_ids[produced_slots, batch.num_tokens[produced_rows]] = tokens
        batch.num_tokens[produced_rows] += 1

        return produced

    # ------------------------------------------------------------------ prefix cache

    def publish_computed_blocks(self) -> None:
        """Publish to the prefix cache every full block the running requests have computed.

        Publishing is batched: a step only counts what it computed, and the blocks are hashed here,
        all in one call, right before the cache is read (admission) — or in ``_stop_running``
        before a request's blocks are freed. The allocator sees the same index as if each step
        had published its blocks, at a fraction of the per-step cost.
        """
        bm, batch = self.block_manager, self.batch
        if not bm.enable_prefix_caching:
            return
        n, block_size = batch.num_rows, bm.block_size
        full = batch.num_computed_tokens[:n] // block_size
        first = batch.num_published_blocks[:n]
        rows = (full > first).nonzero()[0]
        if len(rows) == 0:
            return
        # Row rows[j] publishes blocks first[j] .. full[j]-1: one entry per block, row by row.
        counts = full[rows] - first[rows]
        block_row = np.repeat(rows, counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        block_index = np.repeat(first[rows], counts) + np.arange(len(block_row)) - starts
        token_ids = batch.token_ids[block_row[:, None], block_index[:, None] * block_size + np.arange(block_size)]
        bm.publish_blocks([batch.requests[r].request_id for r in block_row.tolist()], block_index.tolist(),
                          token_ids)
        batch.num_published_blocks[rows] = full[rows]

    # ------------------------------------------------------------------ leaving the batch

    def _stop_running(self, request: Request) -> None:
        bm, batch, slot = self.block_manager, self.batch, request.slot
        if bm.enable_prefix_caching:  # its computed blocks stay reusable after they are freed
            num_computed = int(batch.num_computed_tokens[slot])
            bm.publish(request.request_id, batch.token_ids[slot, :num_computed], num_computed)
        self.running.remove(request)
        bm.free(request.request_id)
        batch.remove(request)

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
