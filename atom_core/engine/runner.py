"""The model runner: a scheduled step in, sampled tokens out.

It owns the KV pool, its binding into the model, the CUDA graphs and the token state of the
penalties. ``launch`` is one step: the host builds the token layout from the scheduled step
(``build_decode_layout`` when every row computes one token, else ``build_step_layout``), the
device runs the model (a captured graph of the step's padded shape, or eagerly), the logits
processing when a row uses it (``logits_processing``: grammar masks, biases and bans, then the penalties, on the
device for the whole batch, outside the graph like sampling), and ``atom_core.ops.sample``; the
sampled tokens start their copy to the host. ``collect`` waits for that copy. Between the two the
host is free: the engine schedules and launches the next step there, feeding it this step's tokens
straight from the device (``ScheduledStep.pending_*``).

The token state (``token_state [max_num_seqs, V]`` int32, allocated when a first request uses a
penalty or an allow-list) is kept on the device in launch order: a slot is set before the step that
first reads it, and each step counts its sampled tokens into it right after sampling, so the next
step, launched before this one's tokens reach the host, already sees them.

Log-probs (the chosen token's, the top-N alternatives ``num_top_logprobs``, and prompt log-probs) are
what ``logprobs_mode`` names (``engine/logprobs.py``): by default those of the raw logits, fused into the
draw when nothing processes the logits and no top-N is asked; the processed modes recompute the scores
the draw used, eagerly after it (outside any CUDA graph, as the logits processing and the draw are).
Each chosen (or prompt) token's rank comes with its log-prob, from the same scores (``token_ranks``),
and goes to the host in the same copy.
Prompt log-probs need every prompt position's hidden state: such a step runs eagerly.

Several ranks (``channel``, a ``distributed.StepChannel``): the forward part of ``launch`` is
``_forward(StepInputs)``, which every rank runs; rank 0 sends each step's ``StepInputs`` to the
workers before its own forward and broadcasts the sampled tokens after sampling, and a worker runs
``run_worker_step`` on what it received (``engine/distributed.py``, ``engine/workers.py``).

Legend: B = rows, T = tokens this step, V = vocabulary, N = top alternatives, M = prompt positions.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import numpy as np
import torch

from atom_core.cache import KVCacheSpec, PoolPlan, StepLayout, build_step_layout
from atom_core.cache.token_layout import build_decode_layout
from atom_core.engine.cuda_graphs import StepGraphs, padded_input_ids
from atom_core.engine.distributed import STEP, StepChannel, StepInputs
from atom_core.engine.logits_processing import LogitsProcessing
from atom_core.engine.logprobs import (
    PROCESSED_MODES,
    check_logprobs_mode,
    processed_scores,
    token_logprobs,
    token_ranks,
)
from atom_core.engine.step import PromptLogprobsInputs, ScheduledStep
from atom_core.ops.penalties import apply_penalties_, apply_token_bias_, count_tokens_, init_token_state_
from atom_core.ops.sampling import sample
from atom_core.ops.token_mask import apply_token_mask_

logger = logging.getLogger(__name__)
PROMPT_LOGPROBS_CHUNK = 1024  # prompt positions per [chunk, V] logits tensor (V = 152k: 0.6 GB of fp32)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose device work is queued: its sampled tokens (and log-probs) reach the host
    buffers once ``ready`` (a CUDA event; None on the CPU, where they are already there)."""

    step: ScheduledStep
    token_ids: torch.Tensor  # int64 [B], host
    logprobs: torch.Tensor | None  # float32 [B], host
    ready: torch.cuda.Event | None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids int64 [B, N], log-probs f32 [B, N]), host
    # (log-probs [M], ranks int64 [M], top ids [M, N] or None, top [M, N] or None), host
    prompt_logprobs: tuple[torch.Tensor, ...] | None = None
    wait: Callable[[torch.cuda.Event], None] | None = None  # waits for ``ready`` (bounded, with several ranks)
    logprob_ranks: torch.Tensor | None = None  # int64 [B], host: each chosen token's rank (with ``logprobs``)


class StepResult(NamedTuple):
    """What ``collect`` returns (numpy): token ids int64 [B]; log-probs float32 [B] or None;
    top_logprobs (ids [B, N], log-probs [B, N]) or None; prompt_logprobs: per request of the
    step's ``prompt_logprobs``, (log-probs [m], ranks int64 [m], top ids [m, N] or None, top log-probs
    or None); logprob_ranks: int64 [B], each chosen token's rank, whenever there are log-probs."""

    tokens: np.ndarray
    logprobs: np.ndarray | None
    top_logprobs: tuple[np.ndarray, np.ndarray] | None
    prompt_logprobs: list | None
    logprob_ranks: np.ndarray | None = None


