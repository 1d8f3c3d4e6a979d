"""The model runner: one step's tensors in, sampled tokens out.

It owns the KV pool and the device buffers. ``prepare`` is the host side of a step: it reads the
scheduled rows from the running batch (numpy, by slot) and builds the input ids, the token layout
(``build_decode_layout`` when every row computes one token, else ``build_step_layout``) and the
sampling parameters. ``run`` is the device side: the model (eagerly, or by replaying a CUDA graph
captured for pure-decode batches of a padded size) and ``atom_core.ops.sample``.

Legend: B = rows, T = tokens this step, V = vocabulary.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from atom_core.cache import PoolPlan, StepLayout, build_step_layout
from atom_core.cache.token_layout import build_decode_layout
from atom_core.engine.cuda_graphs import DecodeGraphs
from atom_core.engine.running_batch import RunningBatch
from atom_core.engine.scheduler import ScheduledStep
from atom_core.ops.sampling import sample

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SamplingInputs:
    """Per-row parameters of ``ops.sample`` (CPU tensors, [B]); top_k / top_p / min_p are None
    when off in every row (the op then skips that filter)."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor | None  # int32
    top_p: torch.Tensor | None  # float32
    min_p: torch.Tensor | None  # float32
    seeds: torch.Tensor  # int64
    offsets: torch.Tensor  # int64, the row's output tokens so far (its draw index)


@dataclass(slots=True)
class StepInputs:
    """Everything the device needs for one step, on the host.

    ``input_ids`` int64 [T] and ``layout`` cover the padded batch when ``graph_size`` is set (a
    pure-decode step replayed in the CUDA graph of that many rows); ``num_rows`` = B real rows.
    """

    input_ids: np.ndarray
    layout: StepLayout
    sampling: SamplingInputs
    num_rows: int
    graph_size: int | None


@dataclass(slots=True)
class StepResult:
    """Sampled token per row (meaningful only for rows that completed their prompt) and logprobs."""

    token_ids: np.ndarray  # int64 [B]
    logprobs: np.ndarray | None  # float32 [B]


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
            # The graphs get the model, not the runner: a runner <-> graphs cycle would keep the KV
            # pool and the graph memory alive after the engine is dropped, until the next gc pass.
            self.graphs = DecodeGraphs(functools.partial(forward_logits, model), device=self.device,
                                       max_batch_size=max_num_seqs,
                                       max_pages=self.max_pages, max_seqlen_k=max_model_len)

    def execute(self, step: ScheduledStep, batch: RunningBatch, want_logprobs: bool) -> StepResult:
        return self.run(self.prepare(step, batch), want_logprobs)

    # ------------------------------------------------------------------ host

    def prepare(self, step: ScheduledStep, batch: RunningBatch) -> StepInputs:
        """Input ids, layout and sampling parameters of the scheduled rows (CPU)."""
        rows, num_rows = step.rows, len(step)
        cached = batch.num_computed_tokens[rows]
        # The rows' pages; the width is the longest table (what ragged tables would give).
        tables = batch.block_table[rows, :int(batch.num_pages[rows].max())]
        graph_size = None
        if step.num_tokens == num_rows:  # every row computes one token: decode (or 1-token prompts)
            if self.graphs is not None and self.graphs.fits(num_rows):
                graph_size = self.graphs.size_for(num_rows)
            layout = build_decode_layout(cached, tables, self.block_size, pad_rows_to=graph_size)
            input_ids = batch.token_ids[step.slots, cached].astype(np.int64)
            if graph_size is not None:  # one id-0 token per padding row
                input_ids = np.concatenate([input_ids, np.zeros(graph_size - num_rows, dtype=np.int64)])
        else:
            layout = build_step_layout(step.query_lens, cached, tables, self.block_size)
            token_slots = np.repeat(step.slots, step.query_lens)
            input_ids = batch.token_ids[token_slots, layout.positions.numpy()].astype(np.int64)
        return StepInputs(input_ids, layout, self.sampling_inputs(step, batch), num_rows, graph_size)

    @staticmethod
    def sampling_inputs(step: ScheduledStep, batch: RunningBatch) -> SamplingInputs:
        """The rows' sampling parameters. For a dense step they are views of the batch's arrays
        (valid until the batch changes)."""
        rows = step.rows

        def filter_param(array, num_using):  # None = off in every row: the op skips the filter
            return torch.from_numpy(array[rows]) if num_using else None

        return SamplingInputs(
            temperature=torch.from_numpy(batch.temperature[rows]),
            top_k=filter_param(batch.top_k, batch.num_using_top_k),
            top_p=filter_param(batch.top_p, batch.num_using_top_p),
            min_p=filter_param(batch.min_p, batch.num_using_min_p),
            seeds=torch.from_numpy(batch.seed[rows]),
            offsets=torch.from_numpy(batch.num_tokens[rows] - batch.num_prompt_tokens[rows]),
        )

    # ------------------------------------------------------------------ device

    @torch.inference_mode()
    def run(self, inputs: StepInputs, want_logprobs: bool) -> StepResult:
        """Run the model on ``inputs`` and sample one token per real row."""
        dev = self.device
        if inputs.graph_size is not None:
            logits = self.graphs.run(inputs.input_ids, inputs.layout)
        else:
            ids = torch.from_numpy(inputs.input_ids).to(dev, non_blocking=True)
            logits = forward_logits(self.model, ids, inputs.layout.to(dev, non_blocking=True))
        s = inputs.sampling

        def put(t):
            return None if t is None else t.to(dev, non_blocking=True)

        result = sample(logits[:inputs.num_rows], put(s.temperature), put(s.top_k), put(s.top_p), put(s.min_p),
                        put(s.seeds), put(s.offsets), return_logprobs=want_logprobs)
        if want_logprobs:
            tokens, logprobs = result
            return StepResult(tokens.cpu().numpy(), logprobs.cpu().numpy())
        return StepResult(result.cpu().numpy(), None)


def forward_logits(model, input_ids: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """One step's logits [rows, V]: the model over input_ids [T], the hidden states of each row's
    last token (``layout.logits_indices``) through the LM head."""
    hidden = model(input_ids, layout.positions, layout)
    return model.compute_logits(hidden[layout.logits_indices])
