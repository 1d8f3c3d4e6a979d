"""Engine benchmarks of one decode step (sections of ``python -m benchmarks.engine``): ``--section host``, the
host's share of a step on a CPU against a plain-Python step, and ``--section profile``, a step's GPU kernels by
time. See benchmarks/engine.py for the other sections and the workload."""

from __future__ import annotations

import random
import time

import numpy as np
import torch
import xxhash

from benchmarks.engine import _sync, build_bench_model, load_config

HOST_STEPS, HOST_WINDOWS = 100, 4  # the best of 4 windows of 100 steps: other processes on a shared CPU add noise


def _best_window_us(step) -> float:
    """Mean microseconds of one ``step()`` over the fastest of HOST_WINDOWS windows of HOST_STEPS calls."""
    best = float("inf")
    for _ in range(HOST_WINDOWS):
        t0 = time.perf_counter()
        for _ in range(HOST_STEPS):
            step()
        best = min(best, (time.perf_counter() - t0) / HOST_STEPS * 1e6)
    return best


class PlainPythonDecode:
    """The reference: a decode step kept in plain Python lists, one loop per phase over the rows
    (the usual small-engine design): grow each block table when a token starts a block and hash
    each block a token fills, build the inputs as lists, make tensors of them, append the sampled
    token to each sequence and check its stop conditions."""

    def __init__(self, prompts, block_size=16, max_tokens=1000):
        self.block_size, self.max_tokens = block_size, max_tokens
        self.free = list(range(len(prompts) * 2048 // block_size, 0, -1))
        self.tokens = [list(p) + [5] for p in prompts]  # prefill done: one sampled token each
        self.num_prompt = [len(p) for p in prompts]
        self.tables = [[self.free.pop() for _ in range(-(-len(t) // block_size))] for t in self.tokens]
        self.hashes = [[] for _ in prompts]
        self.index = {}

    def step(self):
        bs, rows = self.block_size, range(len(self.tokens))
        for r in rows:  # schedule: a block for each token that starts one
            if (len(self.tokens[r]) - 1) % bs == 0:
                self.tables[r].append(self.free.pop())
        input_ids, positions, slots, context, temperature = [], [], [], [], []
        for r in rows:  # prepare
            tokens, table = self.tokens[r], self.tables[r]
            position = len(tokens) - 1
            input_ids.append(tokens[-1])
            positions.append(position)
            slots.append(table[position // bs] * bs + position % bs)
            context.append(position + 1)
            temperature.append(0.6)
        width = max(len(t) for t in self.tables)
        tables = [t + [-1] * (width - len(t)) for t in self.tables]
        tensors = [torch.tensor(input_ids), torch.tensor(positions), torch.tensor(slots),
                   torch.tensor(context, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
                   torch.tensor(temperature)]
        for r in rows:  # postprocess: append the token, hash a block it fills, check the stop
            tokens = self.tokens[r]
            tokens.append(5)
            if (len(tokens) - 1) % bs == 0:  # the computed block before the new token is full
                parent = self.hashes[r][-1] if self.hashes[r] else 0
                block = np.array(tokens[-1 - bs:-1], dtype="<i8").tobytes()
                self.hashes[r].append(xxhash.xxh64_intdigest(parent.to_bytes(8, "little") + block))
                self.index.setdefault(self.hashes[r][-1], self.tables[r][len(self.hashes[r]) - 1])
            if len(tokens) - self.num_prompt[r] >= self.max_tokens:
                pass  # (never reached in the timed window)
        return tensors


def _prefill_everything(engine) -> None:
    """Step until no request waits and every running one decodes."""
    batch = engine.scheduler.batch
    while engine.scheduler.waiting or (batch.num_tokens[:batch.num_rows] - batch.num_computed_tokens[:batch.num_rows]
                                       > 1).any():
        engine.step()


def section_host(args) -> list[dict]:
    """Per decode step on CPU: schedule (input ids, sampling parameters) + the runner's host side
    (token layout) + record (tokens, stop checks, outputs); the device side of the runner (model and
    sampling kernel) is replaced by a stub that returns a fixed token. ``prepare_us`` is the
    runner's layout part (a mean, not a best). ``read_outputs_us`` adds reading every output's
    ``new_token_ids`` (what a streaming consumer pays); ``plain_python_us`` is the reference step of
    ``PlainPythonDecode`` on the same prompts, timed in the same run."""
    from atom_core.engine import Engine, SamplingParams
    from atom_core.engine.runner import LaunchedStep
    from atom_core.models import build_model

    cfg = load_config("qwen3-0.6b") | {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64,
                                       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                                       "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 1}
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    rows = []
    for running in (1, 64, 256):
        engine = Engine(model, None, device="cpu", max_num_seqs=256, max_model_len=2048,
                        num_kv_blocks=256 * 2048 // 16)
        runner = engine.runner
        prepare_seconds = [0.0]

        def launch(step):  # the host side of the runner; the device replaced by a fixed token
            t = time.perf_counter()
            runner.prepare(step)
            prepare_seconds[0] += time.perf_counter() - t
            return LaunchedStep(step, torch.full((len(step),), 5, dtype=torch.int64), None, None)

        runner.launch = launch
        rng = random.Random(0)
        prompts = [[rng.randint(0, 999) for _ in range(rng.randint(100, 1024))] for _ in range(running)]
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0.6, max_tokens=1000, ignore_eos=True))
        _prefill_everything(engine)  # what is timed is pure decode
        prepare_seconds[0] = 0.0
        step_us = _best_window_us(engine.step)
        prepare_us = prepare_seconds[0] * 1e6 / (HOST_STEPS * HOST_WINDOWS)
        read_us = _best_window_us(lambda: [out.new_token_ids for out in engine.step()])
        # 2 * 400 steps of the 1000 tokens each request may generate: all still decode.
        assert len(engine.scheduler.running) == running, "a request finished inside the timed steps"
        plain_us = _best_window_us(PlainPythonDecode(prompts).step)
        rows.append({"running": running, "us_per_step": step_us, "prepare_us": prepare_us,
                     "read_outputs_us": read_us, "plain_python_us": plain_us, "vs_plain_python": plain_us / step_us})
    return rows


def section_profile(args) -> list[dict]:
    """Where a decode step's time goes at ``--profile-bs`` running requests (``--model``'s shapes, quantized
    per ``--quantization``, KV pool per ``--kv-cache-dtype``): torch.profiler over 10 steps (kernels inside the
    CUDA graphs included); rows are the kernels with the most GPU time, plus the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    from atom_core.engine import Engine, SamplingParams

    model = build_bench_model(load_config(args.model), args.quantization)
    bs = args.profile_bs
    engine = Engine(model, None, device="cuda", max_num_seqs=bs, max_model_len=2048,
                    kv_cache_dtype=args.kv_cache_dtype)
    rng = random.Random(0)
    for _ in range(bs):
        engine.add_request([rng.randint(0, 9999) for _ in range(rng.randint(100, 1024))],
                           SamplingParams(temperature=0.6, max_tokens=900, ignore_eos=True))
    _prefill_everything(engine)
    for _ in range(5):
        engine.step()
    _sync()
    steps = 10
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall_ms = (time.perf_counter() - t0) / steps * 1e3
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_total = sum(e.self_device_time_total for e in events) / steps / 1e3
    label = {"model": args.model, "quantization": args.quantization or "bf16", "kv_cache_dtype": args.kv_cache_dtype,
             "bs": bs}
    rows = [{**label, "name": "STEP (wall)", "ms_per_step": wall_ms},
            {**label, "name": "all GPU kernels", "ms_per_step": gpu_total,
             "calls_per_step": sum(e.count for e in events) / steps}]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.profile_rows]:
        rows.append({**label, "name": e.key[:70], "ms_per_step": e.self_device_time_total / steps / 1e3,
                     "calls_per_step": e.count / steps,
                     "us_per_call": e.self_device_time_total / max(e.count, 1)})
    return rows