class ModelRunner:
    """Runs scheduled steps of ``model`` over a KV pool of ``plan``'s shape on ``device``."""

    def __init__(self, model, spec: KVCacheSpec, plan: PoolPlan, *, device, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, enforce_eager: bool = False,
                 extra_specs: dict[str, KVCacheSpec] | None = None, channel: StepChannel | None = None,
                 logprobs_mode: str = "raw_logprobs"):
        self.model = model
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)  # what log-probs are (only rank 0 samples)
        self.channel = channel  # several ranks: rank 0's or a worker's link to the others (None: one rank)
        self.device = torch.device(device)
        self.plan = plan
        self.max_pages = -(-max_model_len // plan.block_size)
        self.spec = spec
        self.extra_specs = dict(extra_specs or {})
        # An FP8 pool: each layer's scales, the checkpoint's or 1.0 (kept across reallocations of the pool).
        self._kv_scales = ([self._scales(scales) for scales in model.kv_cache_scales()] if spec.dtype.itemsize == 1
                           else None)
        self._allocate(plan.num_blocks)
        self.bind()
        self._last_sampled: torch.Tensor | None = None  # the previous launch's tokens, on the device
        self.num_forwards = 0  # model forwards begun (a lock-stepped DP rank checks a step ran one)
        self.max_num_seqs = max_num_seqs
        self.token_state: torch.Tensor | None = None  # int32 [max_num_seqs, V], made on first use
        self.graphs = None
        if self.device.type == "cuda" and not enforce_eager:
            # The graphs get the model, not the runner: a runner <-> graphs cycle would keep the KV
            # pool and the graph memory alive after the engine is dropped, until the next gc pass.
            self.graphs = StepGraphs(functools.partial(forward_logits, model), device=self.device,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len, block_size=plan.block_size)
            if channel is not None:
                channel.graphs = self.graphs  # released before the ranks' communicator is torn down

    def _allocate(self, num_blocks: int) -> None:
        """A zeroed pool of ``num_blocks`` blocks and the per-layer views the model is bound to (not bound here).

        One allocation for the whole pool: [layers, 2 (K, V), num_blocks, block_size, Hk, D], or for MLA
        [layers, 1 (the latent row), num_blocks, block_size, ...]; each layer gets its tensors. Extra
        per-token caches (``model.extra_kv_cache_specs()``, e.g. DSA's indexer keys) cover the same blocks."""
        spec, block_size = self.spec, self.plan.block_size
        self.kv_pool = torch.zeros((spec.num_layers, spec.num_kv_tensors_per_layer,
                                    *spec.kv_shape(num_blocks, block_size)), dtype=spec.dtype, device=self.device)
        self._kv_caches = [tuple(self.kv_pool[i].unbind(0)) for i in range(spec.num_layers)]
        if self._kv_scales is not None:
            self._kv_caches = [(*caches, *scales) for caches, scales in zip(self._kv_caches, self._kv_scales)]
        self.extra_pools = {name: torch.zeros((extra.num_layers, *extra.kv_shape(num_blocks, block_size)),
                                              dtype=extra.dtype, device=self.device)
                            for name, extra in self.extra_specs.items()}
        self._extra_caches = {name: list(pool.unbind(0)) for name, pool in self.extra_pools.items()}

    def _scales(self, checkpoint_scales) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.ones(1, dtype=torch.float32, device=self.device) if scale is None
                     else scale.detach().to(self.device, torch.float32).reshape(1) for scale in checkpoint_scales)

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    # ------------------------------------------------------------------ the model's KV binding

    @property
    def is_bound(self) -> bool:
        """Whether the model's attention layers write into this runner's pool."""
        return self.model.bound_kv_caches is self._kv_caches

    def bind(self) -> None:
        """Bind this runner's pool (and extra caches) into the model (a model serves one pool at a time)."""
        self.model.bind_kv_cache(self._kv_caches)
        if self.extra_pools:
            self.model.bind_extra_kv_caches(self._extra_caches)

    # ------------------------------------------------------------------ sleep mode

    @property
    def has_pool(self) -> bool:
        """Whether the pool holds the plan's blocks (False between ``release_pool`` and ``allocate_pool``)."""
        return self.kv_pool.shape[2] == self.plan.num_blocks

    def release_pool(self) -> None:
        """Free the KV pool, the extra caches and the token state (sleep mode; no step may be in flight).

        The model is bound to an empty pool of the same layout (0 blocks, no memory), so that no attention
        layer keeps the freed memory alive; nothing may step until ``allocate_pool``."""
        self._allocate(0)
        self.bind()
        self.token_state = None  # made again on first use; every request sets its own slot before reading it
        self._last_sampled = None

    def allocate_pool(self) -> None:
        """A zeroed pool of the plan's blocks (the same shape as before ``release_pool``), bound to the model."""
        self._allocate(self.plan.num_blocks)
        self.bind()

    def drop_graphs(self) -> int:
        """Destroy the captured CUDA graphs and their memory pool (they hold the pool's and the weights'
        addresses); returns how many there were. ``warm_forward`` (or the next step) captures them again."""
        if self.graphs is None:
            return 0
        num_captured = self.graphs.num_captured
        self.graphs.release()
        return num_captured

    # ------------------------------------------------------------------ one step

    def prepare(self, step: ScheduledStep | StepInputs, bucket=None) -> tuple[np.ndarray, StepLayout]:
        """Host side: the input ids and the token layout, padded to ``bucket``'s shape when given."""
        num_rows = len(step)
        if step.is_decode:
            pad_rows = bucket.num_rows if bucket is not None else None
            layout = build_decode_layout(step.cached_lens, step.block_tables, self.block_size, pad_rows_to=pad_rows)
        elif bucket is not None:
            layout = build_step_layout(step.query_lens, step.cached_lens, step.block_tables, self.block_size,
                                       pad_rows_to=bucket.num_rows, pad_tokens_to=bucket.num_tokens)
        else:
            layout = build_step_layout(step.query_lens, step.cached_lens, step.block_tables, self.block_size)
        input_ids = step.input_ids
        if bucket is not None:
            input_ids = padded_input_ids(input_ids, bucket.num_tokens)
        assert layout.num_rows >= num_rows
        return input_ids, layout

    def step_inputs(self, step: ScheduledStep) -> StepInputs:
        """What every rank needs for the step's forward, with the graph it replays (None: eagerly)."""
        bucket = None
        if self.graphs is not None and step.prompt_logprobs is None:  # prompt log-probs need every hidden state
            bucket = self.graphs.bucket_for(step.num_tokens, len(step), step.is_decode)
        return StepInputs(step.input_ids, step.query_lens, step.cached_lens, step.block_tables,
                          step.pending_positions, step.pending_sources,
                          None if step.prompt_logprobs is None else step.prompt_logprobs.token_indices, bucket)

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits [>= B, V] (its graph's, or eagerly) and, for prompt log-probs, every hidden
        state [T, E] (else None). Every rank runs exactly this."""
        dev, bucket = self.device, inputs.bucket
        self.num_forwards += 1
        input_ids, layout = self.prepare(inputs, bucket)
        pending = None
        if inputs.pending_positions is not None:
            if self._last_sampled is None:
                raise RuntimeError("a step reads tokens of a previous step that was never launched")
            where = torch.from_numpy(np.stack([inputs.pending_positions, inputs.pending_sources])).to(
                dev, non_blocking=True)
            pending = (where[0], self._last_sampled[where[1]])
        if bucket is not None:
            return self.graphs.run(bucket, torch.from_numpy(input_ids), layout, pending), None
        ids = torch.from_numpy(input_ids).to(dev, non_blocking=True)
        if pending is not None:
            ids.index_copy_(0, *pending)
        layout = layout.to(dev, non_blocking=True)
        if inputs.prompt_logprob_indices is None:
            return forward_logits(self.model, ids, layout), None
        hidden = self.model(ids, layout.positions, layout)
        return self.model.compute_logits(hidden[layout.logits_indices]), hidden

    @torch.inference_mode()
    def launch(self, step: ScheduledStep) -> LaunchedStep:
        """Queue the step's device work; returns at once on a GPU (see ``collect``)."""
        inputs = self.step_inputs(step)
        if self.channel is None:
            return self._launch(step, inputs)
        self.channel.send(STEP, inputs)
        try:
            return self._launch(step, inputs)
        except BaseException as error:
            raise self.channel.fail(error) from error

    def _launch(self, step: ScheduledStep, inputs: StepInputs) -> LaunchedStep:
        dev = self.device
        previous_sampled = self._last_sampled
        logits, hidden = self._forward(inputs)
        prompt_logprobs = None if hidden is None else self._prompt_logprobs(hidden, step.prompt_logprobs)
        s = step.sampling
        put = self._put
        mode = self.logprobs_mode
        from_processed = mode in PROCESSED_MODES
        raw = logits[:len(step)]
        processed = raw if s.processing is None else self._process(
            raw, s.processing, previous_sampled, keep_raw=step.want_logprobs and not from_processed)
        # Log-probs of the raw logits: fused into the draw when the draw sees the raw logits and no top-N is asked.
        fused_logprobs = (step.want_logprobs and mode == "raw_logprobs" and processed is raw
                          and not step.num_top_logprobs)
        filters = put(s.temperature), put(s.top_k), put(s.top_p), put(s.min_p)
        result = sample(processed, *filters, put(s.seeds), put(s.offsets), return_logprobs=fused_logprobs)
        tokens, logprobs = result if fused_logprobs else (result, None)
        if self.channel is not None:  # every rank gathers the next step's pending tokens from these
            self.channel.broadcast_tensor(tokens)
        top_logprobs = ranks = None
        if fused_logprobs:  # the draw's log-probs are of the raw logits: so are the ranks
            ranks = token_ranks(raw, tokens)
        elif step.want_logprobs:
            # The chosen token's value, its rank and its top N from the same scores (vLLM's rule).
            scores = processed_scores(processed, *filters) if from_processed else raw
            logprobs, ranks, top_logprobs = token_logprobs(scores, tokens, step.num_top_logprobs,
                                                           as_logits=mode.endswith("_logits"))
        if s.processing is not None and s.processing.slots is not None:
            self._count_sampled(step, s.processing.slots, tokens)
        self._last_sampled = tokens
        if dev.type != "cuda":
            return LaunchedStep(step, tokens, logprobs, None, top_logprobs, prompt_logprobs, logprob_ranks=ranks)

        def to_host(t):
            return None if t is None else t.to("cpu", non_blocking=True)

        ready = torch.cuda.Event()
        host_tokens, host_logprobs, host_ranks = to_host(tokens), to_host(logprobs), to_host(ranks)
        host_top = None if top_logprobs is None else tuple(map(to_host, top_logprobs))
        host_prompt = None if prompt_logprobs is None else tuple(map(to_host, prompt_logprobs))
        ready.record()
        wait = None if self.channel is None else self.channel.wait_event
        return LaunchedStep(step, host_tokens, host_logprobs, ready, host_top, host_prompt, wait, host_ranks)

    @torch.inference_mode()
    def run_worker_step(self, inputs: StepInputs) -> None:
        """A worker rank's share of a step: the same forward as rank 0 (and the same LM-head gathers for
        prompt log-probs), then rank 0's sampled tokens, kept for the next step's pending tokens."""
        _, hidden = self._forward(inputs)
        if hidden is not None:
            for _ in self._prompt_logits(hidden, self._put(inputs.prompt_logprob_indices)):
                pass
        self._last_sampled = self.channel.receive_tokens(len(inputs))

    @torch.inference_mode()
    def warm_forward(self, progress: Callable | None = None) -> None:
        """Run the model on every shape the engine launches, without touching the KV pool: capture every
        CUDA graph, or (eagerly) one mixed step and decode steps of a few row counts. Every rank of a
        multi-rank engine runs it at the same time (the forward's collectives)."""
        if self.graphs is not None:
            self.graphs.capture_all(progress=progress)
            return
        for rows, tokens_per_row in ((2, 17), (1, 1), (3, 1), (16, 1)):
            self._forward_nothing(rows, tokens_per_row)

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """A forward of one padding token that reads and writes no KV slot and samples nothing: what a rank
        with no sequences runs so that the collectives of its peers' forward (DP attention's expert
        exchange) find it."""
        self._forward_nothing(1, 1)

    def _forward_nothing(self, rows: int, tokens_per_row: int) -> None:
        self.num_forwards += 1
        pages = [[0] * -(-tokens_per_row // self.block_size)] * rows  # shapes only: nothing is written or read
        layout = build_step_layout([tokens_per_row] * rows, [0] * rows, pages, self.block_size)
        layout = replace(layout, slot_mapping=torch.full_like(layout.slot_mapping, -1),
                         context_lens=torch.zeros_like(layout.context_lens)).to(self.device)
        ids = torch.zeros(layout.num_tokens, dtype=torch.int64, device=self.device)
        forward_logits(self.model, ids, layout)

    def _put(self, array: np.ndarray | None) -> torch.Tensor | None:
        return None if array is None else torch.from_numpy(array).to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ logits processing

    def _process(self, logits: torch.Tensor, processing: LogitsProcessing, previous_sampled: torch.Tensor | None,
                 keep_raw: bool) -> torch.Tensor:
        """The step's logits [B, V] after its grammar masks, biases, bans and penalties (fp32; a copy
        when the raw logits are still needed for log-probs)."""
        put = self._put
        x = logits.float()
        if keep_raw and x.data_ptr() == logits.data_ptr():
            x = x.clone()
        if processing.mask_rows is not None:  # structured output first (vLLM's order)
            apply_token_mask_(x, put(processing.token_bitmask), put(processing.mask_rows))
        if processing.slot_inits or processing.slots is not None:
            state = self._token_state(logits.shape[1])
            for init in processing.slot_inits:
                init_token_state_(state, init.slot, put(init.prompt_token_ids), put(init.output_token_ids),
                                  put(init.allowed_token_ids))
        if processing.bias_rows is not None:
            values = put(processing.bias_values)
            if processing.bias_sources is not None:  # bans that hold only if the previous step sampled `required`
                sources, required = put(processing.bias_sources), put(processing.bias_required)
                applies = (sources < 0) | (previous_sampled[sources.clamp(min=0)] == required)
                values = torch.where(applies, values, torch.zeros_like(values))
            apply_token_bias_(x, put(processing.bias_rows), put(processing.bias_token_ids), values)
        if processing.slots is not None:
            apply_penalties_(x, state, put(processing.slots), put(processing.presence_penalty),
                             put(processing.frequency_penalty), put(processing.repetition_penalty))
        return x

    def _token_state(self, vocab_size: int) -> torch.Tensor:
        if self.token_state is None:
            self.token_state = torch.zeros((self.max_num_seqs, vocab_size), dtype=torch.int32, device=self.device)
        return self.token_state

    def _count_sampled(self, step: ScheduledStep, slots: np.ndarray, tokens: torch.Tensor) -> None:
        """Count each produced row's sampled token into its slot (rows mid-prompt sample nothing real)."""
        produces = step.produces
        rows = produces[slots[produces] >= 0]
        if len(rows):
            where = self._put(rows)
            count_tokens_(self.token_state, self._put(slots[rows]), tokens[where])

    def _prompt_logits(self, hidden: torch.Tensor, indices: torch.Tensor):
        """(chunk, logits [chunk, V]) of the hidden states at ``indices``, PROMPT_LOGPROBS_CHUNK at a time
        (each an LM-head call: with several ranks a gather every rank makes)."""
        for start in range(0, len(indices), PROMPT_LOGPROBS_CHUNK):
            chunk = slice(start, start + PROMPT_LOGPROBS_CHUNK)
            yield chunk, self.model.compute_logits(hidden[indices[chunk]])

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: PromptLogprobsInputs) -> tuple:
        """(log-probs [M], ranks int64 [M], top ids [M, N] or None, top log-probs [M, N] or None) of the
        prompt positions, from the raw logits (their log_softmax, or in a ``*_logits`` mode the logits: no
        sampling processing applies to a prompt position), PROMPT_LOGPROBS_CHUNK positions at a time."""
        indices, targets = self._put(inputs.token_indices), self._put(inputs.target_ids)
        as_logits = self.logprobs_mode.endswith("_logits")
        values, ranks, top_ids, top_values = [], [], [], []
        for chunk, logits in self._prompt_logits(hidden, indices):
            chosen, chosen_ranks, top = token_logprobs(logits, targets[chunk], inputs.num_top, as_logits=as_logits)
            values.append(chosen)
            ranks.append(chosen_ranks)
            if top is not None:
                top_ids.append(top[0])
                top_values.append(top[1])
        if not inputs.num_top:
            return torch.cat(values), torch.cat(ranks), None, None
        return torch.cat(values), torch.cat(ranks), torch.cat(top_ids), torch.cat(top_values)

    @staticmethod
    def collect(launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's results (see ``StepResult``)."""
        if launched.wait is not None:
            launched.wait(launched.ready)
        elif launched.ready is not None:
            launched.ready.synchronize()
        logprobs = None if launched.logprobs is None else launched.logprobs.numpy()
        ranks = None if launched.logprob_ranks is None else launched.logprob_ranks.numpy()
        top = None if launched.top_logprobs is None else tuple(t.numpy() for t in launched.top_logprobs)
        prompt = None
        if launched.prompt_logprobs is not None:
            arrays = [None if t is None else t.numpy() for t in launched.prompt_logprobs]
            bounds = np.cumsum([0] + launched.step.prompt_logprobs.counts)
            prompt = [tuple(None if x is None else x[a:b] for x in arrays) for a, b in zip(bounds[:-1], bounds[1:])]
        return StepResult(launched.token_ids.numpy(), logprobs, top, prompt, ranks)


def forward_logits(model, input_ids: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """One step's logits [rows, V]: the model over input_ids [T], the hidden states of each row's
    last token (``layout.logits_indices``) through the LM head."""
    hidden = model(input_ids, layout.positions, layout)
    return model.compute_logits(hidden[layout.logits_indices])
