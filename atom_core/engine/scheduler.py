"""Continuous batching: which requests run this step, how many tokens each computes, and what the
step's result does to them.

Each step is a list of rows (request, query length). Running requests come first, in admission
order (in row order when all of them decode): a decode row computes one token, a request still
in its prompt computes its next chunk. Waiting requests are then admitted while the token budget,
the sequence cap and the pool allow; a prompt longer than the remaining budget is chunked. When
the pool cannot grow a running request, the newest running request is preempted: its blocks are
freed and it waits to be recomputed from its tokens so far (prompt + output), which leaves its
output unchanged.

The scheduler alone owns the running state (a ``RunningBatch``: numpy, one row per request).
``schedule`` returns a ``ScheduledStep`` that carries everything the runner needs (input ids,
cached lengths, block tables, sampling parameters) and counts the step as launched: the rows'
computed tokens advance, and a row that reaches its last token gets one more token, pending until
``record`` reads the step's sampled tokens. So the next step can be scheduled before this one's
tokens are known: a pending token is fed to the next step from the device
(``ScheduledStep.pending_positions`` / ``pending_sources``). A request that reaches its length
limit is not scheduled again; one that stops on EOS or a stop string after its next step was
scheduled has that step's token dropped.

When every running request is decoding — the common step — the scheduler handles them with array
operations and touches in Python only the rows whose next token starts a new block.

A prompt with ``n > 1`` sequences is ``n`` requests: the first is queued, the others are held
(``add(request, after=first)``) until the first's prompt is computed, then admitted ahead of the
queue, so that they take its prompt blocks from the prefix cache instead of computing them again.

Logits processing (penalties, biases, bans; ``logits_processing``) and the log-probs a step must
return (top-N alternatives, prompt log-probs) are part of the ``ScheduledStep`` too; each is
built only while some running row uses it (the running batch counts them).

Structured output (``structured_output``): a request with a grammar holds a ``GrammarState``; the
step's bitmask of its constrained rows is filled when the step is made, and ``record`` advances the
grammars by the sampled tokens (a sequence whose grammar is complete finishes with "stop"). The
masks need the previous tokens on the host: while ``num_structured`` > 0 the engine schedules a
step only after the previous one is recorded. When filling the masks raises (the grammar library
failed), ``schedule`` finishes the requests whose masks it was filling with "error" (their blocks
freed, listed in ``failed_requests``) and raises that exception. The masks are filled before
anything counts the step as made: its other rows stay admitted with nothing counted as computed,
and the next call schedules them again.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from atom_core.cache import BlockManager
from atom_core.engine import structured_output
from atom_core.engine.logits_processing import LogitsProcessing, request_processing, step_processing
from atom_core.engine.request import Request, Status
from atom_core.engine.running_batch import RunningBatch
from atom_core.engine.step import PromptLogprobsInputs, SamplingInputs, ScheduledStep, StepRecord
from atom_core.engine.stop_rule import StopRule

NO_VOCABULARY_LIMIT = 2**62  # what a request made outside the engine is checked against


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, stop_rule: StopRule | None = None):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop_rule = stop_rule or StopRule((), max_model_len)
        self.batch = RunningBatch(max_num_seqs, max_model_len, -(-max_model_len // block_manager.block_size))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (the batch keeps them in row order)
        self.held: list[tuple[Request, Request]] = []  # (first sequence, a later one waiting for its prompt)
        self.num_steps = 0
        self.num_preemptions = 0  # every preemption, also one of a schedule() that then has nothing to run
        self.num_structured = 0  # unfinished requests with a grammar (structured output)
        self.failed_requests: list[Request] = []  # what the last schedule() finished with "error" before raising
        self._ones = np.ones(max_num_seqs, dtype=np.int64)

    def add(self, request: Request, after: Request | None = None) -> None:
        """Queue ``request``; with ``after`` (the first sequence of the same prompt), hold it until
        that one's prompt is computed (see the module docstring)."""
        request.status = Status.WAITING
        request.length_limit = self.stop_rule.length_limit(request)
        params = request.params
        if request.processing is None and (params.uses_penalties or params.uses_token_bias):
            request.processing = request_processing(params, self.stop_rule.eos_token_ids, NO_VOCABULARY_LIMIT,
                                                    self.stop_rule.tokenizer)
        if request.grammar is not None:
            self.num_structured += 1
        if after is None:
            self.waiting.append(request)
        else:
            self.held.append((after, request))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.held)

    def _release_held(self) -> None:
        """Queue (first) the held sequences whose first sequence has computed its prompt (its blocks
        are then published before admission reads the cache) or has finished."""
        ready, still = [], []
        for first, request in self.held:
            if first.finished or (first.status is Status.RUNNING
                                  and self.batch.num_computed_tokens[first.row] >= first.num_prompt_tokens):
                ready.append(request)
            else:
                still.append((first, request))
        self.held = still
        self.waiting.extendleft(reversed(ready))

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> ScheduledStep | None:
        """The next step, counted as launched (see the module docstring); None when no row can run."""
        self.failed_requests = []
        batch, budget = self.batch, self.max_num_batched_tokens
        preempted: list[Request] = []
        decode_rows = self._decode_rows(budget)
        if decode_rows is not None:  # every schedulable running request decodes one token
            self._grow_decode_rows(decode_rows, preempted)
            if preempted:  # rows moved: read them again
                n = batch.num_rows
                decode_rows = np.flatnonzero(batch.num_tokens[:n] < batch.length_limit[:n])
            every_row = _is_all(decode_rows) and len(decode_rows) == batch.num_rows
            requests = list(batch.requests) if every_row else [batch.requests[i] for i in decode_rows.tolist()]
            token_lists = list(batch.token_lists) if every_row else None
            query_lens = self._ones[:len(requests)]
            num_tokens = len(requests)
        else:  # rows in admission order, under the budget
            every_row, token_lists = False, None
            requests, running_lens = self._schedule_running_rows(budget, preempted)
            query_lens = np.array(running_lens, dtype=np.int64)
            num_tokens = int(query_lens.sum())
        budget -= num_tokens

        # Admit waiting requests, unless this step had to preempt (the pool is already too tight).
        # They take the next rows, so a step over every row stays one over rows 0..B-1.
        if self.held:
            self._release_held()
        admitted_lens = []
        if self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            self.publish_computed_blocks()  # admission reads the prefix cache
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            q = self._admit(self.waiting[0], budget)
            if q is None:
                break
            requests.append(self.running[-1])
            admitted_lens.append(q)
            budget -= q
        if admitted_lens:
            query_lens = np.concatenate([query_lens, np.array(admitted_lens, dtype=np.int64)])
            num_tokens += sum(admitted_lens)
        if not requests:
            return None
        if every_row:
            rows = slice(0, len(requests))
            if admitted_lens:
                token_lists += [r.token_ids for r in requests[-len(admitted_lens):]]
        else:  # read after every preemption: a preemption moves the last row's request
            rows = np.fromiter((r.row for r in requests), dtype=np.int64, count=len(requests))
            token_lists = [r.token_ids for r in requests]
        step = self._make_step(requests, rows, query_lens, num_tokens, preempted)
        step.token_lists = token_lists
        return step

    def _decode_rows(self, budget: int) -> np.ndarray | None:
        """Rows of the running requests not yet at their length limit, when each of them computes
        exactly one token and all fit the budget; else None."""
        n, batch = len(self.running), self.batch
        if n == 0:
            return None
        # A running request always has a token left to compute (num_tokens - num_computed >= 1).
        if int((batch.num_tokens[:n] - batch.num_computed_tokens[:n]).max()) != 1:
            return None
        at_limit = batch.num_tokens[:n] >= batch.length_limit[:n]
        rows = np.arange(n) if not at_limit.any() else np.flatnonzero(~at_limit)
        return rows if 0 < len(rows) <= budget else None

    def _grow_decode_rows(self, rows: np.ndarray, preempted: list[Request]) -> None:
        """Give a block to each decoding row whose token starts a new one, oldest first; when the
        pool runs dry, the rest go one by one, preempting from the newest (as in the general case)."""
        batch, bm = self.batch, self.block_manager
        # A decode row writes token num_tokens - 1: it needs num_tokens slots, one block more than
        # it holds when num_tokens = num_pages * block_size + 1.
        short = rows[batch.num_tokens[rows] > batch.num_pages[rows] * bm.block_size]
        if short.size == 0:
            return
        if short.size > bm.num_free_blocks:  # some must preempt: serve the oldest first
            short = short[np.argsort(batch.admission_order[short])]
        requests = [batch.requests[i] for i in short.tolist()]  # before any preemption moves rows
        new_block_ids = bm.append_block_each([r.request_id for r in requests])
        batch.append_block_each(short[:len(new_block_ids)], new_block_ids)
        for request in requests[len(new_block_ids):]:  # the pool ran dry
            if request.row is None:
                continue  # preempted for an older row
            if not self._grow_or_preempt(request, int(batch.num_tokens[request.row]), preempted):
                break

    def _schedule_running_rows(self, budget: int, preempted: list[Request]) -> tuple[list[Request], list[int]]:
        """Rows and query lengths of the running requests, in admission order, under ``budget``
        (the general case: prompts in progress, or more rows than the budget)."""
        batch, requests, query_lens = self.batch, [], []
        for request in list(self.running):  # a copy: growing a row may take an older one out
            if budget <= 0:
                break
            row = request.row
            if row is None:
                continue  # its last token is pending and its blocks went to a row before this one
            num_tokens = int(batch.num_tokens[row])
            if num_tokens >= request.length_limit:
                continue  # its last token is being sampled: nothing left to compute
            num_computed = int(batch.num_computed_tokens[row])
            q = min(num_tokens - num_computed, budget)
            if not self._grow_or_preempt(request, num_computed + q, preempted):
                break  # request itself was preempted: nothing after it is left
            requests.append(request)
            query_lens.append(q)
            budget -= q
        return requests, query_lens

    def _grow_or_preempt(self, request: Request, num_tokens_total: int, preempted: list[Request]) -> bool:
        """Grow ``request``'s table to ``num_tokens_total`` tokens, preempting the newest running
        requests until it fits; False when ``request`` itself had to go. A running request whose
        last token is still pending (async scheduling: it computes nothing more) gives its blocks
        first, at no cost: its token is recorded and it finishes as it would have."""
        bm = self.block_manager
        while not bm.append_slots(request.request_id, num_tokens_total):
            done = self._pending_last_token(request)
            if done is not None:
                self._send_back(done)  # until record() gives it its last token and finishes it
                preempted.append(done)
                continue
            victim = self.running[-1]  # newest; never one already scheduled (those are older)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        num_pages = int(self.batch.num_pages[request.row])
        if num_tokens_total > num_pages * bm.block_size:
            self.batch.append_blocks(request.row, bm.block_table(request.request_id, start=num_pages))
        return True

    def _pending_last_token(self, other_than: Request) -> Request | None:
        """The newest running request at its length limit (its last token sampled, not yet recorded:
        never scheduled again), other than ``other_than``; None if there is none."""
        num_tokens = self.batch.num_tokens
        for request in reversed(self.running):
            if request is not other_than and int(num_tokens[request.row]) >= request.length_limit:
                return request
        return None

    def _admit(self, request: Request, budget: int) -> int | None:
        """Move the head of the queue into the batch; its query length, or None if it does not fit."""
        bm = self.block_manager
        # Prompt log-probs need the logits of every prompt position: no prefix-cache hit (vLLM too).
        # Allocated as a miss; its blocks are published like any other's.
        needs_every_position = (request.params.prompt_logprobs is not None
                                and request.num_prompt_logprobs_scheduled < request.num_prompt_tokens - 1)
        recompute = request.num_preemptions > 0
        cached = bm.allocate(request.request_id, request.token_ids, use_cache=not needs_every_position,
                             count_stats=not recompute)
        if cached is None:
            return None
        self.waiting.popleft()
        request.status = Status.RUNNING
        if not recompute:  # the prompt's hits, as vLLM reports them: a recompute's are not the prompt's
            request.num_cached_tokens = cached
        self.batch.add(request, bm.block_table(request.request_id), cached, cached // bm.block_size)
        self.running.append(request)
        return min(request.num_tokens - cached, budget)

    # ------------------------------------------------------------------ the step's inputs

    def _make_step(self, requests, rows, query_lens, num_tokens, preempted) -> ScheduledStep:
        """The step's inputs, then advance the rows as if it ran (see the module docstring)."""
        batch = self.batch
        cached = batch.num_computed_tokens[rows].copy()
        # First, before anything that counts the step as made: a mask that fails leaves the rest untouched.
        masks = self._grammar_masks(requests, rows, cached, query_lens) if self.num_structured else None
        block_tables = batch.block_table[rows, :int(batch.num_pages[rows].max())]
        if num_tokens == len(requests) and (batch.num_tokens[rows] - cached == 1).all():
            # Every row computes its last token: the row's last_token, or its pending one.
            input_ids = batch.last_token[rows].copy()
            pending = batch.pending_index[rows]
            pending_positions = np.flatnonzero(pending >= 0)
            pending_sources = pending[pending_positions]
        else:
            input_ids, pending_positions, pending_sources = self._gather_input_ids(requests, rows, cached, query_lens)
        step = ScheduledStep(
            step_id=self.num_steps, requests=requests, rows=rows, query_lens=query_lens, cached_lens=cached,
            num_tokens=num_tokens, block_tables=block_tables, input_ids=input_ids,
            pending_positions=pending_positions if len(pending_positions) else None,
            pending_sources=pending_sources if len(pending_positions) else None,
            sampling=self._sampling_inputs(requests, rows),
            want_logprobs=bool(batch.num_wanting_logprobs and batch.wants_logprobs[rows].any()),
            preempted=preempted, row_version=batch.num_removals)
        if batch.num_wanting_top_logprobs:
            step.num_top_logprobs = int(batch.num_top_logprobs[rows].max())
        if batch.num_wanting_prompt_logprobs:
            step.prompt_logprobs = self._prompt_logprobs_inputs(requests, cached, query_lens)
        if masks is not None:
            if step.sampling.processing is None:
                step.sampling.processing = LogitsProcessing()
            step.sampling.processing.mask_rows, step.sampling.processing.token_bitmask = masks
        self.num_steps += 1
        self._advance(step)
        return step

    def _gather_input_ids(self, requests, rows, cached, query_lens):
        """Input ids of a step with prompt chunks (a Python slice per row); a row's pending last
        token comes from the previous step's sampled tokens on the device."""
        pending = self.batch.pending_index[rows]
        chunks, positions, sources = [], [], []
        start = 0
        for request, c, q, p in zip(requests, cached.tolist(), query_lens.tolist(), pending.tolist()):
            chunk = request.token_ids[c:c + q]
            if p >= 0:  # its last token is the pending one, not yet in token_ids
                chunk = chunk + [0]
                positions.append(start + q - 1)
                sources.append(p)
            chunks.append(chunk)
            start += q
        input_ids = np.fromiter((t for chunk in chunks for t in chunk), dtype=np.int64, count=start)
        return input_ids, np.array(positions, dtype=np.int64), np.array(sources, dtype=np.int64)

    def _sampling_inputs(self, requests, rows) -> SamplingInputs:
        batch = self.batch

        def filter_param(array, num_using):  # None = off in every row: the op skips the filter
            return array[rows] if num_using else None

        processing = None
        if batch.num_using_penalties or batch.num_using_token_bias or batch.new_slots:
            processing = step_processing(batch, requests, rows)
        return SamplingInputs(
            temperature=batch.temperature[rows], top_k=filter_param(batch.top_k, batch.num_using_top_k),
            top_p=filter_param(batch.top_p, batch.num_using_top_p),
            min_p=filter_param(batch.min_p, batch.num_using_min_p), seeds=batch.seed[rows],
            offsets=batch.num_tokens[rows] - batch.num_prompt_tokens[rows], processing=processing)

    def _grammar_masks(self, requests, rows, cached, query_lens) -> tuple[np.ndarray, np.ndarray] | None:
        """(the step's indices of its rows that sample a token under a grammar, their bitmask), or None
        when it has none (a row samples when this step computes its last known token). Their previous
        tokens are all recorded: the engine does not schedule ahead while a request has a grammar.
        When the fill raises, those requests finish with "error" (``failed_requests``) and it raises."""
        produces = cached + query_lens == self.batch.num_tokens[rows]
        masked = [i for i, r in enumerate(requests) if r.grammar is not None and produces[i]]
        if not masked:
            return None
        try:
            bitmask = structured_output.fill_bitmask([requests[i].grammar for i in masked])
        except BaseException:
            self.failed_requests = [requests[i] for i in masked]
            for request in self.failed_requests:
                self.finish(request, "error")
            raise
        return np.array(masked, dtype=np.int64), bitmask

    def _prompt_logprobs_inputs(self, requests, cached, query_lens) -> PromptLogprobsInputs | None:
        """The prompt positions whose log-probs this step computes: position p of a row's chunk gives
        the log-prob of prompt token p + 1; each position is computed once (a preempted request's
        recomputation skips the ones already scheduled)."""
        starts = np.cumsum(query_lens) - query_lens
        chosen, indices, targets, counts = [], [], [], []
        num_top = 0
        for i, request in enumerate(requests):
            if request.params.prompt_logprobs is None:
                continue
            c, q = int(cached[i]), int(query_lens[i])
            lo = max(c, request.num_prompt_logprobs_scheduled)
            hi = min(c + q, request.num_prompt_tokens - 1)
            if hi <= lo:
                continue
            request.num_prompt_logprobs_scheduled = hi
            chosen.append(request)
            indices.append(np.arange(starts[i] + lo - c, starts[i] + hi - c, dtype=np.int64))
            targets.append(np.array(request.token_ids[lo + 1:hi + 1], dtype=np.int64))
            counts.append(hi - lo)
            num_top = max(num_top, request.params.prompt_logprobs)
        if not chosen:
            return None
        return PromptLogprobsInputs(chosen, np.concatenate(indices), np.concatenate(targets), counts, num_top)

    def _advance(self, step: ScheduledStep) -> None:
        """Count the step as launched: its tokens computed; a row that reaches its last token gets
        a pending one (index i of the step's sampled tokens). The stop flags of those rows are
        kept in the step for ``record``."""
        batch, rows = self.batch, step.rows
        batch.num_computed_tokens[rows] += step.query_lens
        done = batch.num_computed_tokens[rows] == batch.num_tokens[rows]
        every = bool(done.all())
        step.produces = np.arange(len(step)) if every else np.flatnonzero(done)
        produced_rows = rows if every else _index(rows, step.produces)
        step.new_token_index = batch.num_tokens[produced_rows].copy()
        # Copies, not views: rows move (preemption, finishes) before ``record`` reads them.
        step.stop_flags = (batch.length_limit[produced_rows].copy(), batch.stops_at_eos[produced_rows].copy(),
                           batch.checks_every_token[produced_rows].copy())
        batch.num_tokens[produced_rows] += 1
        batch.pending_index[produced_rows] = step.produces
        batch.pending_step[produced_rows] = step.step_id

    # ------------------------------------------------------------------ after the step

    def record(self, step: ScheduledStep, sampled: np.ndarray, logprobs: np.ndarray | None = None,
               top_logprobs: tuple[np.ndarray, np.ndarray] | None = None,
               prompt_logprobs: list | None = None, logprob_ranks: np.ndarray | None = None) -> StepRecord:
        """Read a step's sampled tokens (int [B], one per row; log-probs float [B] when asked for, with
        ``logprob_ranks`` int [B], each token's rank; ``top_logprobs``: (token ids int [B, N], log-probs
        float [B, N]) when the step has ``num_top_logprobs = N``; ``prompt_logprobs``: per request of
        ``step.prompt_logprobs``, (log-probs [M], ranks [M], top ids [M, N] or None, top log-probs [M, N]
        or None)): each row that produced appends its token, and the ones that stop are finished.

        A request finished (or aborted) since the step was scheduled gets nothing; a preempted
        one still gets its token (it is part of the tokens it recomputes).
        """
        batch, produces = self.batch, step.produces
        every = len(produces) == len(step)
        requests = step.requests if every else [step.requests[i] for i in produces.tolist()]
        tokens = sampled if every else sampled[produces]
        num_tokens = step.new_token_index + 1
        limits, stops_at_eos, checks = step.stop_flags
        unmoved = batch.num_removals == step.row_version  # no request left the batch since the step
        if not unmoved:
            alive = np.fromiter((not r.finished for r in requests), dtype=bool, count=len(requests))
            if not alive.all():
                keep = np.flatnonzero(alive)
                requests = [requests[i] for i in keep.tolist()]
                tokens, produces, num_tokens = tokens[keep], produces[keep], num_tokens[keep]
                limits, stops_at_eos, checks = limits[keep], stops_at_eos[keep], checks[keep]
        token_list = tokens.tolist()
        if unmoved and every:  # C-level loop: the rows' token lists were taken when the step was made
            deque(map(list.append, step.token_lists, token_list), maxlen=0)
        else:
            for request, token in zip(requests, token_list):
                request.token_ids.append(token)
        if logprobs is not None:
            for request, i in zip(requests, produces.tolist()):
                if request.logprobs is not None:
                    request.logprobs.append(float(logprobs[i]))
                    request.logprob_ranks.append(int(logprob_ranks[i]))
                    if request.top_logprobs is not None and top_logprobs is not None:
                        n = request.params.logprobs
                        request.top_logprobs.append(dict(zip(top_logprobs[0][i, :n].tolist(),
                                                             top_logprobs[1][i, :n].tolist())))
        if prompt_logprobs is not None:
            _record_prompt_logprobs(step.prompt_logprobs, prompt_logprobs)

        if unmoved:
            rows, row_tokens = _index(step.rows, produces), tokens
        else:
            rows = np.fromiter((-1 if r.row is None else r.row for r in requests), dtype=np.int64,
                               count=len(requests))
            rows, row_tokens = rows[rows >= 0], tokens[rows >= 0]  # preempted ones hold no row
        batch.last_token[rows] = row_tokens
        batch.pending_index[rows[batch.pending_step[rows] == step.step_id]] = -1

        finish_reasons = {}
        may_stop = self.stop_rule.may_stop(tokens, num_tokens, limits, stops_at_eos, checks)
        if self.num_structured:  # advance the grammars; one that is complete finishes its request
            may_stop |= structured_output.advance(requests, token_list)
        for i in np.flatnonzero(may_stop).tolist():
            grammar = requests[i].grammar
            if grammar is not None and grammar.refused:  # (whatever the token: the sampler's answer to no token)
                reason = self.stop_rule.no_token_allowed(requests[i])
            else:
                reason = self.stop_rule.finish_reason(requests[i])
                # a grammar complete at the length limit: "stop" (what the grammar decided), not "length"
                if reason in (None, "length") and grammar is not None and grammar.done:
                    reason = self._grammar_finish(requests[i])
            if reason is not None:
                self.finish(requests[i], reason)
                finish_reasons[i] = reason
        return StepRecord(requests, tokens, num_tokens, finish_reasons)

    def _grammar_finish(self, request: Request) -> str:
        """A request whose grammar is complete (its last token a stop token the grammar accepted, whose
        text is left out, as EOS's): "stop". (One whose grammar refused a token finishes with "error":
        ``StopRule.no_token_allowed``.)"""
        detokenizer, num_output = request.detokenizer, request.num_output_tokens
        is_stop_token = request.token_ids[-1] in self.stop_rule.eos_token_ids
        if detokenizer is not None:
            keep_last = request.params.include_stop_str_in_output or not is_stop_token
            detokenizer.finish(num_output if keep_last else num_output - 1)
        return "stop"

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
        request_ids, block_indices, token_ids = [], [], []
        for row, lo, hi in zip(rows.tolist(), first[rows].tolist(), full[rows].tolist()):
            request = batch.requests[row]
            tokens = request.token_ids
            for b in range(lo, hi):
                request_ids.append(request.request_id)
                block_indices.append(b)
                token_ids.append(tokens[b * block_size:(b + 1) * block_size])
        bm.publish_blocks(request_ids, block_indices, np.array(token_ids, dtype=np.int64))
        batch.num_published_blocks[rows] = full[rows]

    # ------------------------------------------------------------------ leaving the batch

    def _stop_running(self, request: Request, publish: bool = True) -> None:
        bm, batch, row = self.block_manager, self.batch, request.row
        if publish and bm.enable_prefix_caching:  # its computed blocks stay reusable after they are freed
            num_computed = int(batch.num_computed_tokens[row])
            bm.publish(request.request_id, request.token_ids[:num_computed], num_computed)
        self.running.remove(request)
        bm.free(request.request_id)
        batch.remove(request)

    def _send_back(self, request: Request) -> None:
        """Out of the batch, its blocks freed, to the head of the queue."""
        self._stop_running(request)
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def _preempt(self, request: Request) -> None:
        self._send_back(request)
        request.num_preemptions += 1
        self.num_preemptions += 1

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out (finished or aborted) and free its blocks. After an "error" its blocks
        are not published to the prefix cache: the failed step may not have written them (and its
        tokens were never read)."""
        if request.status is Status.RUNNING:
            self._stop_running(request, publish=reason != "error")
        elif request.status is Status.WAITING:
            held = [pair for pair in self.held if pair[1] is request]
            if held:
                self.held.remove(held[0])
            else:
                self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        if request.grammar is not None:  # the matcher's memory goes now, whatever ended the request
            request.grammar = None
            self.num_structured -= 1


def _record_prompt_logprobs(inputs: PromptLogprobsInputs, results: list) -> None:
    """Append each request's prompt log-probs (a finished or aborted request gets nothing)."""
    for request, (values, ranks, top_ids, top_values) in zip(inputs.requests, results):
        if request.finished:
            continue
        request.prompt_logprobs.extend(values.tolist())
        request.prompt_logprob_ranks.extend(ranks.tolist())
        if request.prompt_top_logprobs is not None:
            n = request.params.prompt_logprobs
            request.prompt_top_logprobs.extend(dict(zip(ids, lps)) for ids, lps
                                               in zip(top_ids[:, :n].tolist(), top_values[:, :n].tolist()))


def _is_all(rows: np.ndarray) -> bool:
    """``rows`` is 0..n-1 (every running row)."""
    return len(rows) == 0 or int(rows[-1]) == len(rows) - 1


def _index(rows, indices: np.ndarray) -> np.ndarray:
    """``rows[indices]`` for a slice ``0:B`` (indices themselves) or an index array."""
    return indices if isinstance(rows, slice) else rows[indices]


