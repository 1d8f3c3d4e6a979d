"""``Engine``: requests in, tokens out, one ``step()`` at a time.

Each step: the scheduler picks rows under the token budget and hands the runner everything the
step needs; the runner computes them and samples; the scheduler then records the sampled tokens
and finishes the requests its stop rule stops. With async scheduling the next step is launched
before this one's tokens are read (see ``scheduler``).
"""

from __future__ import annotations

import logging
import random
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from atom_core.cache import BlockManager
from atom_core.engine.device import check_device
from atom_core.engine.distributed import StepChannel, WorkerFailedError, control_group_for
from atom_core.engine.generation_config import generation_config_of
from atom_core.engine.kv_pool import plan_pool
from atom_core.engine.logits_processing import request_processing
from atom_core.engine.logprobs import check_logprobs_mode
from atom_core.engine.offline import OfflineAPI
from atom_core.engine.outputs import StepOutputs
from atom_core.engine.request import Request, prompt_text_of, request_ids_of
from atom_core.engine.request_checks import RequestChecks
from atom_core.engine.runner import LaunchedStep, ModelRunner
from atom_core.engine.sampling_params import SEED_LIMIT, SamplingParams
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.sleep_mode import SleepMode
from atom_core.engine.stop_rule import StopRule
from atom_core.engine.tokenizer import Tokenizer
from atom_core.engine.warmup import Warmup
from atom_core.engine.weight_updates import WeightUpdates
from atom_core.engine.workers import DEFAULT_STEP_TIMEOUT, WorkerSet, run_worker, start_ranks, stop_ranks
from atom_core.ops.dispatch import preferred_backend

if TYPE_CHECKING:
    from atom_core.engine.data_parallel import DataParallelEngine
    from atom_core.engine.structured_output import CompiledStructuredOutput

logger = logging.getLogger(__name__)

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo_model"
CPU_MAX_MODEL_LEN = 4096  # on CPU, max_model_len defaults to no more than this (a CPU is slow past it anyway)


