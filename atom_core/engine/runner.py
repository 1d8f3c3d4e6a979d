"""The model runner: one step's tensors in, sampled tokens out.

It owns the KV pool and the device buffers. Per step it builds the token layout with
``atom_core.cache.build_step_layout``, runs the model (eagerly, or by replaying a CUDA graph
captured for pure-decode batches of a padded size), and samples with ``atom_core.ops.sample``.

Legend: B = rows, T = tokens this step, V = vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from atom_core.cache import PoolPlan, StepLayout, build_step_layout
from atom_core.engine.cuda_graphs import DecodeGraphs
from atom_core.engine.request import Request
from atom_core.ops.sampling import sample

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """Sampled token per row (meaningful only for rows that completed their prompt) and logprobs."""

    token_ids: list[int]
    logprobs: list[float] | None


class ModelRunner:
    def __init__(self, model, plan: PoolPlan, *, device, max_num_seqs: int, max_model_len: int,
                 enforce_eager: bool = False):
        self.model = model
        self.device = torch.device(device)
        self.block_size = plan.block_size
        self.max_model_len = max_model_len
        self.max_pages = -(-max_model_len // plan.block_size)
        spec = model.kv_cache_spec()
        # One allocation for the whole pool: [layers, 2 (K, V), num_blocks, block_size, Hk, D].
        self.kv_pool = torch.zeros((spec.num_layers, 2, *plan.kv_shape), dtype=spec.dtype, device=self.device)
        model.bind_kv_cache([(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(spec.num_layers)])
        self.graphs = None
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = DecodeGraphs(self._forward_logits, device=self.device, max_batch_size=max_num_seqs,
                                       max_pages=self.max_pages, max_seqlen_k=max_model_len)

    def _forward_logits(self, input_ids: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        hidden = self.model(input_ids, layout.positions, layout)
        return self.model.compute_logits(hidden[layout.logits_indices])

    def prepare(self, requests: list[Request], query_lens: list[int], block_tables: list[list[int]],
                pad_rows_to: int | None = None) -> tuple[np.ndarray, StepLayout]:
        """Input ids [T] and the step layout (CPU) for rows ``requests[i]`` computing ``query_lens[i]``
        tokens, the row's pool pages being ``block_tables[i]``. With ``pad_rows_to`` the batch is
        padded for a CUDA graph (one id-0 token per padding row, tables ``max_pages`` wide)."""
        cached = [r.num_computed_tokens for r in requests]
        num_tokens = sum(query_lens)
        num_pad = 0 if pad_rows_to is None else pad_rows_to - len(requests)
        input_ids = np.zeros(num_tokens + num_pad, dtype=np.int64)
        input_ids[:num_tokens] = np.fromiter(
            chain.from_iterable(r.token_ids[c:c + q] for r, c, q in zip(requests, cached, query_lens)),
            dtype=np.int64, count=num_tokens)
        layout = build_step_layout(query_lens, cached, block_tables, self.block_size, pad_rows_to=pad_rows_to,
                                   pad_pages_to=None if pad_rows_to is None else self.max_pages)
        return input_ids, layout

    @torch.inference_mode()
    def execute(self, requests: list[Request], query_lens: list[int], block_tables: list[list[int]],
                want_logprobs: bool) -> StepResult:
        num_rows = len(requests)
        if self.graphs is not None and max(query_lens) == 1 and self.graphs.fits(num_rows):
            size = self.graphs.size_for(num_rows)
            input_ids, layout = self.prepare(requests, query_lens, block_tables, pad_rows_to=size)
            logits = self.graphs.run(input_ids, layout)
        else:
            input_ids, layout = self.prepare(requests, query_lens, block_tables)
            dev_layout = layout.to(self.device, non_blocking=True)
            ids = torch.from_numpy(input_ids).to(self.device, non_blocking=True)
            logits = self._forward_logits(ids, dev_layout)
        return self.sample(logits[:num_rows], requests, want_logprobs)

    def sample(self, logits: torch.Tensor, requests: list[Request], want_logprobs: bool) -> StepResult:
        # Per-row parameters in one array: temperature, top_k, top_p, min_p.
        params = np.array([(r.params.temperature, r.params.top_k, r.params.top_p, r.params.min_p) for r in requests],
                          dtype=np.float64).reshape(-1, 4)
        seeds = np.fromiter((r.seed for r in requests), dtype=np.int64, count=len(requests))
        offsets = np.fromiter((r.num_output_tokens for r in requests), dtype=np.int64, count=len(requests))
        dev = logits.device

        def put(a, dtype):
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype=dtype, non_blocking=True)

        result = sample(logits, put(params[:, 0], torch.float32), put(params[:, 1], torch.int32),
                        put(params[:, 2], torch.float32), put(params[:, 3], torch.float32),
                        put(seeds, torch.int64), put(offsets, torch.int64), return_logprobs=want_logprobs)
        if want_logprobs:
            tokens, logprobs = result
            return StepResult(tokens.tolist(), logprobs.tolist())
        return StepResult(result.tolist(), None)
