"""``Engine.warmup``, mixed into ``Engine``: compile every kernel variant the engine launches and capture its CUDA
graphs before the first request, so that the user's first timed work runs at steady speed.

What it uses of the engine: ``device``, ``runner``, ``model``, ``scheduler``, ``_channel`` (None with one rank;
else the worker ranks warm up with this one) and ``_check_awake``.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm.auto import tqdm

from atom_core.engine.distributed import WARMUP
from atom_core.ops.penalties import apply_penalties_, apply_token_bias_
from atom_core.ops.sampling import sample
from atom_core.ops.token_mask import apply_token_mask_

__all__ = ["Warmup"]

logger = logging.getLogger(__name__)


class Warmup:
    """The warm-up of an ``Engine`` (a mixin: the engine holds the state)."""

    def warmup(self) -> float:
        """Compile every kernel variant the engine launches and capture its CUDA graphs now, so that
        the first ``generate`` runs at steady speed; returns the seconds it took (also logged).

        On a GPU with graphs: every decode and mixed graph is captured (each capture runs the model
        on its shape first, which compiles its kernels), then ``ops.sample`` runs at every row
        count with and without filters and log-probs. Eagerly: one prefill and one decode step of
        each size class instead of the captures. Triton keeps compiled kernels in its on-disk
        cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), so a later process skips the
        compilation and pays only the captures. On the CPU there is nothing to compile.
        """
        self._check_awake("Engine.warmup")
        if self.device.type != "cuda":
            return 0.0
        if self._channel is not None:
            self._channel.check_usable()
        t0 = time.perf_counter()
        self.runner.bind()
        graphs = self.runner.graphs
        with torch.inference_mode():
            if self._channel is not None:  # every rank runs the same forwards (their collectives) and captures
                self._channel.send(WARMUP)
            try:
                if graphs is not None:
                    with tqdm(total=len(graphs.buckets()), desc="capturing CUDA graphs", leave=False) as bar:
                        self.runner.warm_forward(progress=lambda bucket: bar.update(1))
                else:
                    self.runner.warm_forward()
            except BaseException as error:
                if self._channel is None:
                    raise
                raise self._channel.fail(error) from error
            self._warm_sampling()
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        logger.info("engine warm-up: %.1f s (%d CUDA graphs)", seconds, graphs.num_captured if graphs else 0)
        return seconds

    def _warm_sampling(self) -> None:
        """``ops.sample`` at every row count, with and without filters and log-probs (its launch
        shape depends on the row count)."""
        dev, vocab = self.device, self.model.config.vocab_size
        logits = torch.randn(self.scheduler.max_num_seqs, vocab, device=dev)
        for rows in range(1, self.scheduler.max_num_seqs + 1):
            ones = torch.ones(rows, device=dev)
            seeds = torch.zeros(rows, dtype=torch.int64, device=dev)
            for filtered in (False, True):
                top_p = ones * 0.9 if filtered else None
                for logprobs in (False, True):
                    sample(logits[:rows], ones, None, top_p, None, seeds, seeds, return_logprobs=logprobs)
        # The logits processing ops (their launches depend on the vocabulary and the entry count only).
        state = torch.zeros(1, vocab, dtype=torch.int32, device=dev)
        zeros = torch.zeros(16, dtype=torch.int64, device=dev)
        apply_penalties_(logits[:1], state, zeros[:1], ones[:1] * 0, ones[:1] * 0, ones[:1])
        for entries in (1, 16):
            apply_token_bias_(logits[:1], zeros[:entries], zeros[:entries], torch.zeros(entries, device=dev))
        # Structured output's mask (its bitmask is ceil(V / 32) words a row): every bit set, nothing masked.
        apply_token_mask_(logits[:1], torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32, device=dev), zeros[:1])
