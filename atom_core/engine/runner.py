"""The model runner: a scheduled step in, sampled tokens out.

It owns the KV pool, its binding into the model, and the CUDA graphs. ``launch`` is one step:
the host builds the token layout from the scheduled step (``build_decode_layout`` when every row
computes one token, else ``build_step_layout``), the device runs the model (a captured graph of
the step's padded shape, or eagerly) and ``atom_core.ops.sample``, and the sampled tokens start
their copy to the host. ``collect`` waits for that copy. Between the two the host is free: the
engine schedules and launches the next step there, feeding it this step's tokens straight from
the device (``ScheduledStep.pending_*``).

Legend: B = rows, T = tokens this step, V = vocabulary.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from atom_core.cache import KVCacheSpec, PoolPlan, StepLayout, build_step_layout
from atom_core.cache.token_layout import build_decode_layout
from atom_core.engine.cuda_graphs import StepGraphs, padded_input_ids
from atom_core.engine.step import ScheduledStep
from atom_core.ops.sampling import sample

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose device work is queued: its sampled tokens (and log-probs) reach the host
    buffers once ``ready`` (a CUDA event; None on the CPU, where they are already there)."""

    step: ScheduledStep
    token_ids: torch.Tensor  # int64 [B], host
    logprobs: torch.Tensor | None  # float32 [B], host
    ready: torch.cuda.Event | None


class ModelRunner:
    """Runs scheduled steps of ``model`` over a KV pool of ``plan``'s shape on ``device``."""

    def __init__(self, model, spec: KVCacheSpec, plan: PoolPlan, *, device, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, enforce_eager: bool = False,
                 extra_specs: dict[str, KVCacheSpec] | None = None):
        self.model = model
        self.device = torch.device(device)
        self.plan = plan
        self.max_pages = -(-max_model_len // plan.block_size)
        # One allocation for the whole pool: [layers, 2 (K, V), num_blocks, block_size, Hk, D], or for
        # MLA [layers, 1 (the latent row), num_blocks, block_size, ...]; each layer gets its tensors.
        self.kv_pool = torch.zeros((spec.num_layers, spec.num_kv_tensors_per_layer, *plan.kv_shape), dtype=spec.dtype,
                                   device=self.device)
        self._kv_caches = [tuple(self.kv_pool[i].unbind(0)) for i in range(spec.num_layers)]
        # Extra per-token caches over the same blocks (``model.extra_kv_cache_specs()``, e.g. DSA's indexer keys).
        self.extra_pools = {name: torch.zeros((extra.num_layers, *extra.kv_shape(plan.num_blocks, plan.block_size)),
                                              dtype=extra.dtype, device=self.device)
                            for name, extra in (extra_specs or {}).items()}
        self._extra_caches = {name: list(pool.unbind(0)) for name, pool in self.extra_pools.items()}
        if spec.dtype.itemsize == 1:  # an FP8 pool: each layer's scales, the checkpoint's or 1.0
            self._kv_caches = [(*caches, *self._scales(scales)) for caches, scales
                               in zip(self._kv_caches, model.kv_cache_scales())]
        self.bind()
        self._last_sampled: torch.Tensor | None = None  # the previous launch's tokens, on the device
        self.graphs = None
        if self.device.type == "cuda" and not enforce_eager:
            # The graphs get the model, not the runner: a runner <-> graphs cycle would keep the KV
            # pool and the graph memory alive after the engine is dropped, until the next gc pass.
            self.graphs = StepGraphs(functools.partial(forward_logits, model), device=self.device,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_pages=self.max_pages, max_model_len=max_model_len)

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

    # ------------------------------------------------------------------ one step

    def prepare(self, step: ScheduledStep, bucket=None) -> tuple[np.ndarray, StepLayout]:
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

    @torch.inference_mode()
    def launch(self, step: ScheduledStep) -> LaunchedStep:
        """Queue the step's device work; returns at once on a GPU (see ``collect``)."""
        dev = self.device
        bucket = None
        if self.graphs is not None:
            bucket = self.graphs.bucket_for(step.num_tokens, len(step), step.is_decode)
        input_ids, layout = self.prepare(step, bucket)
        pending = None
        if step.pending_positions is not None:
            if self._last_sampled is None:
                raise RuntimeError("a step reads tokens of a previous step that was never launched")
            where = torch.from_numpy(np.stack([step.pending_positions, step.pending_sources])).to(dev, non_blocking=True)
            pending = (where[0], self._last_sampled[where[1]])
        if bucket is not None:
            logits = self.graphs.run(bucket, torch.from_numpy(input_ids), layout, pending)
        else:
            ids = torch.from_numpy(input_ids).to(dev, non_blocking=True)
            if pending is not None:
                ids.index_copy_(0, *pending)
            logits = forward_logits(self.model, ids, layout.to(dev, non_blocking=True))
        s = step.sampling

        def put(array):
            return None if array is None else torch.from_numpy(array).to(dev, non_blocking=True)

        result = sample(logits[:len(step)], put(s.temperature), put(s.top_k), put(s.top_p), put(s.min_p),
                        put(s.seeds), put(s.offsets), return_logprobs=step.want_logprobs)
        tokens, logprobs = result if step.want_logprobs else (result, None)
        self._last_sampled = tokens
        if dev.type != "cuda":
            return LaunchedStep(step, tokens, logprobs, None)
        ready = torch.cuda.Event()
        host_tokens = tokens.to("cpu", non_blocking=True)
        host_logprobs = None if logprobs is None else logprobs.to("cpu", non_blocking=True)
        ready.record()
        return LaunchedStep(step, host_tokens, host_logprobs, ready)

    @staticmethod
    def collect(launched: LaunchedStep) -> tuple[np.ndarray, np.ndarray | None]:
        """Wait for a launched step's sampled tokens: (token ids int64 [B], log-probs float32 [B] or None)."""
        if launched.ready is not None:
            launched.ready.synchronize()
        logprobs = None if launched.logprobs is None else launched.logprobs.numpy()
        return launched.token_ids.numpy(), logprobs


def forward_logits(model, input_ids: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """One step's logits [rows, V]: the model over input_ids [T], the hidden states of each row's
    last token (``layout.logits_indices``) through the LM head."""
    hidden = model(input_ids, layout.positions, layout)
    return model.compute_logits(hidden[layout.logits_indices])
