"""Engine benchmarks: offline throughput vs HF transformers (cold and warm), decode latency, time to
first token vs HF's forward, host overhead per step and a step's kernels (those two in benchmarks/engine_step.py).

    python -m benchmarks.engine --section throughput   # GPU: the nano-vllm workload, Qwen3-0.6B shapes;
                                                       # cold (fresh process, empty Triton cache) and warm
    python -m benchmarks.engine --section throughput --model qwen3-30b-a3b --hf-max-tokens 256
    python -m benchmarks.engine --section latency      # GPU: ms per token at bs 1 / 64, Qwen3-0.6B and Llama-3-8B shapes
    python -m benchmarks.engine --section ttft         # GPU: one 128-token and one 16k-token prompt vs HF's forward
    python -m benchmarks.engine --section ttft --model llama-3-8b --quantization fp8_block --no-hf   # bf16 and FP8 prefill
    python -m benchmarks.engine --section tp --latency-models llama-3-8b   # 2 GPUs: TP 2 against TP 1
    python -m benchmarks.engine --section tp --latency-models qwen3-30b-a3b  # 2 GPUs: TP 1, TP 2, EP 2 all-reduce,
                                                       # EP 2 all-to-all
    python -m benchmarks.engine --section tp --latency-models llama-3-70b --tp-sizes 4 8   # 8 GPUs: bs1 decode
                                                       # against the aggregate copy bandwidth (%agg_copy_bw)
    python -m benchmarks.engine --section tp --latency-models qwen3-30b-a3b --tp-sizes 1 8   # TP 8, EP 8 both ways
    python -m benchmarks.engine --section tp --latency-models deepseek-v3 --tp-sizes 8 --ep-sizes --quantization fp8_block
    python -m benchmarks.engine --section tp --smoke --device cpu --dtype float32 --tp-sizes 4   # a check on a CPU
                                                       # (gloo; ATOM_CORE_BACKEND=torch)
    python -m benchmarks.engine --section profile --model llama-3-8b --quantization fp8_block --profile-bs 1
                                                       # GPU: the kernels of a decode step, by GPU time
    python -m benchmarks.engine --section host         # CPU: schedule + prepare + record per decode step,
                                                       # against a plain-Python step timed in the same run
    python -m benchmarks.engine --section latency --latency-models llama-3-8b --quantization fp8_block
                                                       # quantized (dummy weights, quantized a layer at a time)
                                                       # against bf16 in the same run
    python -m benchmarks.engine --section throughput --model qwen3-30b-a3b --quantization fp8 --hf-seqs 0
    python -m benchmarks.engine --section latency --latency-models gpt-oss-20b --quantization config
                                                       # the config's own quantization_config (gpt-oss: MXFP4)

``--quantization`` (throughput and latency): ``fp8`` / ``fp8_block`` quantize every linear layer and expert
as ``load_model(quantization=...)`` does, ``config`` builds the config file's ``quantization_config``
(gpt-oss-20b.json: MXFP4 experts kept packed); the bf16 baseline is the same config without it. Rows
carry ``quantization`` and ``vs_bf16`` (the quantized row's speed over the bf16 one).

Weights are dummy (random) with the real shapes from benchmarks/configs/; the shapes set the cost.
The nano-vllm workload: seed 0, 256 sequences, prompt and output lengths uniform in [100, 1024],
random token ids < 10000, EOS ignored, one warm-up; throughput = output tokens / wall time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import copy_bandwidth_gbs, print_table, write_json

CONFIGS = Path(__file__).resolve().parent / "configs"


def load_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def nano_vllm_workload(num_seqs=256, min_len=100, max_len=1024, vocab=10000, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, output_lens


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------- throughput

QUANTIZATIONS = ("fp8", "fp8_block", "config")


def build_bench_model(cfg: dict, quantization: str | None):
    """Dummy-weight model of ``cfg``'s shapes on the GPU, bf16: ``quantization`` None builds it unquantized
    (the config's ``quantization_config`` dropped), ``"config"`` with the config's own quantization,
    ``"fp8"`` / ``"fp8_block"`` quantized as ``load_model(quantization=...)`` quantizes (random weights
    drawn and quantized a layer at a time)."""
    from atom_core.models import build_model

    if quantization == "config":
        return build_model(cfg, dtype=torch.bfloat16, device="cuda")
    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    return build_model(plain, dtype=torch.bfloat16, device="cuda", quantization=quantization)


def step_weight_bytes(model, batch_size: int) -> int:
    """Weight bytes a dense model's decode step of ``batch_size`` tokens reads: every parameter as stored (fp8
    one byte, MXFP4 half), less the input embedding table, of which the step gathers only its tokens' rows,
    unless the LM head is tied to it and reads it whole."""
    embedding = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied table is one parameter
    if model.lm_head.weight is not embedding:
        total -= (embedding.shape[0] - min(batch_size, embedding.shape[0])) * embedding.shape[1] * \
            embedding.element_size()
    return total


def kv_bytes_per_token(model, cfg: dict, dtype: torch.dtype) -> dict:
    """KV bytes per token of the engine's pool (every layer, caches kept beside it over the same blocks
    such as DSA's indexer keys included) and of per-head K and V for the same attention, as a cache without
    MLA would hold them: ``layers x num_key_value_heads x (qk_nope + qk_rope + v_head_dim) x bytes`` for
    MLA (what HF's DeepSeek cache stores), the pool itself otherwise. ``kv_vs_gqa`` = pool / per-head."""
    spec = model.kv_cache_spec(dtype)
    extras = model.extra_kv_cache_specs(dtype) if hasattr(model, "extra_kv_cache_specs") else {}
    pool = spec.bytes_per_token + sum(extra.bytes_per_token for extra in extras.values())
    per_head = spec.bytes_per_token
    if spec.is_mla:
        heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        dims = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
        per_head = spec.num_layers * heads * dims * dtype.itemsize
    return {"kv_bytes_per_token": pool, "kv_bytes_per_token_gqa": per_head, "kv_vs_gqa": pool / per_head}


def atom_core_throughput(cfg: dict, prompts, output_lens, *, runs: int = 1, label: str = "atom_core",
                         quantization: str | None = None, **engine_args) -> list[dict]:
    """atom_core's ``Engine.generate`` on the workload, ``runs`` times, dummy weights of ``cfg``'s shapes
    (quantized per ``quantization``, see ``build_bench_model``).
    One row per run; the first carries the engine's construction time (its warm-up included). The
    model and its KV pool are freed before returning."""
    from atom_core.engine import Engine, SamplingParams

    if "kv_lora_rank" in cfg:
        # MLA's expanded (prefill) form expands every page of a row's block table, max_model_len wide in a
        # CUDA graph: the model's own limit (163840 for DeepSeek) would expand ~40M rows per mixed step.
        # The workload's longest request is a 1024-token prompt with 1024 output tokens.
        engine_args.setdefault("max_model_len", 2048)
    model = build_bench_model(cfg, quantization)
    _sync()
    t0 = time.perf_counter()
    engine = Engine(model, None, device="cuda", **engine_args)
    _sync()
    construct_s = time.perf_counter() - t0
    kv_bytes = kv_bytes_per_token(model, cfg, engine.runner.kv_pool.dtype)
    print(f"KV bytes per token: {kv_bytes['kv_bytes_per_token']} (per-head K/V: {kv_bytes['kv_bytes_per_token_gqa']}, "
          f"ratio {kv_bytes['kv_vs_gqa']:.3f})", flush=True)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
    rows = []
    for run in range(runs):
        _sync()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        _sync()
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        kv = engine_args.get("kv_cache_dtype", "auto")
        rows.append({"system": label + (" (eager)" if engine_args.get("enforce_eager") else "")
                     + ("" if kv == "auto" else f" (KV {kv})") + (f" ({quantization})" if quantization else ""),
                     "quantization": quantization or "bf16",
                     "run": f"generate #{run + 1}", "seqs": len(prompts), "output_tokens": tokens,
                     "seconds": elapsed, "tok_per_s": tokens / elapsed, "preemptions": engine.num_preemptions,
                     "construct_s": construct_s if run == 0 else None, **kv_bytes})
        print(rows[-1], flush=True)
    del engine, model, outs
    gc.collect()  # everything freed, cycles included, before the next run takes the GPU
    torch.cuda.empty_cache()
    return rows


def _in_fresh_process(args, triton_cache: str, label: str, quantization: str | None = None) -> list[dict]:
    """``--section atom-core-runs`` in a new Python process with ``TRITON_CACHE_DIR=triton_cache``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "benchmarks.engine", "--section", "atom-core-runs", "--model", args.model,
               "--num-seqs", str(args.num_seqs), "--label", label, "--kv-cache-dtype", args.kv_cache_dtype,
               "--json", out] + (["--quantization", quantization] if quantization else [])
        subprocess.run(cmd, check=True, env={**os.environ, "TRITON_CACHE_DIR": triton_cache})
        with open(out) as f:
            data = json.load(f)
    return data["rows"] if isinstance(data, dict) else data


def section_atom_core_runs(args) -> list[dict]:
    """The whole workload twice in this process (run by ``section_throughput`` in a fresh one)."""
    cfg = load_config(args.model)
    prompts, output_lens = nano_vllm_workload(num_seqs=args.num_seqs)
    label = args.label or "atom_core"
    return atom_core_throughput(cfg, prompts, output_lens, runs=2, label=label, gpu_memory_utilization=0.9,
                                kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)


def hf_throughput(hf_model, prompts, output_lens, mode: str) -> dict:
    """HF transformers on the same workload: ``generate_batch`` (continuous batching) or padded
    ``generate`` with a static cache, in batches."""
    from transformers import GenerationConfig

    tokens = 0
    t0 = time.perf_counter()
    if mode == "generate_batch":
        # Continuous batching needs a paged attention implementation; its name varies by version.
        for impl in ("paged|sdpa", "sdpa_paged", "paged_attention"):
            try:
                hf_model.set_attn_implementation(impl)
                break
            except Exception:  # noqa: BLE001 - not this version's name
                continue
        # One max_new_tokens for all (EOS never fires on random weights); every generated token counts.
        gen = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
        results = hf_model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
        tokens = sum(len(r.generated_tokens) for r in results.values())
    else:
        batch = 64
        for i in range(0, len(prompts), batch):
            chunk, lens = prompts[i:i + batch], output_lens[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
            out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False,
                                    eos_token_id=None, pad_token_id=0, cache_implementation="static")
            tokens += (out.shape[1] - width) * len(chunk)  # every generated token counts
            del out
    _sync()
    elapsed = time.perf_counter() - t0
    return {"system": f"HF transformers {mode}", "seqs": len(prompts), "output_tokens": tokens, "seconds": elapsed,
            "tok_per_s": tokens / elapsed}


def _timeout(signum, frame):
    raise TimeoutError("time box exceeded")


def build_hf_model(cfg: dict):
    """HF transformers' model of ``cfg``'s shapes, bf16, built on the GPU (random init); MoE layers
    use the grouped-GEMM experts backend where this transformers version has one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    if getattr(hf_config, "num_experts_per_tok", None) and hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("grouped_mm")
        except Exception:  # noqa: BLE001 - not in this version: its default experts loop stays
            pass
    return model


def _against_hf(args, cfg, hf_prompts, hf_lens) -> list[dict]:
    """atom_core on the subset HF runs, then HF's paths on it (time-boxed); the subset row gets
    ``vs_best_hf``."""
    rows = atom_core_throughput(cfg, hf_prompts, hf_lens, gpu_memory_utilization=0.9,
                                kv_cache_dtype=args.kv_cache_dtype)
    hf_model = build_hf_model(cfg)
    for mode in ("generate_static", "generate_batch"):
        signal.alarm(args.hf_timeout)  # time-boxed: a path slower than this is reported as such
        try:
            r = hf_throughput(hf_model, hf_prompts, hf_lens, mode)
        except Exception as e:  # an HF path missing in this version (or too slow) is reported, not fatal
            r = {"system": f"HF transformers {mode}", "error": f"{type(e).__name__}: {e}"[:200]}
        finally:
            signal.alarm(0)
        print(r, flush=True)
        rows.append(r)
    del hf_model
    gc.collect()
    torch.cuda.empty_cache()
    best_hf = max((r.get("tok_per_s", 0) for r in rows[1:]), default=0)
    if best_hf:
        rows[0]["vs_best_hf"] = rows[0]["tok_per_s"] / best_hf
    return rows


def section_throughput(args) -> list[dict]:
    """atom_core on the whole workload in a fresh process with an empty Triton cache (cold: the
    engine's construction compiles every kernel; its first ``generate`` is the cold figure, its
    second the warm one), then in another fresh process with that cache filled (construction
    without compilation); then, in this process, atom_core on the first ``--hf-seqs`` sequences
    (outputs capped at ``--hf-max-tokens`` when given) and HF transformers on the same subset, so
    ``vs_best_hf`` compares like with like."""
    signal.signal(signal.SIGALRM, _timeout)
    cfg = load_config(args.model)
    prompts, output_lens = nano_vllm_workload(num_seqs=args.num_seqs)
    hf_prompts = prompts[:args.hf_seqs]
    hf_lens = [min(n, args.hf_max_tokens or n) for n in output_lens[:args.hf_seqs]]
    with tempfile.TemporaryDirectory() as cache:
        rows = _in_fresh_process(args, cache, "atom_core, empty Triton cache")
        rows += _in_fresh_process(args, cache, "atom_core, Triton cache filled")
        if args.quantization:  # the same workload quantized, against the bf16 warm run (its second generate)
            quantized = _in_fresh_process(args, cache, "atom_core, Triton cache filled", args.quantization)
            quantized[-1]["vs_bf16"] = quantized[-1]["tok_per_s"] / rows[3]["tok_per_s"]
    if hf_prompts:  # --hf-seqs 0: atom_core alone (e.g. to compare KV pool dtypes run by run)
        rows += _against_hf(args, cfg, hf_prompts, hf_lens)
    cold_first, cold_second = rows[0]["tok_per_s"], rows[1]["tok_per_s"]
    rows[0]["vs_warm"] = cold_first / cold_second
    if args.quantization:
        rows += quantized
    for r in rows:
        r["model"] = args.model
    return rows


# ---------------------------------------------------------------------------------------- latency

def _step_until_decoding(engine, request_ids) -> None:
    """Step until every request of ``request_ids`` has its first output token (a long batch's prompts take
    several prefill chunks)."""
    waiting = set(request_ids)
    while waiting:
        for out in engine.step():
            waiting.discard(out.request_id)


def section_latency(args) -> list[dict]:
    """Decode ms per step at bs 1 / 64 per model (bf16, and with ``--quantization`` the quantized model in the
    same run, ``vs_bf16`` its speedup); ``weight_GB``: every parameter as stored. For a dense model GB/s counts
    what a step reads (``step_weight_bytes``: the embedding's gathered rows, not its whole table, unless tied to
    the LM head) plus the KV; a MoE step reads only its tokens' experts: no such figure. Timing starts once
    every request has its first output token (no prefill chunk in the timed steps)."""
    from atom_core.engine import Engine, SamplingParams

    copy_gbs = copy_bandwidth_gbs()
    rows = []
    variants = [None] + ([args.quantization] if args.quantization else [])
    for name, quantization in [(n, q) for n in args.latency_models for q in variants]:
        cfg = load_config(name)
        model = build_bench_model(cfg, quantization)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        dense = not _is_moe(cfg)
        for eager in (False, True):
            engine = Engine(model, None, device="cuda", max_num_seqs=64, max_model_len=4096,
                            num_kv_blocks=64 * 4096 // 16 + 64, enforce_eager=eager)
            for bs in (1, 64):
                prompt_len, steps = 512, 64
                ids = [engine.add_request(list(range(i, i + prompt_len)),
                                          SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
                       for i in range(bs)]
                _step_until_decoding(engine, ids)
                for _ in range(3):
                    engine.step()
                _sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                _sync()
                ms = (time.perf_counter() - t0) / steps * 1e3
                while engine.has_unfinished_requests():
                    engine.step()
                row = {"model": name, "quantization": quantization or "bf16", "bs": bs, "cuda_graphs": not eager,
                       "ms_per_step": ms, "tok_per_s": bs / ms * 1e3, "weight_GB": weight_bytes / 1e9}
                if dense:
                    context = prompt_len + 4 + steps // 2  # the timed steps' mean context (at least)
                    kv_bytes = bs * context * model.kv_cache_spec().bytes_per_token  # K and V, or MLA's latent rows
                    gbs = (step_weight_bytes(model, bs) + kv_bytes) / (ms * 1e-3) / 1e9
                    row |= {"GB/s": gbs, "%copy_bw": 100 * gbs / copy_gbs}
                base = next((r for r in rows if r["model"] == name and r["quantization"] == "bf16" and r["bs"] == bs
                             and r["cuda_graphs"] == (not eager)), None)
                if quantization and base is not None:
                    row["vs_bf16"] = base["ms_per_step"] / ms
                rows.append(row)
            del engine
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------- tensor parallel

def _config_folder(cfg: dict, folder: Path, *, keep_quantization: bool = False) -> Path:
    """A checkpoint folder holding only ``config.json`` (dummy weights are drawn on each rank); the config's
    ``quantization_config`` dropped unless ``keep_quantization``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                    if keep_quantization or k != "quantization_config"}))
    return folder


def _is_moe(cfg: dict) -> bool:
    return bool(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))


def tp_variants(cfg: dict, tp_sizes, ep_modes, ep_sizes=None) -> list[tuple[int, bool | str]]:
    """(ranks, expert_parallel) runs of one model, in order: each of ``tp_sizes`` tensor-parallel (a MoE
    model's experts split by their intermediate dim), then for a MoE model each of ``ep_sizes`` (None: the
    TP sizes above 1) expert-parallel in each of ``ep_modes``."""
    variants = [(n, False) for n in tp_sizes]
    if _is_moe(cfg):
        sizes = [n for n in tp_sizes if n > 1] if ep_sizes is None else ep_sizes
        variants += [(n, mode) for n in sizes if n > 1 for mode in ep_modes]
    return variants


# --smoke (--section tp): a CPU-sized model of the family (8 heads, so it splits up to 8 ways), short requests.
TP_SMOKE_SHAPES = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 1,
                   "max_position_embeddings": 256, "moe_intermediate_size": 32}


def section_tp(args) -> list[dict]:
    """Decode ms per step (bs 1 and 64) and nano-vllm throughput at each of ``--tp-sizes`` (default 1 2), and
    for MoE models expert-parallel at each of ``--ep-sizes`` (default: the TP sizes above 1) in each of
    ``--ep-modes`` (``all_reduce``: every rank runs its experts on all tokens, one all-reduce; ``all_to_all``:
    tokens sent to their experts' ranks and back), dummy weights (each rank draws its own shard: tokens differ
    from TP 1, speed is what is compared), one GPU per rank. ``--quantization``: the model built that way
    (``fp8`` / ``fp8_block`` quantized at build, ``config`` the config's own ``quantization_config``), no bf16
    run beside it (DeepSeek-V3 in bf16 does not fit on eight H200s).

    ``vs_first``: against the model's first run (TP 1 by default) — its time / this one for latency, this
    throughput / its for throughput. Decode rows of a dense model also give ``weight_GB_per_rank`` (rank 0's
    parameters), ``GB/s_per_rank`` (what its step reads, ``step_weight_bytes``, plus its KV rows, over the step
    time) and
    ``%agg_copy_bw``: the bytes every rank reads per step over the time, against N x the copy bandwidth of
    GPU 0 measured in the same run (= the per-rank rate over one GPU's copy bandwidth; the ranks read their
    shards at once). A MoE step reads only its tokens' experts: no such figure."""
    from atom_core.engine import Engine, SamplingParams

    rows = []
    smoke = args.smoke
    batch_sizes, timed_steps, prompt_len = ((1, 4), 4, 8) if smoke else ((1, 64), 64, 512)
    if smoke:
        prompts, output_lens = nano_vllm_workload(num_seqs=min(args.num_seqs, 4), min_len=4, max_len=12, vocab=1000)
    else:
        prompts, output_lens = nano_vllm_workload(num_seqs=args.num_seqs)
    copy_gbs = copy_bandwidth_gbs(args.device, nbytes=(64 << 20) if args.device == "cpu" else (2 << 30))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # (the copy's 4 GiB back before rank 0 sizes its KV pool)
    quantization = None if args.quantization in (None, "config") else args.quantization
    for name in args.latency_models:
        cfg = load_config(name) | (TP_SMOKE_SHAPES if smoke else {})
        dense = not _is_moe(cfg)
        # MLA's expanded prefill form expands max_model_len rows per mixed step (section_throughput's note).
        max_model_len = 64 if smoke else 2048 if "kv_lora_rank" in cfg else 4096
        base = {}
        for tp, ep in tp_variants(cfg, args.tp_sizes, args.ep_modes, args.ep_sizes):
            label = {"model": name, "quantization": args.quantization or args.dtype, "tp": tp, "ep": ep or "-"}
            with tempfile.TemporaryDirectory() as tmp:
                folder = _config_folder(cfg, Path(tmp) / name, keep_quantization=args.quantization == "config")
                engine = Engine.from_pretrained(folder, load_format="dummy", dtype=args.dtype, device=args.device,
                                                quantization=quantization, tensor_parallel_size=tp,
                                                expert_parallel=ep, max_num_seqs=256, max_model_len=max_model_len)
                with engine:
                    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
                    kv_per_token = engine.model.kv_cache_spec().bytes_per_token  # this rank's KV (or MLA) rows
                    for bs in batch_sizes:
                        ids = [engine.add_request(list(range(i, i + prompt_len)),
                                                  SamplingParams(temperature=0, max_tokens=timed_steps + 8,
                                                                 ignore_eos=True))
                               for i in range(bs)]
                        _step_until_decoding(engine, ids)
                        for _ in range(3):
                            engine.step()
                        _sync()
                        t0 = time.perf_counter()
                        for _ in range(timed_steps):
                            engine.step()
                        _sync()
                        ms = (time.perf_counter() - t0) / timed_steps * 1e3
                        while engine.has_unfinished_requests():
                            engine.step()
                        base.setdefault(("latency", bs), ms)
                        row = {**label, "metric": f"decode ms/step bs{bs}", "value": ms,
                               "vs_first": base[("latency", bs)] / ms}
                        if dense:
                            context = prompt_len + 4 + timed_steps // 2
                            gbs = (step_weight_bytes(engine.model, bs) + bs * context * kv_per_token) / (ms * 1e-3) \
                                / 1e9
                            row |= {"weight_GB_per_rank": weight_bytes / 1e9, "GB/s_per_rank": gbs,
                                    "%agg_copy_bw": 100 * gbs / copy_gbs}
                        rows.append(row)
                        print(rows[-1], flush=True)
                    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
                    _sync()
                    t0 = time.perf_counter()
                    outs = engine.generate(prompts, params, use_tqdm=False)
                    _sync()
                    tok_s = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
                    base.setdefault("throughput", tok_s)
                    rows.append({**label, "metric": "nano-vllm output tok/s", "value": tok_s,
                                 "vs_first": tok_s / base["throughput"]})
                    print(rows[-1], flush=True)
            engine = outs = None  # its KV pool and weights freed before the next variant sizes its own
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------- time to first token

def _hf_forward_ms(cfg: dict, num_tokens: int, repeats: int = 5) -> float:
    """Median ms of HF transformers' forward (SDPA attention, bf16) over one prompt of ``num_tokens``,
    logits of the last position only, after one warm-up forward."""
    model = build_hf_model(cfg)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 10000, (1, num_tokens), device="cuda")
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            _sync()
            t0 = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            _sync()
            times.append((time.perf_counter() - t0) * 1e3)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return float(np.median(times[1:]))


def section_ttft(args) -> list[dict]:
    """Time to first token of one prompt (128 and 16384 tokens, or the model's positions) through ``Engine.step()`` on a warm
    engine: from ``add_request`` to the step that returns the token (median of 5), against HF
    transformers' SDPA forward of the same (bf16) model over the same prompt. With ``--quantization`` the
    quantized model runs too, in the same run (``vs_bf16``: the bf16 TTFT over its own)."""
    from atom_core.engine import Engine, SamplingParams

    cfg = load_config(args.model)
    # 16k tokens, or as many as the model's positions allow (Llama-3-8B: 8,192)
    max_model_len = min(17000, cfg.get("max_position_embeddings", 17000))
    lengths = (128, min(16384, max_model_len - 16))
    rows = []
    for quantization in [None] + ([args.quantization] if args.quantization else []):
        model = build_bench_model(cfg, quantization)
        engine = Engine(model, None, device="cuda", max_num_seqs=16, max_model_len=max_model_len,
                        max_num_batched_tokens=16384, num_kv_blocks=4 * max_model_len // 16)
        for num_tokens in lengths:
            times = []
            for i in range(6):
                prompt = [(i * 7919 + t) % 10000 for t in range(num_tokens)]  # no prefix-cache hit
                _sync()
                t0 = time.perf_counter()
                engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
                outs = engine.step()
                _sync()
                times.append((time.perf_counter() - t0) * 1e3)
                assert len(outs) == 1 and outs[0].finished
            row = {"model": args.model, "quantization": quantization or "bf16", "prompt_tokens": num_tokens,
                   "system": "atom_core", "ttft_ms": float(np.median(times[1:]))}
            base = next((r for r in rows if r["quantization"] == "bf16" and r["prompt_tokens"] == num_tokens), None)
            if quantization and base is not None:
                row["vs_bf16"] = base["ttft_ms"] / row["ttft_ms"]
            rows.append(row)
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    if not args.no_hf:
        for num_tokens in lengths:
            hf_ms = _hf_forward_ms(cfg, num_tokens)
            for ours in (r for r in rows if r["prompt_tokens"] == num_tokens):
                ours["hf_sdpa_forward_ms"] = hf_ms
                ours["vs_hf"] = ours["ttft_ms"] / hf_ms
    return rows


# ---------------------------------------------------------------------------------------- host overhead

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--section", choices=["throughput", "atom-core-runs", "latency", "ttft", "host", "profile",
                                              "tp"],
                        required=True)
    parser.add_argument("--label", default=None, help="system name in the rows of --section atom-core-runs")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV pool: auto (the model's dtype) or fp8")
    parser.add_argument("--tp-sizes", type=int, nargs="*", default=[1, 2],
                        help="--section tp: the tensor-parallel sizes run, in order (the first run is the vs_first "
                             "base; none: only the EP runs)")
    parser.add_argument("--ep-sizes", type=int, nargs="*", default=None,
                        help="--section tp: the expert-parallel sizes a MoE model runs (default: the TP sizes above 1; "
                             "none: no EP run)")
    parser.add_argument("--smoke", action="store_true",
                        help="--section tp: a CPU-sized model of the family and 4 short requests (a check)")
    parser.add_argument("--ep-modes", nargs="*", default=["all_reduce", "all_to_all"],
                        choices=["all_reduce", "all_to_all"],
                        help="--section tp: a MoE model also runs expert-parallel over the TP ranks in each of these "
                             "(none: TP only)")
    parser.add_argument("--device", default="cuda", help="--section tp: cuda (one GPU per rank) or cpu (a check)")
    parser.add_argument("--dtype", default="bfloat16", help="--section tp: the model's dtype")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="throughput / latency: also run the model quantized (dummy weights) against bf16: fp8, "
                             "fp8_block, or config (the config's quantization_config, e.g. gpt-oss MXFP4); "
                             "tp / profile: run it quantized only")
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--profile-bs", type=int, default=256, help="--section profile: running requests")
    parser.add_argument("--profile-rows", type=int, default=12, help="--section profile: kernels listed")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--hf-seqs", type=int, default=64, help="sequences of the workload HF runs (it is slow)")
    parser.add_argument("--hf-max-tokens", type=int, default=None,
                        help="cap on the output lengths of the subset HF runs (a large model's HF run is slow)")
    parser.add_argument("--hf-timeout", type=int, default=45, help="seconds each HF path may take")
    parser.add_argument("--no-hf", action="store_true", help="--section ttft: leave out HF's forward")
    parser.add_argument("--latency-models", nargs="+", default=["qwen3-0.6b", "llama-3-8b"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from benchmarks.engine_step import section_host, section_profile

    rows = {"throughput": section_throughput, "atom-core-runs": section_atom_core_runs, "latency": section_latency,
            "ttft": section_ttft, "host": section_host, "profile": section_profile, "tp": section_tp}[args.section](args)
    print_table(rows)
    if args.json:
        write_json(rows, args.json)


if __name__ == "__main__":
    main()
