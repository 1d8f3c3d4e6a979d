"""CUDA graphs of whole steps: the model's forward and LM head, captured once per padded shape,
replayed each step.

Every op the model launches sizes its launch from tensor shapes and the layout's
``max_seqlen_*`` ints alone and never reads tensor contents on the host — attention included
(its query blocks are numbered from ``T`` and ``B``; padding rows exit at once). So a whole step
can be captured, not only the pieces between attention calls, and replayed with new contents in
the same buffers. Two kinds of graph:

- **decode**: every row computes one token; ``B`` rows padded to the next captured size
  (1, 2, 4, 8, then every 16 up to ``max_num_seqs``) with padding rows that write no KV and
  attend to nothing; ``max_seqlen_q = 1`` (the split-K decode kernel).
- **mixed** (prefill, chunked prefill, prefill + decode): ``T`` tokens padded to the next size of
  a ladder (16, 32, ..., 512, then steps of about 1.5x up to ``max_num_batched_tokens``); the
  padding tokens form one extra row with nothing in the pool, and the rows are padded to
  ``min(T_bucket, max_num_seqs + 1)`` with empty rows; ``max_seqlen_q = T_bucket`` (the unified
  kernel).

Both use ``max_seqlen_k = max_model_len``, so one graph serves every context length. Every input
the graph reads lives in a static buffer; a replay copies the step's layout into it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from atom_core.cache import StepLayout

DECODE, MIXED = "decode", "mixed"
# Fields of the layout that the model reads; each has a static buffer a replay copies into.
COPIED_FIELDS = ("positions", "slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens", "logits_indices",
                 "row_order")


def decode_graph_sizes(max_num_seqs: int) -> list[int]:
    """Row counts of the decode graphs: 1, 2, 4, 8, then multiples of 16, and ``max_num_seqs``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def mixed_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts of the mixed graphs: powers of two from 16 to 512, then about 1.5x apart
    (768, 1024, 1536, ...), and ``max_num_batched_tokens``: a step pays at most ~1.5x padding."""
    sizes, size = [], 16
    while size < max_num_batched_tokens:
        sizes.append(size)
        if size < 512:
            size *= 2
        else:  # 512, 768, 1024, 1536, 2048, ...: a power of two times 3/2, then times 4/3
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return sizes + [max_num_batched_tokens]


@dataclass(frozen=True)
class Bucket:
    """A captured shape: ``num_tokens`` tokens in ``num_rows`` rows (padding included)."""

    kind: str
    num_tokens: int
    num_rows: int


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


class StepGraphs:
    """The captured graphs of one engine and their static input buffers.

    Args:
        forward_logits: ``(input_ids [T], layout) -> logits [B, V]`` (the model and its LM head).
        max_num_seqs, max_num_batched_tokens: the engine's limits (the largest decode and mixed graphs).
        max_model_len: ``max_seqlen_k`` of every graph.
        block_size: the pool's tokens per block (the block table is as wide as a ``max_model_len`` request's pages).
    """

    def __init__(self, forward_logits: Callable, *, device, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, block_size: int):
        self.forward_logits = forward_logits
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_pages = -(-max_model_len // block_size)
        self.decode_sizes = decode_graph_sizes(max_num_seqs)
        self.mixed_sizes = mixed_graph_sizes(max_num_batched_tokens)
        self.max_num_seqs = max_num_seqs
        max_tokens = max(self.decode_sizes[-1], self.mixed_sizes[-1])
        max_rows = max(self.decode_sizes[-1], self.mixed_rows(self.mixed_sizes[-1]))
        dev = self.device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=dev)
        self.cu_seqlens_q = torch.zeros(max_rows + 1, dtype=torch.int32, device=dev)
        self.cu_seqlens_k = torch.zeros(max_rows + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(max_rows, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((max_rows, max_pages), -1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.is_prefill = torch.zeros(max_rows, dtype=torch.bool, device=dev)
        self.row_order = torch.arange(max_rows, dtype=torch.int32, device=dev)
        self._graphs: dict[Bucket, _Graph] = {}
        self._pool = None

    def mixed_rows(self, num_tokens: int) -> int:
        """Rows of the mixed graph of ``num_tokens`` tokens: room for every real row and the padding row."""
        return min(num_tokens, self.max_num_seqs + 1)

    def buckets(self) -> list[Bucket]:
        return ([Bucket(DECODE, s, s) for s in self.decode_sizes]
                + [Bucket(MIXED, t, self.mixed_rows(t)) for t in self.mixed_sizes])

    def bucket_for(self, num_tokens: int, num_rows: int, is_decode: bool) -> Bucket | None:
        """The graph a step of ``num_tokens`` tokens in ``num_rows`` rows replays, or None (eager)."""
        if is_decode and num_rows <= self.decode_sizes[-1]:
            size = next(s for s in self.decode_sizes if s >= num_rows)
            return Bucket(DECODE, size, size)
        if num_tokens > self.mixed_sizes[-1]:
            return None
        size = next(t for t in self.mixed_sizes if t >= num_tokens)
        if num_rows > self.max_num_seqs or (num_tokens < size and num_rows >= self.mixed_rows(size)):
            return None
        return Bucket(MIXED, size, self.mixed_rows(size))

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def release(self) -> None:
        """Destroy every captured graph now (the static buffers stay). NCCL frees a communicator only once
        the graphs that captured its collectives are gone: a multi-rank engine calls this before its process
        group is destroyed or aborted. The graphs' memory pool goes with them (its memory returns to the
        caching allocator). A later ``run`` captures again, in a new pool."""
        for captured in self._graphs.values():
            captured.graph.reset()
        self._graphs.clear()
        self._pool = None

    def static_layout(self, bucket: Bucket) -> StepLayout:
        """The static buffers' view of ``bucket``'s shape (what the graph was captured on)."""
        t, b = bucket.num_tokens, bucket.num_rows
        return StepLayout(
            positions=self.positions[:t], slot_mapping=self.slot_mapping[:t],
            cu_seqlens_q=self.cu_seqlens_q[:b + 1], cu_seqlens_k=self.cu_seqlens_k[:b + 1],
            max_seqlen_q=1 if bucket.kind == DECODE else t, max_seqlen_k=self.max_model_len,
            context_lens=self.context_lens[:b], block_tables=self.block_tables[:b],
            logits_indices=self.logits_indices[:b], is_prefill=self.is_prefill[:b],
            num_prefill_rows=0, num_decode_rows=b, row_order=self.row_order[:b],
            block_size=self.block_size)

    def capture_all(self, progress: Callable[[Bucket], None] | None = None) -> None:
        """Capture every bucket not captured yet, largest first, so the shared memory pool is sized
        by the largest and the others reuse it."""
        for bucket in sorted(self.buckets(), key=lambda b: (b.num_tokens, b.kind == MIXED), reverse=True):
            if bucket not in self._graphs:
                self._capture(bucket)
            if progress is not None:
                progress(bucket)

    def _capture(self, bucket: Bucket) -> _Graph:
        layout = self.static_layout(bucket)
        # Rows with no context (padding: attention reads nothing and outputs zeros) and no slots (nothing
        # written): one query token per row, the last row the rest, a layout the ops' debug checks accept.
        rows = bucket.num_rows
        self.cu_seqlens_q[:rows] = torch.arange(rows, dtype=self.cu_seqlens_q.dtype, device=self.device)
        self.cu_seqlens_q[rows:] = bucket.num_tokens
        self.context_lens.zero_()
        self.slot_mapping.fill_(-1)
        # Steps run before (a capture again, after Engine.wake_up) leave their values: indices past this bucket's
        # tokens would gather out of bounds.
        self.logits_indices.zero_()
        self.input_ids.zero_()
        self.positions.zero_()
        torch.arange(self.row_order.shape[0], out=self.row_order)  # each bucket's first rows: a permutation of them
        ids = self.input_ids[:bucket.num_tokens]
        for _ in range(2):  # warm up: Triton compiles and lazy initialisation happen outside the graph
            self.forward_logits(ids, layout)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.forward_logits(ids, layout)
        self._pool = graph.pool()
        self._graphs[bucket] = _Graph(graph, logits)
        return self._graphs[bucket]

    def run(self, bucket: Bucket, input_ids: torch.Tensor, layout: StepLayout,
            pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [bucket.num_rows, V] of a step whose host ``layout`` is already padded to
        ``bucket`` (rows past the real ones are padding).

        input_ids: int64 [bucket.num_tokens] on the host (pinned or not); pending: device
        ``(positions, tokens)`` to scatter into the ids after the copy (tokens sampled by the
        previous step, not yet on the host). Only the layout's own block-table columns are copied:
        the other columns keep ids of earlier steps, which attention never reads (a row reads only
        the pages of its ``context_lens`` tokens; padding rows read none).
        """
        captured = self._graphs.get(bucket) or self._capture(bucket)
        t, b = bucket.num_tokens, bucket.num_rows
        ids = self.input_ids[:t]
        ids.copy_(input_ids, non_blocking=True)
        if pending is not None:
            ids.index_copy_(0, *pending)
        for name in COPIED_FIELDS:
            source = getattr(layout, name)
            getattr(self, name)[:source.shape[0]].copy_(source, non_blocking=True)
        width = layout.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"the step's block table has {width} pages, more than {self.block_tables.shape[1]}")
        self.block_tables[:b, :width].copy_(layout.block_tables, non_blocking=True)
        captured.graph.replay()
        return captured.logits


def padded_input_ids(input_ids: np.ndarray, num_tokens: int) -> np.ndarray:
    """``input_ids`` with zeros appended up to ``num_tokens`` (padding tokens read embedding row 0)."""
    if len(input_ids) == num_tokens:
        return input_ids
    out = np.zeros(num_tokens, dtype=np.int64)
    out[:len(input_ids)] = input_ids
    return out
