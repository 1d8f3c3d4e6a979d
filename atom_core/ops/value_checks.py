"""Debug checks that read tensor contents: positions, slots, block tables, lengths, logits.

Run in debug mode only (``atom_core.ops.validation``), after the metadata checks. Each reads its
tensors on the host: for GPU tensors that is a device-to-host sync, acceptable in debug mode and
the reason these checks are not always on. They are skipped where contents cannot be read: while
torch.compile traces (a data-dependent branch would break the graph), while a CUDA graph is being
captured (a sync is illegal there) and for meta tensors (no data). Each raises ValueError naming
the argument, the first bad index and its value. What each backend does with such input when the
checks are off is in docs/ops.md ("Debug checks").

Legend: T tokens, B rows, P pages per row, NB pool blocks, BS block size, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor


def contents_readable(*tensors: Tensor | None) -> bool:
    """Whether the debug checks may read these tensors' contents now (see the module docstring)."""
    if torch.compiler.is_compiling():
        return False
    if any(t is not None and t.device.type == "meta" for t in tensors):
        return False
    on_gpu = any(t is not None and t.is_cuda for t in tensors)
    return not (on_gpu and torch.cuda.is_current_stream_capturing())


def first_true(mask: Tensor) -> tuple[int, ...] | None:
    """Index of the first True of ``mask`` in row-major order, or None (one host sync)."""
    hits = torch.nonzero(mask)
    return None if hits.shape[0] == 0 else tuple(hits[0].tolist())


def _at(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(map(str, index))}]"


def _raise_first_outside(name: str, values: Tensor, low: int, high: int, what: str) -> None:
    """ValueError at the first entry of ``values`` outside [low, high)."""
    index = first_true((values < low) | (values >= high))
    if index is not None:
        raise ValueError(f"{_at(name, index)} = {int(values[index])} is outside [{low}, {high}) ({what})")


def check_positions(positions: Tensor, num_positions: int) -> None:
    """positions: int [T]; each must name a row of the cos/sin cache [P, R]."""
    if contents_readable(positions):
        _raise_first_outside("positions", positions, 0, num_positions,
                             f"the cos/sin cache has {num_positions} rows")


def check_slots(slot_mapping: Tensor, num_slots: int) -> None:
    """slot_mapping: int [T]; each is -1 (write nothing) or a slot of the pool [0, NB * BS)."""
    if contents_readable(slot_mapping):
        _raise_first_outside("slot_mapping", slot_mapping, -1, num_slots,
                             f"-1 writes nothing; the pool has {num_slots} slots")


def check_permutation(name: str, order: Tensor) -> None:
    """order: int [B]; each of 0 .. B-1 exactly once."""
    if not contents_readable(order):
        return
    values = order.cpu().long()
    _raise_first_outside(name, values, 0, values.shape[0], f"it orders {values.shape[0]} rows")
    seen = torch.bincount(values, minlength=values.shape[0])
    index = first_true(seen != 1)
    if index is not None:
        raise ValueError(f"{name} must hold each row once: row {index[0]} appears {int(seen[index])} times")


def check_attention_layout(num_tokens: int, num_blocks: int, block_size: int, block_tables: Tensor,
                           cu_seqlens_q: Tensor, context_lens: Tensor, max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The step's layout as ``paged_attention`` reads it (shapes and dtypes already checked).

    cu_seqlens_q [B+1]: starts at 0, ends at T, never decreases. context_lens [B]: >= 0, and a row
    with a context holds at least its queries (they are its last tokens; a row with context 0 is
    padding and outputs zeros, whatever its query count). max_seqlen_q / max_seqlen_k: bounds of
    the query lengths / contexts. block_tables [B, P]: ids in [-1, NB); a row's first
    ``ceil(context / BS)`` pages fit in P and are not -1.
    """
    if not contents_readable(block_tables, cu_seqlens_q, context_lens):
        return
    cu, context = cu_seqlens_q.cpu().long(), context_lens.cpu().long()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_q[0] = {int(cu[0])} must be 0")
    if int(cu[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens_q[-1] = {int(cu[-1])} must equal the {num_tokens} query tokens of q")
    q_lens = cu[1:] - cu[:-1]
    row = first_true(q_lens < 0)
    if row is not None:
        r = row[0]
        raise ValueError(f"cu_seqlens_q must not decrease: cu_seqlens_q[{r + 1}] = {int(cu[r + 1])} "
                         f"< cu_seqlens_q[{r}] = {int(cu[r])}")
    row = first_true(context < 0)
    if row is not None:
        raise ValueError(f"{_at('context_lens', row)} = {int(context[row])} is negative")
    row = first_true((q_lens > context) & (context > 0))
    if row is not None:
        r = row[0]
        raise ValueError(f"row {r} has {int(q_lens[r])} query tokens but context_lens[{r}] = {int(context[r])}: "
                         "more queries than context (the queries are the row's last tokens)")
    if q_lens.numel() and int(q_lens.max()) > max_seqlen_q:
        r = int(q_lens.argmax())
        raise ValueError(f"max_seqlen_q = {max_seqlen_q} is below row {r}'s {int(q_lens[r])} query tokens")
    if context.numel() and int(context.max()) > max_seqlen_k:
        r = int(context.argmax())
        raise ValueError(f"max_seqlen_k = {max_seqlen_k} is below context_lens[{r}] = {int(context[r])}")
    _check_block_tables(block_tables.cpu().long(), context, num_blocks, block_size)


def _check_block_tables(table: Tensor, context: Tensor, num_blocks: int, block_size: int) -> None:
    num_pages = table.shape[1]
    pages_needed = (context + block_size - 1) // block_size
    row = first_true(pages_needed > num_pages)
    if row is not None:
        r = row[0]
        raise ValueError(f"context_lens[{r}] = {int(context[r])} needs {int(pages_needed[r])} pages of "
                         f"{block_size} slots but block_tables has {num_pages} columns")
    _raise_first_outside("block_tables", table, -1, num_blocks, f"-1 pads past a row's pages; the pool has "
                                                                f"{num_blocks} blocks")
    used = torch.arange(num_pages)[None, :] < pages_needed[:, None]
    index = first_true(used & (table < 0))
    if index is not None:
        r = index[0]
        raise ValueError(f"{_at('block_tables', index)} = -1 lies within the {int(pages_needed[r])} pages "
                         f"context_lens[{r}] = {int(context[r])} needs")


def check_no_nan(name: str, values: Tensor) -> None:
    """No NaN in ``values`` (its first one is named)."""
    if not contents_readable(values):
        return
    index = first_true(values.isnan())
    if index is not None:
        raise ValueError(f"{_at(name, index)} is NaN")


def check_static_scale(name: str, scale: Tensor) -> None:
    """A static quantization scale (values are stored as x / scale): finite and > 0. A negative one flips the
    stored values' signs, a zero one makes them NaN (the twin) or the format's extreme (Triton)."""
    if not contents_readable(scale):
        return
    index = first_true(~(scale.isfinite() & (scale > 0)))
    if index is not None:
        raise ValueError(f"{_at(name, index)} = {float(scale[index])}: a static scale must be finite and > 0")


def check_logits(logits: Tensor) -> None:
    """logits [B, V]: no NaN, and every row has a finite or +inf entry (something to draw)."""
    if not contents_readable(logits):
        return
    check_no_nan("logits", logits)
    row = first_true((logits == float("-inf")).all(dim=-1))
    if row is not None:
        raise ValueError(f"logits row {row[0]} is all -inf: no token can be drawn")
