"""Token layout: where this step's tokens go. Pure functions of the batch.

A step's batch is described per row (one row = one sequence's slice of tokens in this step)
by three things: ``cached_lens[r]`` (tokens of the row already in the KV pool), ``query_lens[r]``
(tokens computed this step) and ``block_tables[r]`` (pool blocks holding the row's pages).
Everything an attention backend needs follows from those (see ``StepLayout``).
``build_step_layout`` takes any batch; ``build_decode_layout`` is its fast path for a batch of one
token per row on a padded 2-D table (the common decode step), pinned to it by the tests.

Legend: B = rows, T = tokens this step (sum of query_lens), P = padded pages per row.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from atom_core.cache.page_table import (
    INT32_MAX,
    PAD_BLOCK_ID,
    as_int_vector,
    check_block_size,
    check_pages_cover_context,
    padded_block_table,
)

NO_SLOT = -1  # slot_mapping value for a token whose K/V is not written (padding rows)


@dataclass(frozen=True, eq=False)
class StepLayout:
    """Where one step's tokens go; what every attention backend reads. CPU tensors from
    ``build_step_layout``; ``to(device)`` moves them.

    Rows are in input order, then padding rows (if any). Query tokens of row r are the last
    ``query_lens[r]`` of its ``context_lens[r]``-token context (causal mask aligned bottom-right).

    Attributes:
        positions: int64 [T], position of each token in its own sequence (``cached_lens[r] + i``).
        slot_mapping: int64 [T], pool slot each token's K/V is written to,
            ``block_tables[r, pos // block_size] * block_size + pos % block_size``; -1 = write nothing.
        cu_seqlens_q: int32 [B+1], prefix sums of the query lengths (row r's tokens are
            ``cu_seqlens_q[r]:cu_seqlens_q[r+1]``).
        cu_seqlens_k: int32 [B+1], prefix sums of ``context_lens``.
        max_seqlen_q: int, longest query (0 for an empty batch).
        max_seqlen_k: int, longest context (0 for an empty batch).
        context_lens: int32 [B], tokens of the row in the pool once this step is written.
        block_tables: int32 [B, P], pool block of each page, padded with -1.
        logits_indices: int64 [B], index in [0, T) of each row's last token.
        is_prefill: bool [B], False only for plain decode rows (query 1 on a cached context)
            and for padding rows.
        num_prefill_rows: int, rows with ``is_prefill``.
        num_decode_rows: int, the other rows (padding rows included).
        row_order: int32 [B], the rows by descending ``context_lens`` (ties in row order): the order
            the split-K decode attention launches them in, so that the longest start first and the
            short ones fill in behind them (``ops.paged_attention(row_order=...)``).
        block_size: int, tokens per pool block that ``slot_mapping`` and ``block_tables`` count in; the
            attention layers refuse a pool of another (``check_pool_block_size``).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    is_prefill: torch.Tensor
    num_prefill_rows: int
    num_decode_rows: int
    row_order: torch.Tensor
    block_size: int

    @property
    def num_rows(self) -> int:
        """B, padding rows included."""
        return int(self.context_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """T, padding tokens included."""
        return int(self.positions.shape[0])

    def check_pool_block_size(self, pool_block_size: int, pool: str) -> None:
        """Raise ValueError unless ``pool`` (its name in the message) has this layout's block size: a layout
        built for another one addresses the wrong slots and pages."""
        if pool_block_size != self.block_size:
            raise ValueError(f"the step layout was built with block_size={self.block_size} but {pool} holds "
                             f"{pool_block_size} tokens per block: build the layout with the pool's block size")

    def to(self, device, non_blocking: bool = False) -> StepLayout:
        """A copy with every tensor moved to ``device`` (ints stay as they are)."""
        moved = {
            f.name: value.to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def longest_first(context_lens) -> torch.Tensor:
    """``StepLayout.row_order``: the rows by descending context (int [B], any array-like), ties in row order
    (int32 [B])."""
    return torch.from_numpy(np.argsort(-np.asarray(context_lens, dtype=np.int64), kind="stable").astype(np.int32))


def _check_lengths(query: np.ndarray, cached: np.ndarray) -> None:
    if query.size != cached.size:
        raise ValueError(f"query_lens has {query.size} rows but cached_lens has {cached.size}")
    if (cached < 0).any():
        r = int(np.flatnonzero(cached < 0)[0])
        raise ValueError(f"cached_lens[{r}] = {int(cached[r])} is negative")
    if (query < 1).any():
        r = int(np.flatnonzero(query < 1)[0])
        raise ValueError(f"query_lens[{r}] = {int(query[r])}; every row computes at least one token")


def build_step_layout(
    query_lens,
    cached_lens,
    block_tables,
    block_size: int,
    *,
    pad_rows_to: int | None = None,
    pad_pages_to: int | None = None,
    pad_tokens_to: int | None = None,
) -> StepLayout:
    """The step's token layout from per-row lengths and block tables.

    Args:
        query_lens: int [B], tokens computed this step per row (>= 1): a whole prompt, a
            chunk of one, the tail after a prefix-cache hit, 1 for decode, k for k-token
            (speculative) decode.
        cached_lens: int [B], tokens of the row already in the pool (>= 0).
        block_tables: ragged list of per-row block-id lists, or int [B, P] padded with -1.
            Row r needs at least ``ceil((cached_lens[r] + query_lens[r]) / block_size)`` blocks.
        block_size: tokens per block, any int >= 1.
        pad_rows_to: pad the batch to this many rows (CUDA-graph buckets). Each padding row
            has one token (position 0, slot -1), context 0, a block-table row of -1, and is
            not prefill. Must be >= B.
        pad_pages_to: width P of the returned block table; must be >= the longest row's blocks.
        pad_tokens_to: pad the step to this many tokens (CUDA graphs of mixed steps): the first
            padding row takes all the padding tokens (positions 0.., slot -1, context 0) and the
            other padding rows none. Needs ``pad_rows_to`` > B when it is > T.

    Lengths accept sequences of ints, 1-D integer numpy arrays or tensors. Raises ValueError
    (TypeError for non-integer input) naming the bad argument. A caller that keeps its block
    tables in a persistent 2-D array skips the ragged-list conversion (the costliest host step
    for large decode batches: one Python int read per block id).
    """
    block_size = check_block_size(block_size)
    query = as_int_vector("query_lens", query_lens)
    cached = as_int_vector("cached_lens", cached_lens)
    _check_lengths(query, cached)
    num_real_rows = query.size
    table, num_pages = padded_block_table(block_tables, num_rows=num_real_rows)
    context = cached + query
    check_pages_cover_context(num_pages, context, block_size)

    num_pad_rows = 0
    if pad_rows_to is not None:
        if pad_rows_to < num_real_rows:
            raise ValueError(f"pad_rows_to={pad_rows_to} is smaller than the batch of {num_real_rows} rows")
        num_pad_rows = int(pad_rows_to) - num_real_rows
    width = table.shape[1]
    if pad_pages_to is not None:
        if pad_pages_to < width:
            raise ValueError(f"pad_pages_to={pad_pages_to} is smaller than the {width} blocks of the longest row")
        width = int(pad_pages_to)

    # Padding rows: nothing cached, nothing in the pool; one token each, or all the padding
    # tokens in the first one and none in the others.
    pad_query = np.ones(num_pad_rows, dtype=np.int64)
    if pad_tokens_to is not None:
        num_pad_tokens = int(pad_tokens_to) - int(query.sum())
        if num_pad_tokens < 0:
            raise ValueError(f"pad_tokens_to={pad_tokens_to} is smaller than the step's {int(query.sum())} tokens")
        if num_pad_tokens and not num_pad_rows:
            raise ValueError(f"pad_tokens_to={pad_tokens_to} needs a padding row (pad_rows_to > {num_real_rows})")
        pad_query[:] = 0
        if num_pad_rows:
            pad_query[0] = num_pad_tokens
    all_query = np.concatenate([query, pad_query])
    all_context = np.concatenate([context, np.zeros(num_pad_rows, dtype=np.int64)])
    num_rows = all_query.size

    cu_seqlens_q = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(all_query, out=cu_seqlens_q[1:])
    cu_seqlens_k = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(all_context, out=cu_seqlens_k[1:])
    if cu_seqlens_k[-1] > INT32_MAX:  # cu_seqlens_k >= cu_seqlens_q elementwise for real rows
        raise ValueError(f"the batch's {int(cu_seqlens_k[-1])} context tokens do not fit int32 cu_seqlens_k")
    num_tokens = int(cu_seqlens_q[-1])
    num_real_tokens = int(cu_seqlens_q[num_real_rows])

    # Token t of row r is query token i = t - cu_seqlens_q[r]; its position is cached[r] + i.
    token_row = np.repeat(np.arange(num_real_rows), query)
    positions = np.zeros(num_tokens, dtype=np.int64)  # padding tokens keep position 0
    positions[:num_real_tokens] = np.arange(num_real_tokens) - cu_seqlens_q[token_row] + cached[token_row]

    # slot = block * block_size + offset, in int64: block ids near 2**31 / block_size overflow int32.
    slot_mapping = np.full(num_tokens, NO_SLOT, dtype=np.int64)
    real_positions = positions[:num_real_tokens]
    block_of_token = table[token_row, real_positions // block_size]
    slot_mapping[:num_real_tokens] = block_of_token * block_size + real_positions % block_size

    padded_table = np.full((num_rows, width), PAD_BLOCK_ID, dtype=np.int32)
    padded_table[:num_real_rows, : table.shape[1]] = table

    is_prefill = np.zeros(num_rows, dtype=bool)
    is_prefill[:num_real_rows] = ~((query == 1) & (cached > 0))
    num_prefill_rows = int(is_prefill.sum())

    return StepLayout(
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slot_mapping),
        cu_seqlens_q=torch.from_numpy(cu_seqlens_q.astype(np.int32)),
        cu_seqlens_k=torch.from_numpy(cu_seqlens_k.astype(np.int32)),
        max_seqlen_q=int(all_query.max()) if num_rows else 0,
        max_seqlen_k=int(all_context.max()) if num_rows else 0,
        context_lens=torch.from_numpy(all_context.astype(np.int32)),
        block_tables=torch.from_numpy(padded_table),
        logits_indices=torch.from_numpy(cu_seqlens_q[1:] - 1),
        is_prefill=torch.from_numpy(is_prefill),
        num_prefill_rows=num_prefill_rows,
        num_decode_rows=num_rows - num_prefill_rows,
        row_order=longest_first(all_context),
        block_size=block_size,
    )


def build_decode_layout(
    cached_lens,
    block_tables,
    block_size: int,
    *,
    pad_rows_to: int | None = None,
    pad_pages_to: int | None = None,
) -> StepLayout:
    """``build_step_layout`` for a batch where every row computes one token (``query_lens == 1``).

    The fast path of a pure-decode step: no per-token expansion (token r is row r) and no
    entry-by-entry validation of the table, which a caller keeping persistent block tables in
    a 2-D array already holds well formed.

    Args:
        cached_lens: int [B], tokens of the row already in the pool (>= 0); the row's token is
            written at position ``cached_lens[r]``.
        block_tables: int [B, P] numpy array or tensor, padded with -1, taken as given: P is its
            width (no trailing padding column is dropped) and only the page each token writes
            to, ``cached_lens[r] // block_size``, is checked to hold a block. Block ids must be below
            2**31 (the int32 table the kernels read), which is not checked here: ``build_step_layout``
            refuses larger ones.
        block_size, pad_rows_to, pad_pages_to: as in ``build_step_layout``.

    Returns the layout ``build_step_layout([1] * B, cached_lens, block_tables, block_size, ...)``
    returns for a table without trailing all-padding columns.
    """
    block_size = check_block_size(block_size)
    cached = as_int_vector("cached_lens", cached_lens)
    if isinstance(block_tables, torch.Tensor):
        block_tables = block_tables.detach().cpu().numpy()
    if not isinstance(block_tables, np.ndarray) or block_tables.ndim != 2:
        raise ValueError("block_tables must be a 2-D [B, P] array or tensor padded with -1")
    if block_tables.size and block_tables.dtype.kind not in "iu":
        raise TypeError(f"block_tables must hold integers, got dtype {block_tables.dtype}")
    num_real_rows, width = block_tables.shape
    if num_real_rows != cached.size:
        raise ValueError(f"block_tables has {num_real_rows} rows but cached_lens has {cached.size}")
    num_rows = num_real_rows if pad_rows_to is None else int(pad_rows_to)
    if num_rows < num_real_rows:
        raise ValueError(f"pad_rows_to={pad_rows_to} is smaller than the batch of {num_real_rows} rows")
    padded_width = width if pad_pages_to is None else int(pad_pages_to)
    if padded_width < width:
        raise ValueError(f"pad_pages_to={pad_pages_to} is smaller than the {width} columns of block_tables")

    # The token of row r is at position cached[r], on page cached[r] // block_size; its slot is
    # block * block_size + cached % block_size = (block - page) * block_size + cached.
    # (Few, plain numpy calls here: this runs every decode step.)
    min_cached, max_cached = (int(cached.min()), int(cached.max())) if num_real_rows else (1, -1)
    if min_cached < 0:
        r = int((cached < 0).nonzero()[0][0])
        raise ValueError(f"cached_lens[{r}] = {int(cached[r])} is negative")
    if max_cached // block_size >= width:
        r = int((cached // block_size >= width).nonzero()[0][0])
        raise ValueError(f"block_tables row {r} has {width} columns but position {int(cached[r])} "
                         f"is on page {int(cached[r]) // block_size}")
    page = cached // block_size
    block = block_tables[np.arange(num_real_rows), page]
    if block.dtype.kind == "u":
        block = block.astype(np.int64)  # unsigned minus int64 would give floats
    if num_real_rows and block.min() < 0:
        r = int((block < 0).nonzero()[0][0])
        raise ValueError(f"block_tables row {r} has no block on page {int(page[r])} (position {int(cached[r])})")
    real_slots = (block - page) * block_size + cached  # int64: block ids near 2**31 / block_size overflow int32

    if num_rows == num_real_rows and padded_width == width:
        positions, slot_mapping, context = cached.copy(), real_slots, cached + 1
        table = block_tables.astype(np.int32)  # a copy: the layout never aliases the caller's table
    else:  # padding rows: position 0, slot -1, context 0, no blocks, not prefill
        positions = np.zeros(num_rows, dtype=np.int64)
        positions[:num_real_rows] = cached
        slot_mapping = np.full(num_rows, NO_SLOT, dtype=np.int64)
        slot_mapping[:num_real_rows] = real_slots
        context = np.zeros(num_rows, dtype=np.int64)
        context[:num_real_rows] = cached + 1
        table = np.full((num_rows, padded_width), PAD_BLOCK_ID, dtype=np.int32)
        table[:num_real_rows, :width] = block_tables
    # One token with nothing cached is a (tiny) prefill; padding rows are not.
    is_prefill = np.zeros(num_rows, dtype=bool)
    if min_cached == 0:
        is_prefill[:num_real_rows] = cached == 0
    num_prefill_rows = int(np.count_nonzero(is_prefill)) if min_cached == 0 else 0
    cu_seqlens_k = np.zeros(num_rows + 1, dtype=np.int64)
    np.add.accumulate(context, out=cu_seqlens_k[1:])
    if cu_seqlens_k[-1] > INT32_MAX:
        raise ValueError(f"the batch's {int(cu_seqlens_k[-1])} context tokens do not fit int32 cu_seqlens_k")

    return StepLayout(
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slot_mapping),
        cu_seqlens_q=torch.from_numpy(np.arange(num_rows + 1, dtype=np.int32)),
        cu_seqlens_k=torch.from_numpy(cu_seqlens_k.astype(np.int32)),
        max_seqlen_q=1 if num_rows else 0,
        max_seqlen_k=max_cached + 1 if num_real_rows else 0,
        context_lens=torch.from_numpy(context.astype(np.int32)),
        block_tables=torch.from_numpy(table),
        logits_indices=torch.from_numpy(np.arange(num_rows, dtype=np.int64)),
        is_prefill=torch.from_numpy(is_prefill),
        num_prefill_rows=num_prefill_rows,
        num_decode_rows=num_rows - num_prefill_rows,
        row_order=longest_first(context),
        block_size=block_size,
    )
