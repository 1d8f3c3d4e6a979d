"""Data parallelism: the nano-vllm workload on one engine and on M engine replicas behind one front
(``Engine.from_pretrained(..., data_parallel_size=M)``), in the same run.

    python -m benchmarks.engine_dp                                   # 2 GPUs: Qwen3-0.6B shapes, 1 vs 2 replicas
    python -m benchmarks.engine_dp --data-parallel-size 2 --json benchmarks/results/h200x2_engine_dp.json
    python -m benchmarks.engine_dp --model qwen3-30b-a3b --tensor-parallel-size 2 --data-parallel-size 2  # 4 GPUs
    python -m benchmarks.engine_dp --device cpu --smoke              # a check of the script on a CPU

Rows: ``one engine`` (``Engine.from_pretrained`` in this process: what a user runs without data
parallelism, the baseline), ``front, 1 replica`` (the same engine in a replica process behind the front:
what the front costs; ``--no-front-1`` leaves it out) and ``front, M replicas``; ``vs_one_engine`` is a
row's throughput over the baseline's. ``steps`` / ``ms_per_step``: per engine, its ``step()`` calls in
the timed run and their mean wall time (M replicas scale by about ``steps x ms`` of one engine over the
slowest replica's: the step time at 1/M of the rows is what data parallelism buys). Each system builds its engine(s), runs a warm-up ``generate`` of 8
short requests, then the whole workload once (timed: output tokens / wall time of ``generate``).

Weights are dummy (random, drawn by each replica: the tokens differ between systems, their count does
not: EOS is ignored), the shapes from benchmarks/configs/. The nano-vllm workload (benchmarks/engine.py):
seed 0, 256 sequences, prompt and output lengths uniform in [100, 1024], random token ids < 10000,
temperature 0.6.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import print_table, write_json
from benchmarks.engine import _config_folder, load_config, nano_vllm_workload

# --smoke: a CPU-sized model of the same family and a handful of short requests.
SMOKE_SHAPES = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 1,
                "max_position_embeddings": 256, "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32}  # (the last three: MoE configs only)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_system(label: str, folder: Path, args, prompts, output_lens, data_parallel_size: int | None) -> dict:
    """Build the system (``data_parallel_size`` None: one ``Engine`` in this process), warm it up, time the
    workload; the engine(s) are stopped and freed before returning."""
    from atom_core.engine import DataParallelEngine, Engine, SamplingParams

    dtype = getattr(torch, args.dtype)
    engine_args = {"load_format": "dummy", "dtype": dtype, "device": args.device,
                   "tensor_parallel_size": args.tensor_parallel_size, "expert_parallel": args.expert_parallel}
    if args.smoke:
        engine_args |= {"max_model_len": 64, "max_num_seqs": 16}
    dp_attention = args.dp_attention and data_parallel_size is not None and data_parallel_size > 1
    if args.dp_attention and not dp_attention:  # the baselines: the whole model on one GPU
        engine_args["expert_parallel"] = False
    t0 = time.perf_counter()
    if data_parallel_size is None:
        engine = Engine.from_pretrained(folder, **engine_args)
    else:  # (the front itself, so that one replica is behind a front too)
        engine = DataParallelEngine(folder, data_parallel_size=data_parallel_size, dp_attention=dp_attention,
                                    **engine_args)
    construct_s = time.perf_counter() - t0
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
    steps = [0, 0.0]  # one engine's step() calls in the timed run and their time
    if data_parallel_size is None:
        step = engine.step

        def timed_step():
            start = time.perf_counter()
            try:
                return step()
            finally:
                steps[0] += 1
                steps[1] += time.perf_counter() - start

    with engine:
        engine.generate([p[:16] for p in prompts[:8]], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8),
                        use_tqdm=False)  # warm-up
        if data_parallel_size is None:
            engine.step = timed_step  # (generate calls self.step)
            before = None
        else:
            before = engine.requests_per_replica, engine.replica_stats()
        _sync(args.device)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        _sync(args.device)
        seconds = time.perf_counter() - t0
        if data_parallel_size is None:
            preemptions, per_replica, step_counts = engine.num_preemptions, [len(prompts)], [steps]
        else:
            after = engine.replica_stats()
            preemptions = sum(a["num_preemptions"] - b["num_preemptions"] for a, b in zip(after, before[1]))
            per_replica = [n - b for n, b in zip(engine.requests_per_replica, before[0])]  # the workload's only
            step_counts = [(a["steps"] - b["steps"], a["step_seconds"] - b["step_seconds"])
                           for a, b in zip(after, before[1])]
    tokens = sum(len(o.token_ids) for o in outs)
    row = {"model": args.model, "system": label + (", DP attention" if dp_attention else ""),
           "replicas": data_parallel_size or 1, "tp": args.tensor_parallel_size,
           "seqs": len(prompts), "output_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
           "construct_s": construct_s, "preemptions": preemptions,
           "requests_per_replica": "/".join(map(str, per_replica)),
           # per engine: steps of the timed run and the mean wall time of one engine.step() call
           "steps": "/".join(str(n) for n, _ in step_counts),
           "ms_per_step": "/".join(f"{t / max(n, 1) * 1e3:.2f}" for n, t in step_counts)}
    print(row, flush=True)
    del engine, outs
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a config of benchmarks/configs")
    parser.add_argument("--data-parallel-size", type=int, default=2, help="replicas of the data-parallel row")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks of every engine (GPUs each)")
    parser.add_argument("--expert-parallel", nargs="?", const="all_reduce", default=False,
                        choices=["all_reduce", "all_to_all"],
                        help="a MoE model's experts split whole over each engine's TP ranks, combined by this exchange")
    parser.add_argument("--dp-attention", action="store_true",
                        help="the M-replica row as DP attention (a MoE model: the replicas split the experts, "
                             "all-to-all, eager; engine/dp_attention.py); the other rows hold the whole model")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--device", default="cuda", help="cuda (one GPU per rank) or cpu")
    parser.add_argument("--dtype", default=None, help="the model's dtype (default bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--no-front-1", action="store_true", help="leave out the front's 1-replica row")
    parser.add_argument("--smoke", action="store_true", help="a CPU-sized model and 8 short requests (a check)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.dp_attention:
        args.expert_parallel, args.tensor_parallel_size = "all_to_all", 1
    cfg = load_config(args.model)
    if args.smoke:
        cfg |= SMOKE_SHAPES
        prompts, output_lens = nano_vllm_workload(num_seqs=min(args.num_seqs, 8), min_len=4, max_len=24, vocab=1000)
    else:
        prompts, output_lens = nano_vllm_workload(num_seqs=args.num_seqs)
    # The replicas first (processes of their own, gone when their front stops), the engine of this process
    # last: an engine built here first kept its GPU's memory past its run, and replica 0 (on the same GPU)
    # found no room for its KV pool.
    systems = [(f"front, {args.data_parallel_size} replicas", args.data_parallel_size)]
    if not args.no_front_1:
        systems.append(("front, 1 replica", 1))
    systems.append(("one engine", None))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = _config_folder(cfg, Path(tmp) / args.model)
        for label, data_parallel_size in systems:
            rows.append(run_system(label, folder, args, prompts, output_lens, data_parallel_size))
    rows.reverse()  # the one engine first: the baseline
    for row in rows:
        row["vs_one_engine"] = row["tok_per_s"] / rows[0]["tok_per_s"]
    print_table(rows)
    if args.json:
        write_json(rows, args.json)
    return rows


if __name__ == "__main__":
    main()