class Engine(OfflineAPI, WeightUpdates, SleepMode, Warmup):
    """Continuous-batching generation over a paged KV pool.

    Build with :meth:`from_pretrained` (a checkpoint folder) or directly from a model that follows
    the ``atom_core.models`` contract. Prompts are strings (needs a tokenizer) or token-id lists.

    ``gpu_memory_utilization`` (default 0.9): this engine's share of the GPU, for its weights, a step's
    activations and the KV pool (vLLM V1's rule: memory a trainer or another engine holds on the device is
    not counted against it, but the share must be free when the pool is planned, else ValueError with the
    numbers).

    ``async_scheduling`` (default on) schedules and launches step N+1 while the device runs step
    N, feeding it step N's tokens from the device; ``step()`` still returns each step's outputs in
    order, the first call included. A request that stops on EOS or a stop string costs one more
    row of computation, whose token is dropped. ``warmup`` (default on) compiles every kernel the
    engine launches and captures its CUDA graphs when it is built (see :meth:`warmup`).
    ``enforce_eager`` runs every step without CUDA graphs (for debugging). ``kv_cache_dtype``:
    "auto" (the model's dtype) or "fp8" (``float8_e4m3fn``: one byte per element, so the pool holds
    twice the tokens of a bf16 one; the cache holds ``k / k_scale`` with the checkpoint's per-layer
    scales, or 1.0). ``max_logprobs`` (default 20, vLLM's): the most top alternatives a request may
    ask for per token (``SamplingParams.logprobs`` / ``prompt_logprobs``); -1: no limit (the attribute then
    holds the vocabulary size). ``seed``: where the draws of
    requests without their own ``SamplingParams.seed`` come from: an int makes them repeat in every process
    that adds the same requests in the same order (vLLM's engine seed); None (default): fresh randomness.
    ``logprobs_mode`` (vLLM's): what ``logprobs`` / ``prompt_logprobs`` return — ``"raw_logprobs"``
    (default: ``log_softmax`` of the model's logits), ``"raw_logits"`` (the logits), ``"processed_logprobs"``
    (``log_softmax`` of the scores the token was drawn from: after the penalties, biases and bans, divided
    by the temperature, filtered tokens at -inf; HF's ``output_scores``) or ``"processed_logits"`` (those
    scores); prompt positions are never processed (``engine/logprobs.py``). ``enable_sleep_mode`` (vLLM's flag,
    default off): allow :meth:`sleep` / :meth:`wake_up`, which free and take back the engine's GPU memory
    (``engine/sleep_mode.py``).

    A model writes into one KV pool at a time: an engine binds its own pool into the model before
    each step when another engine on the same model has rebound it.

    **Several ranks.** ``from_pretrained(path, tensor_parallel_size=N, expert_parallel=...)`` starts
    (or, under ``torchrun``, joins) N ranks. This process is rank 0: it schedules, samples and serves
    the API; the others hold their shard and run each step's forward (``engine/workers.py``). An
    engine may also be built here from a model split over a TP group (``load_model(..., parallel=ctx)``,
    this process its TP rank 0) while the group's other ranks call ``run_worker(model)``; ``workers``
    is then None, or the ``WorkerSet`` of processes the caller started. ``step_timeout`` (seconds,
    several ranks only): the longest rank 0 waits for a worker within a step before raising
    ``WorkerFailedError``. ``shutdown()`` (or leaving a ``with`` block, or dropping the engine, or the
    interpreter's exit) stops the workers; a one-rank engine has nothing to stop.
    """

    def __init__(self, model, tokenizer: Tokenizer | None = None, *, device=None, block_size: int = 16,
                 num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, async_scheduling: bool = True,
                 warmup: bool = True, kv_cache_dtype: str | torch.dtype = "auto", max_logprobs: int = 20,
                 step_timeout: float = DEFAULT_STEP_TIMEOUT, seed: int | None = None,
                 logprobs_mode: str = "raw_logprobs", workers: WorkerSet | None = None,
                 enable_sleep_mode: bool = False):
        check_logprobs_mode(logprobs_mode)  # refused before any rank or pool is set up
        self._weight_group = None  # this rank's member of a trainer's weight-update group, while one is open
        self.enable_sleep_mode = bool(enable_sleep_mode)
        self._sleep = None  # sleep_mode.SleepState while asleep
        self.model = model
        self.tokenizer = tokenizer
        self.device = check_device(device) if device is not None else next(model.parameters()).device
        config = model.config
        limit = config.max_position_embeddings
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or max_model_len < 1):
            raise ValueError(f"max_model_len must be None (the model's max_position_embeddings) or an int >= 1, "
                             f"got {max_model_len!r}")
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        if max_model_len is None and self.device.type == "cpu" and limit > CPU_MAX_MODEL_LEN:
            max_model_len = CPU_MAX_MODEL_LEN
            logger.warning("max_model_len set to %d on CPU (the model allows %d); pass max_model_len= to change it",
                           max_model_len, limit)
        self.max_model_len = max_model_len or limit
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or an int >= 0, got {max_logprobs!r}")
        if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
                or not 0.0 < gpu_memory_utilization <= 1.0:  # (read on a GPU only; refused everywhere, as vLLM)
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {gpu_memory_utilization!r}")
        if max_logprobs == -1:  # vLLM's "no cap": the whole vocabulary
            max_logprobs = config.vocab_size
        pool_args = dict(block_size=block_size, num_kv_blocks=num_kv_blocks,
                         gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                         kv_cache_dtype=kv_cache_dtype)
        if self.device.type == "cuda" and not enforce_eager and preferred_backend() == "torch":
            # The reference ops read values on the host (boolean masks, sizes): a CUDA graph cannot hold them.
            logger.warning("the ops prefer the reference backend ('torch'), which CUDA graphs cannot capture: "
                           "every step runs eagerly (enforce_eager=True)")
            enforce_eager = True
        self._channel = self._open_ranks(model, step_timeout, workers)
        spec, extra_specs, plan = self._plan_pool(pool_args, enforce_eager)
        self.stop_rule = StopRule(config.eos_token_id, self.max_model_len, tokenizer)
        self.block_manager = BlockManager(plan.num_blocks, plan.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                   stop_rule=self.stop_rule)
        self.runner = ModelRunner(model, spec, plan, extra_specs=extra_specs, device=self.device, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                  enforce_eager=enforce_eager, channel=self._channel, logprobs_mode=logprobs_mode)
        # What a request without SamplingParams gets (from_pretrained: the checkpoint's generation_config.json).
        self.default_sampling_params = SamplingParams()
        # The fields generation_config.json gave (SamplingParams names: max_new_tokens is "max_tokens"); a
        # server takes its defaults from here, where a field the checkpoint left out differs from one it set.
        self.generation_defaults: dict = {}
        self.max_logprobs = max_logprobs
        self.logprobs_mode = logprobs_mode
        engine = weakref.proxy(self)  # (bound methods would keep the engine, and its KV pool, alive: a cycle)
        self._checks = RequestChecks(tokenizer, config.vocab_size, self.max_model_len, max_logprobs,
                                     lambda spec: engine._check_grammar(spec),
                                     lambda grammar, params: engine._check_compiled(grammar, params))
        self.async_scheduling = bool(async_scheduling)
        self._in_flight: LaunchedStep | None = None  # launched, its tokens not read yet
        self._requests: dict[int, list[Request]] = {}  # by the id add_request returned: the prompt's n sequences
        self.failed_request_ids: list[int] = []  # the requests the last step that raised finished with "error"
        self._next_id = 0
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self._seed_source = random.Random(seed)  # the seeds of requests without their own
        self._grammar_compiler = None  # structured output's GrammarCompiler, made on first use
        self._grammar_compiler_lock = threading.Lock()  # compile_structured may run on other threads
        if warmup:
            self.warmup()

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, dtype=None, device=None, load_format: str = "auto",
                        quantization: str | None = None, tensor_parallel_size: int = 1,
                        expert_parallel: bool | str = False, data_parallel_size: int = 1,
                        dp_attention: bool = False, parallel=None, generation_config: str | Path = "auto",
                        **engine_args) -> Engine | DataParallelEngine | None:
        """Load a checkpoint folder (config.json, *.safetensors, tokenizer.json); None = the built-in demo model.
        ``quantization`` (``"fp8"`` / ``"fp8_block"``): quantize an unquantized checkpoint while loading (``load_model``).

        ``tensor_parallel_size=N > 1``: the model split over N ranks (``expert_parallel``: a MoE model's
        experts split whole over them instead of each expert's intermediate dim, combined by one all-reduce
        (True or ``"all_reduce"``) or by sending tokens to their experts' ranks and back (``"all_to_all"``;
        docs/architecture.md, "expert parallelism: two exchanges")). Without a launcher,
        this process is rank 0 and starts ranks 1..N-1 (on CUDA, rank r uses GPU r). Under ``torchrun``
        (or with ``torch.distributed`` initialized) every rank calls this: rank 0 gets the engine; on the
        other ranks the call serves rank 0's steps and returns None once rank 0 shuts the engine down.

        ``data_parallel_size=M > 1``: M replicas of that engine, each in its own process (on CUDA replica i
        uses GPUs i*N..i*N+N-1), behind a ``DataParallelEngine`` front with this class's API that routes
        each request to the replica with the fewest outstanding tokens (``engine/data_parallel.py``).
        ``dp_attention=True`` (a MoE model, ``expert_parallel="all_to_all"``, N = 1): the replicas are the DP
        ranks of one world, each with the whole attention and 1/M of the experts (``engine/dp_attention.py``).

        ``parallel``: a ``ParallelContext`` of one TP rank to build the model over (a process that already
        joined a world, e.g. a DP-attention rank); not with ``tensor_parallel_size`` > 1.

        ``generation_config``: where the EOS ids and the sampling defaults of requests without
        ``SamplingParams`` come from (vLLM's values): ``"auto"`` the checkpoint's generation_config.json,
        ``"vllm"`` its EOS ids only, or a folder whose generation_config.json is read instead.
        """
        from atom_core.models import ParallelContext, check_buildable, load_model

        # refused (a bad value, a folder without the file) before any process starts
        eos_token_ids, defaults = generation_config_of(path if path is not None else DEMO_MODEL, generation_config)
        if data_parallel_size != 1:
            from atom_core.engine.data_parallel import DataParallelEngine

            return DataParallelEngine(path, data_parallel_size=data_parallel_size, dtype=dtype, device=device,
                                      load_format=load_format, quantization=quantization,
                                      tensor_parallel_size=tensor_parallel_size, expert_parallel=expert_parallel,
                                      dp_attention=dp_attention, generation_config=generation_config,
                                      **engine_args)
        if dp_attention:
            raise ValueError("dp_attention=True splits the experts over data-parallel replicas: it needs "
                             "data_parallel_size > 1")
        if parallel is not None and tensor_parallel_size != 1:
            raise ValueError("parallel= builds the model over a context this process already has; it does not "
                             f"start ranks: tensor_parallel_size must be 1, got {tensor_parallel_size}")

        path = Path(path) if path is not None else DEMO_MODEL
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        check_device(device)
        load_args = dict(dtype=dtype, load_format=load_format, quantization=quantization)
        if tensor_parallel_size == 1:
            model = load_model(path, device=device, parallel=parallel, **load_args)
            engine = cls(model, Tokenizer.maybe_from(path), device=device, **engine_args)
        else:
            # a bad value, or sizes the ranks cannot split, refused before any rank starts
            check_buildable(path, ParallelContext(tp_size=tensor_parallel_size, expert_parallel=expert_parallel),
                            quantization=quantization)
            step_timeout = engine_args.get("step_timeout", DEFAULT_STEP_TIMEOUT)
            worker_args = dict(path=str(path), dtype=None if dtype is None else str(dtype).removeprefix("torch."),
                               load_format=load_format, quantization=quantization, device=torch.device(device).type,
                               tensor_parallel_size=tensor_parallel_size, expert_parallel=expert_parallel)
            ranks = start_ranks(tensor_parallel_size=tensor_parallel_size, expert_parallel=expert_parallel,
                                device=device, step_timeout=step_timeout, worker_args=worker_args)
            try:
                model = load_model(path, device=ranks.device, parallel=ranks.parallel, **load_args)
                if not ranks.is_driver:  # a launcher's worker rank: serve until rank 0 shuts the engine down
                    run_worker(model)
                    ranks.close()
                    return None
                engine = cls(model, Tokenizer.maybe_from(path), device=ranks.device, workers=ranks.workers,
                             **engine_args)
            except BaseException:
                ranks.close()
                raise
        engine.eos_token_ids = engine.eos_token_ids | set(eos_token_ids)
        try:
            engine.default_sampling_params = SamplingParams(**defaults)
        except ValueError as e:
            source = path if generation_config in ("auto", "vllm") else Path(generation_config)
            raise ValueError(f"{source / 'generation_config.json'}: {e}") from None
        engine.generation_defaults = dict(defaults)
        return engine

    # ------------------------------------------------------------------ several ranks

    def _open_ranks(self, model, step_timeout: float, workers: WorkerSet | None) -> StepChannel | None:
        """Rank 0 of a model split over a TP group: the control group and channel to the workers (made
        together with their ``run_worker``), and the finalizer that stops them. None for one rank."""
        self._finalizer = None
        self.workers = None
        parallel = getattr(model, "parallel", None)
        if parallel is None or parallel.tp_size == 1:
            if workers is not None:
                raise ValueError("workers= is for a model split over several ranks; this model is not split")
            return None
        if parallel.tp_group is None:
            raise ValueError(f"the model is split over {parallel.tp_size} ranks but has no process group "
                             "(load_model(..., parallel=ParallelContext.from_world(...)))")
        if parallel.tp_rank != 0:
            raise ValueError(f"the Engine runs on TP rank 0; this process is rank {parallel.tp_rank} of its group: "
                             "call atom_core.engine.run_worker(model) there")
        if parallel.dp_size > 1:
            raise ValueError("data parallelism (several engine replicas) is not built yet: use a world of one TP group")
        if isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float)) or not step_timeout > 0:
            raise ValueError(f"step_timeout must be a number of seconds > 0, got {step_timeout!r}")
        workers = workers or WorkerSet()
        self.workers = workers  # the processes of the other ranks this process started (none under a launcher)
        channel = StepChannel(parallel, control_group_for(parallel), self.device, dtype=self.model.dtype,
                              step_timeout=step_timeout, find_failure=workers.find_failure)
        # Holds the channel and the processes, not the engine: it runs when the engine is dropped or at exit.
        self._finalizer = weakref.finalize(self, stop_ranks, channel, workers)
        logger.info("engine over %d ranks (%s)", parallel.tp_size, parallel.describe())
        return channel

    def _plan_pool(self, pool_args: dict, enforce_eager: bool):
        """``plan_pool`` here, and with several ranks the smallest block count over the ranks (each sizes
        its own pool from its own memory; they must hold the same blocks)."""
        channel = self._channel
        if channel is None:
            return plan_pool(self.model, self.device, **pool_args)
        channel.send_object({"pool": pool_args, "enforce_eager": enforce_eager})
        try:
            spec, extra_specs, plan = plan_pool(self.model, self.device, **pool_args)
        except BaseException:
            channel.agree_min(-1)  # the workers stop waiting for this rank
            raise
        agreed = channel.agree_min(plan.num_blocks)
        if agreed < 0:
            raise WorkerFailedError("a worker rank could not size its KV pool (its own log says why)")
        if agreed != plan.num_blocks:
            spec, extra_specs, plan = plan_pool(self.model, self.device, **pool_args | {"num_kv_blocks": agreed})
        return spec, extra_specs, plan

    def shutdown(self) -> None:
        """Stop the worker ranks (several ranks: they leave, or are killed after a grace period; the process
        group the engine made is destroyed) after leaving the weight-update group, if one is open. Idempotent;
        a one-rank engine has nothing to stop. The engine cannot step afterwards."""
        try:
            self.destroy_weight_update_group()
        finally:
            if self._finalizer is not None:
                self._finalizer()

    def check_health(self) -> None:
        """Raise ``DistributedEngineError`` naming why this engine can no longer step: a worker rank's process
        has exited, or a step failed across the ranks. Reads the workers' exit statuses only (a server's health
        check); a one-rank engine always passes."""
        if self._channel is None:
            return
        self._channel.check_usable()
        failure = self._channel.find_failure()
        if failure is not None:
            raise WorkerFailedError(f"this multi-rank engine can no longer run: {failure}")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: str | Sequence[int] | np.ndarray, params: SamplingParams | None = None, *,
                    grammar: CompiledStructuredOutput | None = None, prompt_text: str | None = None) -> int:
        """Queue a prompt; returns its request id. Raises (and queues nothing) when the prompt or
        its parameters are not valid or it can never fit.

        With ``params.n > 1`` the prompt gets n sequences (outputs with this id and ``index``
        0..n-1): the first computes the prompt, the others start once it has, from its blocks in
        the prefix cache. With a seed, sequence i draws with ``seed + i``.

        ``grammar``: ``params.structured_outputs`` already compiled by :meth:`compile_structured`
        (on another thread, say); without it, a request with structured output is compiled here.

        ``prompt_text``: the prompt's text, kept as its outputs' ``prompt`` (vLLM's ``RequestOutput.prompt``):
        for a prompt of token ids whose text is known (``chat`` passes the rendered conversation). Default:
        the prompt itself when it is text, else None. RuntimeError while the engine is asleep."""
        self._check_awake("Engine.add_request")
        if self._channel is not None:
            self._channel.check_usable()  # DistributedEngineError: the ranks are gone, no step would run it
        token_ids, params = self._check_request(prompt, params, grammar)
        prompt_text = prompt_text_of(prompt, prompt_text)
        if grammar is None and params.structured_outputs is not None:
            grammar = self.compile_structured(params)  # a cache hit: the check above compiled it
        processing = request_processing(params, self.eos_token_ids, self.model.config.vocab_size, self.tokenizer)
        group_id = self._next_id
        requests = []
        for index in range(params.n):
            if params.seed is None:
                seed = self._seed_source.getrandbits(62)
            else:  # the int64 with the same 64 bits as seed + index (mod 2**64), as SamplingParams.seed_int64
                seed = (params.seed + index) % SEED_LIMIT
                seed = seed - SEED_LIMIT if seed >= 2**63 else seed
            request = Request(self._next_id, token_ids, params, seed, group_id=group_id, index=index,
                              tokenizer=self.tokenizer, prompt=prompt_text)
            request.processing = processing
            if grammar is not None:
                request.grammar = grammar.compiler.new_state(grammar)
            if index and params.prompt_logprobs is not None:  # computed once, by the first sequence
                request.prompt_logprobs = requests[0].prompt_logprobs
                request.prompt_logprob_ranks = requests[0].prompt_logprob_ranks
                request.prompt_top_logprobs = requests[0].prompt_top_logprobs
                request.num_prompt_logprobs_scheduled = len(token_ids) - 1
            self._next_id += 1
            requests.append(request)
        self._requests[group_id] = requests
        for request in requests:
            self.scheduler.add(request, after=None if request is requests[0] else requests[0])
        return group_id

    def _check_request(self, prompt, params, grammar=None) -> tuple[list[int], SamplingParams]:
        params = self.default_sampling_params if params is None else params
        return self._checks.check(prompt, params, grammar)

    def compile_structured(self, params: SamplingParams | None) -> CompiledStructuredOutput | None:
        """``params.structured_outputs`` compiled for this engine (None when it asks for none), for
        ``add_request(..., grammar=...)``; ValueError naming the problem, as ``add_request`` raises.

        Any thread may call it while another steps the engine: a new schema costs tens of
        milliseconds at a 150k vocabulary, and the first call also builds the compiler over the
        vocabulary, so a server compiles away from its step thread (``AsyncEngine`` does)."""
        params = self.default_sampling_params if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs: structured output needs a tokenizer "
                             "(tokenizer.json in the model folder)")
        return self.grammar_compiler.compile(params.structured_outputs)

    def _check_grammar(self, spec) -> None:
        """A constraint that does not compile is refused (compiled and cached by xgrammar: the request's
        own compilation is then a cache hit)."""
        self.grammar_compiler.compile(spec)

    def _check_compiled(self, grammar, params: SamplingParams) -> None:
        from atom_core.engine.structured_output import CompiledStructuredOutput

        if not isinstance(grammar, CompiledStructuredOutput):
            raise TypeError(f"grammar must come from Engine.compile_structured, got {type(grammar).__name__}")
        if grammar.compiler is not self._grammar_compiler:
            raise ValueError("grammar was compiled by another engine (compile_structured of the engine that runs it)")
        if grammar.spec != params.structured_outputs:
            raise ValueError(f"grammar was compiled for structured_outputs={grammar.spec!r}, the request asks for "
                             f"{params.structured_outputs!r}")

    @property
    def grammar_compiler(self):
        """Structured output's ``GrammarCompiler`` over this engine's tokenizer (made on first use, once
        whichever thread asks; ``StructuredOutputUnavailableError`` without the ``structured`` extra)."""
        if self._grammar_compiler is None:
            with self._grammar_compiler_lock:
                if self._grammar_compiler is None:
                    from atom_core.engine.structured_output import GrammarCompiler

                    self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size,
                                                             self.eos_token_ids)
        return self._grammar_compiler

    def abort(self, request_id: int | Iterable[int]) -> None:
        """Stop a request (all its ``n`` sequences) now and free its blocks; an iterable of ids stops each (as
        vLLM's ``abort_request``). Unknown or finished ids are ignored; an id that is not an int (a vLLM-style
        string) is refused, since it can name no request here."""
        for request_id in request_ids_of(request_id):
            for request in self._requests.pop(request_id, ()):
                if not request.finished:
                    self.scheduler.finish(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_unfinished(self, request_id: int) -> bool:
        """Whether the request (what ``add_request`` returned) has a sequence still to finish."""
        return any(not request.finished for request in self._requests.get(request_id, ()))

    # ------------------------------------------------------------------ stepping

    @property
    def num_preemptions(self) -> int:
        """Requests sent back to recompute because the pool ran dry (each time counted)."""
        return self.scheduler.num_preemptions

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.stop_rule.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids) -> None:
        self.stop_rule.eos_token_ids = token_ids

    def step(self) -> StepOutputs:
        """Run one step; returns an output for every request that got a new token in it.

        With ``async_scheduling`` the next step is scheduled and launched before this one's tokens
        are read, so the device never waits for the host between steps. RuntimeError while the engine is
        asleep (``wake_up`` first).
        """
        self._check_awake("Engine.step")
        if self._channel is not None:
            try:
                self._channel.check_usable()
            except BaseException:
                self._fail_all()
                raise
        if not self.runner.is_bound:  # another engine on this model bound its own pool since
            self.runner.bind()
        current, self._in_flight = self._in_flight, None
        scheduled = [] if current is None else [current.step]
        try:
            if current is None:
                current = self._launch_next(scheduled)
            if current is None:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("the scheduler could not run any request: the pool is too small for the "
                                       "waiting requests")
                return StepOutputs([], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), {})
            # Structured output needs each step's tokens on the host before the next step's masks.
            if self.async_scheduling and not self.scheduler.num_structured:
                self._in_flight = self._launch_next(scheduled)
            result = self.runner.collect(current)
            record = self.scheduler.record(current.step, result.tokens, result.logprobs, result.top_logprobs,
                                           result.prompt_logprobs, result.logprob_ranks)
        except BaseException:
            self._fail(scheduled)
            if self._channel is not None and self._channel.failure is not None:
                self.shutdown()  # the ranks are out of step: stop the workers now
                self._fail_all(also=self.failed_request_ids)
            raise
        for i in record.finish_reasons:
            self._forget_if_done(record.requests[i].group_id)
        return StepOutputs(record.requests, record.tokens, record.num_tokens, record.finish_reasons)

    def _forget_if_done(self, group_id: int) -> None:
        group = self._requests.get(group_id)
        if group is not None and all(r.finished for r in group):
            del self._requests[group_id]

    def _launch_next(self, scheduled: list) -> LaunchedStep | None:
        step = self.scheduler.schedule()
        if step is None:
            return None
        scheduled.append(step)  # from here on, a failure finishes its requests
        return self.runner.launch(step)

    def _fail(self, steps: list) -> None:
        """A step raised: finish every request of the steps in play with reason "error" (all its ``n`` sequences,
        freeing their blocks), so the engine is consistent and the next request runs. ``failed_request_ids``
        then lists their ids (what ``add_request`` returned), for a caller that streams outputs."""
        self._in_flight = None
        # finished by the scheduler (a step's masks failed), or unfinished in a step in play
        failed = {request.group_id for request in self.scheduler.failed_requests}
        failed.update(request.group_id for step in steps for request in step.requests if not request.finished)
        for group_id in failed:  # every sequence of the request: one the steps did not run would go on alone
            for request in self._requests.get(group_id, ()):
                if not request.finished:
                    self.scheduler.finish(request, "error")
            self._forget_if_done(group_id)
        self.failed_request_ids = sorted(failed)

    def _fail_all(self, also=()) -> None:
        """The ranks can no longer run: finish every unfinished request with reason "error" (the waiting ones
        too: no step will run them); ``failed_request_ids`` lists them and the ids ``also`` given."""
        self._in_flight = None
        failed = set(also)
        for group_id, group in list(self._requests.items()):
            for request in group:
                if not request.finished:
                    self.scheduler.finish(request, "error")
            self._forget_if_done(group_id)
            failed.add(group_id)
        self.failed_request_ids = sorted(failed)

    def _num_unfinished(self) -> int:
        return self.scheduler.num_unfinished
