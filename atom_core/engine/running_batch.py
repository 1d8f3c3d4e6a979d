"""The running requests' state in numpy arrays, one row ("slot") per request, kept across steps.

A request takes the first free slot when the scheduler admits it. Slots stay dense: when a
request leaves, the request in the last slot moves into the hole. So the running requests are
always slots ``0 .. num_rows-1`` and a step over all of them reads every per-slot array through
a view (``num_tokens[:n]``) and updates it in place — no Python loop over requests, no gather.

While a request runs, its slot holds the truth about its tokens and progress; ``Request``
reads it through its properties (``token_ids``, ``num_tokens``, ``num_computed_tokens``) and
takes it back as plain values when it leaves. Sampling parameters and stop limits are written
once, at admission.

Legend: S = slots (max_num_seqs), L = max_model_len, P = ceil(L / block_size) pages.
``token_ids`` takes 4 * S * L bytes of host memory (256 slots of 40960 tokens: 42 MB).
"""

from __future__ import annotations

import numpy as np

from atom_core.engine.request import Request


class RunningBatch:
    """Per-slot arrays of the running requests (slots ``0 .. num_rows-1`` are in use).

    Attributes:
        requests: the request in each used slot, ``requests[slot]``.
        token_ids: int32 [S, L], prompt then output tokens; valid up to ``num_tokens``.
        num_tokens: int64 [S], tokens known (prompt + sampled so far).
        num_computed_tokens: int64 [S], leading tokens whose KV is in the pool.
        num_prompt_tokens: int64 [S].
        block_table: int32 [S, P], the pool blocks of the request's pages, -1 after ``num_pages``
            (and in free slots).
        num_pages: int64 [S], blocks the request holds.
        num_published_blocks: int64 [S], leading blocks the prefix cache knows (served by it at
            admission, or published since).
        admission_order: int64 [S], increases with each admission (a re-admitted request is newest).
        temperature: float32 [S]; top_k: int32 [S]; top_p: float32 [S]; min_p: float32 [S];
        seed: int64 [S]: sampling parameters, in the dtypes ``ops.sample`` takes.
        check_from_len: int64 [S], ``num_tokens`` from which the engine checks the request's stop
            conditions in Python: ``min(num_prompt_tokens + max_tokens, max_model_len)`` (where it
            stops for length), or 0 (every token) when it has stop strings, stop token ids or
            logprobs. (EOS is checked for all rows at once.)
        stops_at_eos: bool [S], ``not ignore_eos``.
        wants_logprobs: bool [S].
        num_using_top_k, num_using_top_p, num_using_min_p, num_stopping_at_eos,
        num_wanting_logprobs: used slots with that filter on / that stop on EOS / that want
            logprobs (0 lets a step skip that work for every row).
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int):
        if max_num_seqs < 1 or max_model_len < 1 or block_size < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}, max_model_len={max_model_len} and "
                             f"block_size={block_size} must all be >= 1")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        slots, pages = max_num_seqs, -(-max_model_len // block_size)
        self.requests: list[Request] = []
        self.token_ids = np.zeros((slots, max_model_len), dtype=np.int32)
        self.block_table = np.full((slots, pages), -1, dtype=np.int32)
        self.num_tokens = np.zeros(slots, dtype=np.int64)
        self.num_computed_tokens = np.zeros(slots, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(slots, dtype=np.int64)
        self.num_pages = np.zeros(slots, dtype=np.int64)
        self.num_published_blocks = np.zeros(slots, dtype=np.int64)
        self.admission_order = np.zeros(slots, dtype=np.int64)
        self.temperature = np.zeros(slots, dtype=np.float32)
        self.top_k = np.zeros(slots, dtype=np.int32)
        self.top_p = np.ones(slots, dtype=np.float32)
        self.min_p = np.zeros(slots, dtype=np.float32)
        self.seed = np.zeros(slots, dtype=np.int64)
        self.check_from_len = np.zeros(slots, dtype=np.int64)
        self.stops_at_eos = np.zeros(slots, dtype=bool)
        self.wants_logprobs = np.zeros(slots, dtype=bool)
        # The arrays a slot's state lives in (besides token_ids and block_table rows).
        self._slot_arrays = (self.num_tokens, self.num_computed_tokens, self.num_prompt_tokens, self.num_pages,
                             self.num_published_blocks, self.admission_order, self.temperature, self.top_k,
                             self.top_p, self.min_p, self.seed, self.check_from_len, self.stops_at_eos,
                             self.wants_logprobs)
        self.num_using_top_k = self.num_using_top_p = self.num_using_min_p = 0
        self.num_stopping_at_eos = self.num_wanting_logprobs = 0
        self._num_admitted = 0

    @property
    def num_rows(self) -> int:
        """Slots in use: the running requests are slots ``0 .. num_rows-1``."""
        return len(self.requests)

    def add(self, request: Request, block_ids: list[int], num_computed_tokens: int) -> int:
        """Put ``request`` in the first free slot with its tokens, blocks and parameters; returns the slot."""
        if request.slot is not None:
            raise ValueError(f"request {request.request_id} already holds slot {request.slot}")
        if len(self.requests) == self.max_num_seqs:
            raise ValueError(f"no free slot: the batch already holds max_num_seqs={self.max_num_seqs} requests")
        tokens = request.token_ids
        n, num_pages = len(tokens), len(block_ids)
        if n > self.max_model_len:
            raise ValueError(f"request {request.request_id} has {n} tokens, more than max_model_len="
                             f"{self.max_model_len}")
        if num_pages > self.block_table.shape[1]:
            raise ValueError(f"request {request.request_id} holds {num_pages} blocks, more than the "
                             f"{self.block_table.shape[1]} pages of max_model_len={self.max_model_len}")
        if num_pages * self.block_size < n or not 0 <= num_computed_tokens <= n:
            raise ValueError(f"request {request.request_id}: {num_pages} blocks of {self.block_size} for {n} "
                             f"tokens, {num_computed_tokens} computed")
        slot = len(self.requests)
        self.requests.append(request)
        self.token_ids[slot, :n] = tokens
        self.block_table[slot, :num_pages] = block_ids
        self.num_tokens[slot] = n
        self.num_computed_tokens[slot] = num_computed_tokens
        self.num_prompt_tokens[slot] = request.num_prompt_tokens
        self.num_pages[slot] = num_pages
        self.num_published_blocks[slot] = num_computed_tokens // self.block_size  # prefix-cache hits
        self.admission_order[slot] = self._num_admitted
        self._num_admitted += 1
        params = request.params
        self.temperature[slot] = params.temperature
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.seed[slot] = request.seed
        checked_every_token = params.stop_strings or params.stop_token_ids or request.logprobs is not None
        self.check_from_len[slot] = 0 if checked_every_token else min(request.num_prompt_tokens + params.max_tokens,
                                                                       self.max_model_len)
        self.stops_at_eos[slot] = not params.ignore_eos
        self.wants_logprobs[slot] = request.logprobs is not None
        self._count_params(request, +1)
        request.attach(self, slot)
        return slot

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        """Add pool blocks at the end of the slot's table."""
        start = int(self.num_pages[slot])
        self.block_table[slot, start:start + len(block_ids)] = block_ids
        self.num_pages[slot] = start + len(block_ids)

    def append_block_each(self, slots: np.ndarray, block_ids: list[int]) -> None:
        """Add one pool block at the end of each slot's table (``slots`` int [N], distinct)."""
        self.block_table[slots, self.num_pages[slots]] = block_ids
        self.num_pages[slots] += 1

    def remove(self, request: Request) -> None:
        """Free the request's slot (it keeps its tokens and computed count as plain values); the
        request in the last slot moves into it, so the used slots stay ``0 .. num_rows-1``."""
        slot = request.slot
        if slot is None or request.running_batch is not self:
            raise ValueError(f"request {request.request_id} holds no slot of this batch")
        request.detach()
        self._count_params(request, -1)
        last = len(self.requests) - 1
        moved = self.requests.pop()
        if slot != last:
            self.requests[slot] = moved
            moved.slot = slot
            for array in self._slot_arrays:
                array[slot] = array[last]
            n = int(self.num_tokens[slot])
            self.token_ids[slot, :n] = self.token_ids[last, :n]
            self.block_table[slot] = self.block_table[last]
        self.block_table[last] = -1

    def read_tokens(self, slot: int, start: int) -> list[int]:
        """The slot's tokens from index ``start`` on, as Python ints."""
        return self.token_ids[slot, start:int(self.num_tokens[slot])].tolist()

    def _count_params(self, request: Request, sign: int) -> None:
        params = request.params
        self.num_wanting_logprobs += sign * (request.logprobs is not None)
        self.num_using_top_k += sign * (params.top_k > 0)
        self.num_using_top_p += sign * (params.top_p < 1)
        self.num_using_min_p += sign * (params.min_p > 0)
        self.num_stopping_at_eos += sign * (not params.ignore_eos)
