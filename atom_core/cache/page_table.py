"""Page tables: the pool blocks holding each row, as a padded table or as CSR.

Two equivalent encodings of "row r's i-th page lives in pool block b":

- padded block table, int32 [B, P]: row r is its block ids followed by -1 padding;
- CSR (FlashInfer's paged-KV layout), all int32: ``kv_indptr`` [B+1], ``kv_indices`` [nnz]
  (row r's pages are ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``) and ``kv_last_page_len`` [B]
  (tokens in the row's last page, 1..block_size; 0 for a row with no tokens).

Legend: B = rows, P = padded pages per row, nnz = pages in use over all rows.
All work is vectorized numpy on CPU; results are CPU torch tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from numbers import Integral

import numpy as np
import torch

INT32_MAX = 2**31 - 1
PAD_BLOCK_ID = -1


def as_int_vector(name: str, values) -> np.ndarray:
    """``values`` (sequence of ints, 1-D integer numpy array or tensor) as int64 numpy [N].

    Raises TypeError for a non-integer dtype and ValueError for a shape other than 1-D.
    """
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values  # the common case, checked first: this runs every step
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(array.shape)}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def check_block_size(block_size) -> int:
    """``block_size`` as a Python int >= 1 (TypeError if not an integer, ValueError if < 1)."""
    if type(block_size) is int and block_size >= 1:
        return block_size  # the common case, checked first: this runs every step
    if isinstance(block_size, bool) or not isinstance(block_size, Integral):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return int(block_size)


def _ragged_to_padded(rows: Sequence) -> np.ndarray:
    """A sequence of per-row block-id sequences as int64 [B, max_len], filled with -1."""
    row_lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = int(row_lens.max()) if len(rows) else 0
    if len(rows) and isinstance(rows[0], (np.ndarray, torch.Tensor)):
        flat = np.concatenate([as_int_vector("block_tables row", row) for row in rows])
    else:
        # (checked as one vector: a float or string id is refused, not truncated into another block's id)
        flat = as_int_vector("block_tables", list(itertools.chain.from_iterable(rows)))
    padded = np.full((len(rows), width), PAD_BLOCK_ID, dtype=np.int64)
    # Row-major boolean assignment fills row 0's pages, then row 1's, ...: the order of `flat`.
    padded[np.arange(width) < row_lens[:, None]] = flat
    return padded


def padded_block_table(block_tables, num_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Validate block tables and return ``(table int64 [B, P], num_pages int64 [B])``.

    ``block_tables`` is a ragged list of per-row block-id lists, or a 2-D int array/tensor padded
    with -1. A row must be its block ids (>= 0, < 2**31) followed only by -1. ``num_pages[r]`` is
    the count of block ids in row r; P = max(num_pages) (trailing all-padding columns are dropped,
    so a ragged list and its padded array give the same table). ``num_rows``, if given, is the
    expected B. int64 so that ``block_id * block_size`` cannot overflow downstream.
    """
    if isinstance(block_tables, (np.ndarray, torch.Tensor)):
        array = block_tables.detach().cpu().numpy() if isinstance(block_tables, torch.Tensor) else block_tables
        if array.ndim != 2:
            raise ValueError(f"block_tables must be 2-D [B, P] or a list of lists, got shape {tuple(array.shape)}")
        if array.size and array.dtype.kind not in "iu":
            raise TypeError(f"block_tables must hold integers, got dtype {array.dtype}")
        table = array.astype(np.int64)
    elif isinstance(block_tables, Sequence):
        table = _ragged_to_padded(block_tables)
    else:
        kind = type(block_tables).__name__
        raise TypeError(f"block_tables must be a list of lists or a 2-D array/tensor, got {kind}")
    if num_rows is not None and table.shape[0] != num_rows:
        raise ValueError(f"block_tables has {table.shape[0]} rows, expected {num_rows}")

    # Pages in use = ids before the first negative entry (a sentinel column catches full rows).
    negative = np.concatenate([table < 0, np.ones((table.shape[0], 1), dtype=bool)], axis=1)
    num_pages = negative.argmax(axis=1).astype(np.int64)
    beyond = np.arange(table.shape[1]) >= num_pages[:, None]
    bad = beyond & (table != PAD_BLOCK_ID)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"block_tables row {row}, column {col} holds {int(table[row, col])} after padding began at "
            f"column {int(num_pages[row])}; a row is block ids >= 0 followed only by -1"
        )
    if table.size and int(table.max()) > INT32_MAX:
        row, col = (int(i) for i in np.argwhere(table > INT32_MAX)[0])
        raise ValueError(f"block_tables row {row}, column {col}: block id {int(table[row, col])} does not fit int32")
    width = int(num_pages.max()) if num_pages.size else 0
    return np.ascontiguousarray(table[:, :width]), num_pages


