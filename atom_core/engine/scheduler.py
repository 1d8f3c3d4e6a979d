"""Continuous batching: which requests run this step, and how many tokens each computes.

Each step is a list of rows (request, query length). Running requests come first, in admission
order: a decode row computes one token, a request still in its prompt computes its next chunk.
Waiting requests are then admitted while the token budget, the sequence cap and the pool allow;
a prompt longer than the remaining budget is chunked. When the pool cannot grow a running
request, the newest running request is preempted: its blocks are freed and it waits to be
recomputed from its tokens so far (prompt + output), which leaves its output unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atom_core.cache import BlockManager
from atom_core.engine.request import Request, Status


@dataclass
class ScheduledStep:
    """Rows of one step: ``requests[i]`` computes ``query_lens[i]`` tokens starting at its
    ``num_computed_tokens``."""

    requests: list[Request] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            q = min(req.num_tokens - req.num_computed_tokens, budget)
            while not bm.append_slots(req.request_id, req.num_computed_tokens + q):
                victim = self.running[-1]  # newest; never one already scheduled (those are before i)
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is req:
                    break
            else:
                step.requests.append(req)
                step.query_lens.append(q)
                budget -= q
                i += 1
                continue
            break  # req itself was preempted: nothing after it is left

        # Admit waiting requests, unless this step had to preempt (the pool is already too tight).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not step.preempted:
            req = self.waiting[0]
            cached = bm.allocate(req.request_id, req.token_ids)
            if cached is None:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.num_computed_tokens = req.num_cached_tokens = cached
            self.running.append(req)
            q = min(req.num_tokens - cached, budget)
            step.requests.append(req)
            step.query_lens.append(q)
            budget -= q
        return step

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Take a request out (finished or aborted) and free its blocks."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.block_manager.free(req.request_id)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
