"""``Engine``: requests in, tokens out, one ``step()`` at a time.

Each step: the scheduler picks rows under the token budget, the runner computes them and samples,
and the engine appends the tokens, publishes the blocks whose KV the step computed to the prefix
cache, and checks each request's stop conditions.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from atom_core.cache import BlockManager, budget_from_memory, plan_kv_pool
from atom_core.engine.outputs import RequestOutput, StepOutputs
from atom_core.engine.request import Request
from atom_core.engine.runner import ModelRunner
from atom_core.engine.sampling_params import SamplingParams
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo_model"
CPU_DEFAULT_POOL_SEQS = 16  # without num_kv_blocks, a CPU pool holds this many max_model_len requests


def step_activation_bytes(cfg, num_tokens: int, num_rows: int) -> int:
    """Headroom for one step's activations, in bytes (fp32 upper bound): hidden states and the
    widest MLP of ``num_tokens`` tokens, plus logits and sampling temporaries for ``num_rows`` rows.

    A dense MLP holds gate, up and their product (3 x intermediate_size per token). A MoE layer
    holds the same for each of its top-k experts plus each expert's down output before the
    weighted combine (K x (3 x moe_intermediate_size + hidden_size) per token), which for
    many-expert models (GLM-4.5, Qwen3-MoE) is the larger of the two.
    """
    mlp_width = 3 * cfg.intermediate_size
    top_k = cfg.get("num_experts_per_tok")
    if top_k:
        expert_size = cfg.get("moe_intermediate_size") or cfg.intermediate_size
        mlp_width = max(mlp_width, top_k * (3 * expert_size + cfg.hidden_size))
    return 4 * (num_tokens * (8 * cfg.hidden_size + mlp_width) + num_rows * cfg.vocab_size * 4)


class Engine:
    """Continuous-batching generation over a paged KV pool.

    Build with :meth:`from_pretrained` (a checkpoint folder) or directly from a model that follows
    the ``atom_core.models`` contract. Prompts are strings (needs a tokenizer) or token-id lists.
    """

    def __init__(self, model, tokenizer: Tokenizer | None = None, *, device=None, block_size: int = 16,
                 num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        config = model.config
        limit = config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        self.max_model_len = max_model_len or limit
        self.eos_token_ids = config.eos_token_id
        spec = model.kv_cache_spec()
        sizing = dict(block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
        if num_kv_blocks is None and self.device.type != "cuda":
            num_kv_blocks = CPU_DEFAULT_POOL_SEQS * -(-self.max_model_len // block_size)
        if num_kv_blocks is not None:
            plan = plan_kv_pool(spec, num_blocks=num_kv_blocks, **sizing)
        else:
            plan = plan_kv_pool(spec, budget_bytes=self._gpu_budget(gpu_memory_utilization, max_num_batched_tokens,
                                                                     max_num_seqs), **sizing)
        logger.info("KV pool: %d blocks of %d tokens (%.2f GiB)", plan.num_blocks, block_size, plan.kv_bytes / 2**30)
        self.block_manager = BlockManager(plan.num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len)
        self.runner = ModelRunner(model, plan, device=self.device, max_num_seqs=max_num_seqs,
                                  max_model_len=self.max_model_len, enforce_eager=enforce_eager)
        self._requests: dict[int, Request] = {}
        self._next_id = 0
        self._seed_source = random.Random()
        self.num_preemptions = 0  # requests sent back to recompute because the pool ran dry

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, dtype=None, device=None, load_format: str = "auto",
                        **engine_args) -> Engine:
        """Load a checkpoint folder (config.json, *.safetensors, tokenizer.json); None = the built-in demo model."""
        from atom_core.models import load_model

        path = Path(path) if path is not None else DEMO_MODEL
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = load_model(path, dtype=dtype, device=device, load_format=load_format)
        return cls(model, Tokenizer.maybe_from(path), device=device, **engine_args)

    def _gpu_budget(self, utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        activations = step_activation_bytes(self.model.config, max_num_batched_tokens, max_num_seqs)
        return budget_from_memory(total, total - free + activations, utilization)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a prompt; returns its request id. Raises ValueError when it can never fit."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self._encode(prompt)
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens + max_tokens={params.max_tokens} = {total} "
                             f"exceeds max_model_len={self.max_model_len}")
        # (The pool always holds one request of max_model_len: plan_kv_pool refuses smaller pools.)
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(62)
        request = Request(self._next_id, token_ids, params, seed)
        self._next_id += 1
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer (tokenizer.json in the model folder); "
                                 "pass token ids instead")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if not all(isinstance(t, int) for t in token_ids):
                raise TypeError("a prompt is a string or a list of int token ids")
        if not token_ids:
            raise ValueError("empty prompt: a prompt needs at least one token")
        return token_ids

    def abort(self, request_id: int) -> None:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None and not request.finished:
            self.scheduler.finish(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ stepping

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids) -> None:
        self._eos_token_ids = frozenset(token_ids)
        self._eos_array = np.array(sorted(self._eos_token_ids), dtype=np.int64)

    def step(self) -> StepOutputs:
        """Run one step; returns an output for every request that got a new token this step."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not run any request: the pool is too small for the "
                                   "waiting requests")
            return StepOutputs([], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), {})
        self.num_preemptions += len(scheduled.preempted)
        batch = self.scheduler.batch
        want_logprobs = bool(batch.num_wanting_logprobs and batch.wants_logprobs[scheduled.rows].any())
        result = self.runner.execute(scheduled, batch, want_logprobs)
        produced = self.scheduler.update(scheduled, result.token_ids)
        return self._check_stops(scheduled, produced, result)

    def _check_stops(self, scheduled, produced: np.ndarray, result) -> StepOutputs:
        """Finish the rows whose new token ends them; the step's outputs.

        EOS and length are checked for all rows at once; only rows that may stop, and rows with
        stop strings, stop token ids or logprobs, are looked at in Python.
        """
        batch = self.scheduler.batch
        if len(produced) == len(scheduled):  # every row got a token (always so in a decode step)
            rows, requests, tokens = scheduled.rows, scheduled.requests, result.token_ids
        else:
            rows = scheduled.slots[produced]
            requests = [scheduled.requests[i] for i in produced.tolist()]
            tokens = result.token_ids[produced]
        num_tokens = batch.num_tokens[rows].copy()  # a snapshot for the outputs
        maybe_done = num_tokens >= batch.check_from_len[rows]
        if batch.num_stopping_at_eos:
            eos = self._eos_array
            is_eos = tokens == eos[0] if len(eos) == 1 else (tokens[:, None] == eos).any(axis=1)
            maybe_done |= is_eos & batch.stops_at_eos[rows]

        finish_reasons = {}
        for i in maybe_done.nonzero()[0].tolist():
            request = requests[i]
            if request.logprobs is not None:
                request.logprobs.append(float(result.logprobs[produced[i]]))
            reason = self._stop_reason(request, int(tokens[i]))
            if reason is not None:
                self.scheduler.finish(request, reason)
                del self._requests[request.request_id]
                finish_reasons[i] = reason
        return StepOutputs(requests, tokens, num_tokens, finish_reasons)

    def _stop_reason(self, request: Request, token: int) -> str | None:
        """Why the request stops after ``token`` (setting its final text), or None."""
        params = request.params
        text = None
        if params.stop_strings and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
            hits = [i for i in (text.find(s) for s in params.stop_strings) if i >= 0]
            if hits:
                request.text = text[: min(hits)]  # the stop string is not part of the text
                return "stop"
        if (not params.ignore_eos and token in self._eos_token_ids) or token in (params.stop_token_ids or ()):
            reason = "stop"
        elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            reason = "length"
        else:
            return None
        if self.tokenizer is not None:
            request.text = text if text is not None else self.tokenizer.decode(request.output_token_ids)
        return reason

    # ------------------------------------------------------------------ offline

    def generate(self, prompts: Iterable[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order (generated part only)."""
        prompts = list(prompts)
        if isinstance(prompts and prompts[0], int):
            prompts = [prompts]  # one token-id prompt
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        order = {rid: i for i, rid in enumerate(ids)}
        finished: dict[int, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests():
                for out in self.step().finished():
                    if out.request_id in order:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[rid] for rid in sorted(finished, key=order.__getitem__)]
