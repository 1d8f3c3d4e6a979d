"""CUDA graphs for pure-decode steps: captured once per padded batch size, replayed each step.

A decode step of B rows is padded to the next captured size (1, 2, 4, 8, then every 16) with
padding rows that write no KV and attend to nothing. Every input the graph reads lives in a
static buffer; a replay copies the step's layout into those buffers first. Attention is captured
with ``max_seqlen_k = max_model_len`` so one graph serves every context length.
"""

from __future__ import annotations

import numpy as np
import torch

from atom_core.cache import StepLayout, build_step_layout


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size] + list(range(16, max_batch_size, 16))
    return sorted(set(sizes + [max_batch_size]))


class DecodeGraphs:
    def __init__(self, forward_logits, *, device, max_batch_size: int, max_pages: int, max_seqlen_k: int):
        self.forward_logits = forward_logits  # (input_ids [T], layout) -> logits [B, V]
        self.device = device
        self.max_pages = max_pages
        self.max_seqlen_k = max_seqlen_k
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepLayout, torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        b = self.max_batch_size
        # Static inputs at the largest size; smaller graphs use leading slices.
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.layout = build_step_layout([], [], [], 1, pad_rows_to=b, pad_pages_to=max_pages).to(device)

    def fits(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.max_batch_size

    def size_for(self, num_rows: int) -> int:
        """The captured batch size a step of ``num_rows`` decode rows is padded to."""
        return next(s for s in self.sizes if s >= num_rows)

    def _static_layout(self, size: int) -> StepLayout:
        full = self.layout
        return StepLayout(
            positions=full.positions[:size], slot_mapping=full.slot_mapping[:size],
            cu_seqlens_q=full.cu_seqlens_q[:size + 1], cu_seqlens_k=full.cu_seqlens_k[:size + 1],
            max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k, context_lens=full.context_lens[:size],
            block_tables=full.block_tables[:size], logits_indices=full.logits_indices[:size],
            is_prefill=full.is_prefill[:size], num_prefill_rows=0, num_decode_rows=size)

    def capture_all(self) -> None:
        """Capture every size, largest first so the memory pool is sized once."""
        for size in reversed(self.sizes):
            self._capture(size)

    def _capture(self, size: int):
        layout = self._static_layout(size)
        ids = self.input_ids[:size]
        for _ in range(2):  # warm up (Triton autotuning and lazy init happen outside the graph)
            self.forward_logits(ids, layout)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.forward_logits(ids, layout)
        self._pool = graph.pool()
        self._graphs[size] = (graph, layout, ids, logits)
        return self._graphs[size]

    def run(self, input_ids: np.ndarray, layout: StepLayout) -> torch.Tensor:
        """Logits [size, V] for a decode step already padded to a captured size
        (``build_decode_layout(..., pad_rows_to=size_for(B))``); rows past B are padding.

        The layout's block table may be narrower than ``max_pages``: only its columns are copied.
        The static table's other columns keep ids of earlier steps, which attention never reads
        (a row reads only the pages of its ``context_lens`` tokens; padding rows read none).
        """
        size = layout.num_rows
        graph, static, ids, logits = self._graphs.get(size) or self._capture(size)
        ids.copy_(torch.from_numpy(input_ids), non_blocking=True)
        for name in ("positions", "slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens", "logits_indices"):
            getattr(static, name).copy_(getattr(layout, name), non_blocking=True)
        width = layout.block_tables.shape[1]
        if width > self.max_pages:
            raise ValueError(f"the step's block table has {width} pages, more than max_pages={self.max_pages}")
        static.block_tables[:, :width].copy_(layout.block_tables, non_blocking=True)
        graph.replay()
        return logits