def pages_needed(context_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Pages holding each row's context: ``ceil(context_lens / block_size)``, int64 [B]."""
    return (context_lens + (block_size - 1)) // block_size


def check_pages_cover_context(num_pages: np.ndarray, context_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Raise ValueError naming the first row whose table is too short; return pages needed [B]."""
    needed = pages_needed(context_lens, block_size)
    short = np.flatnonzero(needed > num_pages)
    if short.size:
        r = int(short[0])
        raise ValueError(
            f"block_tables row {r} has {int(num_pages[r])} blocks but its context of {int(context_lens[r])} "
            f"tokens needs ceil({int(context_lens[r])} / {block_size}) = {int(needed[r])}"
        )
    return needed


def block_table_to_csr(block_tables, context_lens, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded (or ragged) block tables → FlashInfer CSR page table.

    Args:
        block_tables: int [B, P] padded with -1, or a ragged list of per-row block-id lists.
        context_lens: int [B], tokens of each row in the pool; row r uses its first
            ``ceil(context_lens[r] / block_size)`` pages (pages past those are not listed).
        block_size: tokens per block, >= 1.

    Returns:
        kv_indptr int32 [B+1], kv_indices int32 [nnz], kv_last_page_len int32 [B]
        (``(context - 1) % block_size + 1``, i.e. in 1..block_size; 0 for an empty row). CPU tensors.
    """
    block_size = check_block_size(block_size)
    context = as_int_vector("context_lens", context_lens)
    if (context < 0).any():
        r = int(np.flatnonzero(context < 0)[0])
        raise ValueError(f"context_lens[{r}] = {int(context[r])} is negative")
    table, num_pages = padded_block_table(block_tables, num_rows=context.size)
    used = check_pages_cover_context(num_pages, context, block_size)

    kv_indptr = np.zeros(context.size + 1, dtype=np.int64)
    np.cumsum(used, out=kv_indptr[1:])
    kv_indices = table[np.arange(table.shape[1]) < used[:, None]]  # row-major: CSR order
    kv_last_page_len = np.where(context > 0, (context - 1) % block_size + 1, 0)
    if kv_indptr[-1] > INT32_MAX:
        raise ValueError(f"{int(kv_indptr[-1])} pages in use do not fit int32 kv_indptr")
    return (
        torch.from_numpy(kv_indptr.astype(np.int32)),
        torch.from_numpy(kv_indices.astype(np.int32)),
        torch.from_numpy(kv_last_page_len.astype(np.int32)),
    )


def csr_to_block_table(kv_indptr, kv_indices, pad_to: int | None = None) -> torch.Tensor:
    """FlashInfer CSR page table → padded block table, int32 [B, P] with -1 padding (CPU).

    Args:
        kv_indptr: int [B+1], starts at 0, non-decreasing, ends at len(kv_indices).
        kv_indices: int [nnz], block ids (>= 0, < 2**31).
        pad_to: table width P; default the most pages of any row. Smaller than that raises.
    """
    indptr = as_int_vector("kv_indptr", kv_indptr)
    indices = as_int_vector("kv_indices", kv_indices)
    if indptr.size == 0 or indptr[0] != 0:
        raise ValueError(f"kv_indptr must start with 0 (length B+1 >= 1), got {indptr[:1].tolist()}")
    row_pages = np.diff(indptr)
    if (row_pages < 0).any():
        r = int(np.flatnonzero(row_pages < 0)[0])
        raise ValueError(f"kv_indptr decreases at row {r}: {int(indptr[r])} -> {int(indptr[r + 1])}")
    if indptr[-1] != indices.size:
        raise ValueError(f"kv_indptr ends at {int(indptr[-1])} but kv_indices has {indices.size} entries")
    if indices.size and (indices.min() < 0 or indices.max() > INT32_MAX):
        raise ValueError("kv_indices must be block ids in [0, 2**31)")
    width = int(row_pages.max()) if row_pages.size else 0
    if pad_to is not None:
        if pad_to < width:
            raise ValueError(f"pad_to={pad_to} is smaller than the {width} pages of the longest row")
        width = int(pad_to)
    table = np.full((row_pages.size, width), PAD_BLOCK_ID, dtype=np.int32)
    table[np.arange(width) < row_pages[:, None]] = indices
    return torch.from_numpy(table)
