"""Naive twins of the token-layout and page-table functions, and the batches the tests draw.

The twins walk tokens and rows one at a time in plain Python (arbitrary-precision ints, no
numpy, no torch) and share no code with ``atom_core.cache``. They take block tables as ragged
lists of block ids (no padding) and return plain lists, so a test compares them with the
vectorized results through ``.tolist()``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import strategies as st


def twin_step_layout(query_lens, cached_lens, block_tables, block_size, pad_rows_to=None, pad_pages_to=None) -> dict:
    """Every ``StepLayout`` field, token by token. ``block_tables``: ragged lists of block ids."""
    positions, slot_mapping, context_lens, logits_indices, is_prefill = [], [], [], [], []
    cu_seqlens_q, cu_seqlens_k = [0], [0]
    for query_len, cached_len, row in zip(query_lens, cached_lens, block_tables):
        for i in range(query_len):
            position = cached_len + i
            page = position // block_size
            offset = position - page * block_size
            positions.append(position)
            slot_mapping.append(row[page] * block_size + offset)
        logits_indices.append(len(positions) - 1)
        context_lens.append(cached_len + query_len)
        cu_seqlens_q.append(cu_seqlens_q[-1] + query_len)
        cu_seqlens_k.append(cu_seqlens_k[-1] + cached_len + query_len)
        is_prefill.append(not (query_len == 1 and cached_len > 0))
    query_of_row = list(query_lens)

    num_pad_rows = 0 if pad_rows_to is None else pad_rows_to - len(query_lens)
    for _ in range(num_pad_rows):
        positions.append(0)
        slot_mapping.append(-1)
        logits_indices.append(len(positions) - 1)
        context_lens.append(0)
        cu_seqlens_q.append(cu_seqlens_q[-1] + 1)
        cu_seqlens_k.append(cu_seqlens_k[-1])
        is_prefill.append(False)
        query_of_row.append(1)

    width = max((len(row) for row in block_tables), default=0) if pad_pages_to is None else pad_pages_to
    padded_tables = [list(row) + [-1] * (width - len(row)) for row in block_tables]
    padded_tables += [[-1] * width for _ in range(num_pad_rows)]
    num_prefill_rows = sum(1 for flag in is_prefill if flag)
    return {
        "positions": positions,
        "slot_mapping": slot_mapping,
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k,
        "max_seqlen_q": max(query_of_row, default=0),
        "max_seqlen_k": max(context_lens, default=0),
        "context_lens": context_lens,
        "block_tables": padded_tables,
        "logits_indices": logits_indices,
        "is_prefill": is_prefill,
        "num_prefill_rows": num_prefill_rows,
        "num_decode_rows": len(is_prefill) - num_prefill_rows,
        "row_order": sorted(range(len(context_lens)), key=lambda r: (-context_lens[r], r)),
    }


def twin_pages_used(context_len, block_size) -> int:
    """Smallest page count whose pages hold ``context_len`` tokens, by counting up."""
    pages = 0
    while pages * block_size < context_len:
        pages += 1
    return pages


def twin_block_table_to_csr(block_tables, context_lens, block_size):
    """(kv_indptr, kv_indices, kv_last_page_len) as lists, row by row."""
    kv_indptr, kv_indices, kv_last_page_len = [0], [], []
    for row, context_len in zip(block_tables, context_lens):
        pages = twin_pages_used(context_len, block_size)
        kv_indices.extend(row[:pages])
        kv_indptr.append(len(kv_indices))
        # tokens left for the last page after the full pages before it
        kv_last_page_len.append(context_len - (pages - 1) * block_size if pages else 0)
    return kv_indptr, kv_indices, kv_last_page_len


def twin_csr_to_block_table(kv_indptr, kv_indices, pad_to=None):
    """Padded block table as a list of lists."""
    rows = [list(kv_indices[kv_indptr[r] : kv_indptr[r + 1]]) for r in range(len(kv_indptr) - 1)]
    width = max((len(row) for row in rows), default=0) if pad_to is None else pad_to
    return [row + [-1] * (width - len(row)) for row in rows]


# --- generated batches -----------------------------------------------------------------------

BLOCK_SIZES = (1, 2, 3, 16, 64)
ROW_KINDS = ("prefill", "chunk", "prefix_hit", "decode", "multi_decode", "boundary", "long")
BLOCK_ID_MODES = ("contiguous", "shuffled", "large")
INT32_LIMIT = 2**31  # block ids are int32


@dataclass
class Batch:
    """One step's rows as a scheduler would hand them over; blocks are distinct across rows."""

    query_lens: list[int]
    cached_lens: list[int]
    block_tables: list[list[int]]  # ragged; each row may hold a few blocks past its context
    block_size: int

    @property
    def context_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.cached_lens, self.query_lens)]


@st.composite
def row_lengths(draw, block_size: int, kind: str) -> tuple[int, int]:
    """(query_len, cached_len) of one row of the given kind."""
    if kind == "prefill":  # prompt from scratch
        return draw(st.integers(1, 300)), 0
    if kind == "chunk":  # a later chunk of a chunked prefill
        return draw(st.integers(2, 300)), draw(st.integers(1, 2000))
    if kind == "prefix_hit":  # prompt resumed after whole cached blocks
        return draw(st.integers(1, 200)), block_size * draw(st.integers(1, 40))
    if kind == "decode":
        return 1, draw(st.integers(1, 5000))
    if kind == "multi_decode":  # speculative verification of k tokens
        return draw(st.integers(2, 8)), draw(st.integers(1, 5000))
    if kind == "boundary":  # context ends exactly at a block boundary
        context = block_size * draw(st.integers(1, 20))
        query = draw(st.integers(1, context))
        return query, context - query
    # long: tens of thousands of tokens in one row, as a decode/short step or one big prefill
    if draw(st.booleans()):
        return draw(st.sampled_from([1, 4, 300])), draw(st.integers(10_000, 60_000))
    return draw(st.integers(10_000, 30_000)), 0


@st.composite
def batches(draw, max_rows: int = 6, min_rows: int = 0, block_size: int | None = None) -> Batch:
    """A batch of mixed rows with distinct block ids (contiguous, shuffled, or large ids whose
    product with the block size exceeds 2**31)."""
    if block_size is None:
        block_size = draw(st.sampled_from(BLOCK_SIZES))
    num_rows = draw(st.integers(min_rows, max_rows))
    lengths = [draw(row_lengths(block_size, draw(st.sampled_from(ROW_KINDS)))) for _ in range(num_rows)]
    query_lens = [q for q, _ in lengths]
    cached_lens = [c for _, c in lengths]
    pages_per_row = [twin_pages_used(q + c, block_size) + draw(st.integers(0, 2)) for q, c in lengths]
    total = sum(pages_per_row)

    mode = draw(st.sampled_from(BLOCK_ID_MODES))
    span = 2 * total + 8
    if mode == "contiguous":
        start = draw(st.integers(0, 100))
        ids = list(range(start, start + total))
    else:
        if mode == "shuffled":
            base = 0
        else:
            lowest = INT32_LIMIT // block_size + 1 if block_size > 1 else INT32_LIMIT - span - 1
            base = draw(st.integers(lowest, INT32_LIMIT - 1 - span))
        ids = random.Random(draw(st.integers(0, 2**32 - 1))).sample(range(base, base + span), total)

    block_tables, next_id = [], 0
    for pages in pages_per_row:
        block_tables.append(ids[next_id : next_id + pages])
        next_id += pages
    return Batch(query_lens, cached_lens, block_tables, block_size)
