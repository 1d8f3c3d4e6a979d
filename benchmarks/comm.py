"""Communication benchmarks over N ranks: the all-reduce at a model's hidden size for 1..256 tokens, our op
path (``ops.all_reduce``) against ``torch.distributed.all_reduce`` in the same run (and, on GPUs, torch's
symmetric-memory one-shot all-reduce: ``one_shot_us``, what a custom small-message backend would reach);
and one MoE layer's expert-parallel combine, all-reduce against all-to-all (padded and exact exchanges), at the same token
counts and at prefill sizes.

    python -m benchmarks.comm --nproc 2                          # GPUs: NCCL, one spawned rank per GPU
    torchrun --nproc-per-node 2 -m benchmarks.comm               # the same under torchrun
    python -m benchmarks.comm --nproc 2 --section moe --json r.json   # EP all-reduce vs all-to-all only
    python -m benchmarks.comm --device cpu --smoke               # a gloo check on the CPU (2 ranks)

Each figure is the median over ``--repeats`` windows of the slowest rank's mean time per call
(microseconds) in a window of ``--iters`` calls, every rank starting the window after a barrier.
On CUDA the all-reduce is timed both eagerly (a host launch per call) and replayed from one CUDA graph
holding ``--iters`` calls (what the engine's captured decode steps pay); ``ops_vs_torch`` is
torch's time over ours (1.0: the op adds nothing). ``busbw_GBps`` is NCCL-tests' bus bandwidth,
``2 (R - 1) / R * bytes / time``. The MoE rows time the ``FusedMoE`` layer's forward (experts
included) with dummy weights of the model's shapes and uniform random routing; ``vs_all_reduce`` is
the all-reduce layer's time over this one. Rank 0 prints the table and writes ``--json`` (rows and
``run_metadata``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import shlex
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.common import _first_cause, _reason, print_table, write_json
from benchmarks.engine import load_config

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MOE_TOKENS = TOKENS + (1024, 4096)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_us(fn, *, iters: int, repeats: int, device: torch.device, group) -> float:
    """Median over ``repeats`` windows of the slowest rank's mean microseconds per ``fn()`` call."""
    means = []
    for _ in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        mean = torch.tensor([(time.perf_counter() - t0) / iters * 1e6], dtype=torch.float64)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=group)  # (over the gloo group: host floats)
        means.append(mean.item())
    return statistics.median(means)


def _graph_us(fn, *, iters: int, repeats: int, device: torch.device, group) -> float:
    """As ``_timed_us``, replaying one CUDA graph of ``iters`` calls of ``fn``."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up on the side stream, as torch's capture recipe asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    return _timed_us(graph.replay, iters=1, repeats=repeats, device=device, group=group) / iters


def _symm_mem_one_shot(x: torch.Tensor, group):
    """(fn, note): torch's symmetric-memory one-shot all-reduce of ``x`` over ``group`` (every rank reads
    its peers' buffers over NVLink and sums: the candidate for a small-message backend beside NCCL), or
    (None, why not). Setting it up is collective: every rank gets the same answer or the same error."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buffer, group.group_name)
        fn = functools.partial(torch.ops.symm_mem.one_shot_all_reduce_copy, buffer, x.view(-1), "sum",
                               group.group_name)
        fn()
        return fn, "symm_mem.one_shot_all_reduce_copy"
    except Exception as e:  # noqa: BLE001 - reported in the row: a torch build or machine without it
        return None, f"not run: {_reason(e)}"


def section_all_reduce(args, device, group, control) -> list[dict]:
    from atom_core import ops

    ranks = group.size()
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.models:
        hidden = load_config(name)["hidden_size"] if not args.smoke else 64
        for tokens in args.tokens:
            x = torch.zeros(tokens, hidden, dtype=dtype, device=device)  # zeros: the sums stay finite
            nbytes = x.numel() * x.element_size()
            ours = functools.partial(ops.all_reduce, x, group)  # (in place: x is donated and returned)
            theirs = functools.partial(dist.all_reduce, x, group=group)
            for fn in (ours, theirs):  # warm-up: the communicator, the op's backend choice
                fn()
            one_shot, one_shot_note = _symm_mem_one_shot(x, group) if device.type == "cuda" else (None, "no GPU")
            modes = [("eager", _timed_us)] + ([("graph", _graph_us)] if device.type == "cuda" else [])
            for mode, timer in modes:
                timing = {"iters": args.iters, "repeats": args.repeats, "device": device, "group": control}
                ours_us, torch_us = timer(ours, **timing), timer(theirs, **timing)
                one_shot_us, note = None, one_shot_note
                if one_shot is not None:
                    try:
                        one_shot_us = timer(one_shot, **timing)
                    except Exception as e:  # noqa: BLE001 - e.g. a capture it does not allow: said in the row
                        note = f"{mode} not run: {_reason(_first_cause(e))}"
                rows.append({"section": "all_reduce", "model": name, "hidden": hidden, "tokens": tokens,
                             "dtype": args.dtype, "bytes": nbytes, "ranks": ranks, "mode": mode,
                             "ops_us": ours_us, "torch_us": torch_us, "ops_vs_torch": torch_us / ours_us,
                             "busbw_GBps": 2 * (ranks - 1) / ranks * nbytes / (torch_us * 1e-6) / 1e9,
                             "one_shot_us": one_shot_us,
                             "one_shot_vs_torch": None if one_shot_us is None else torch_us / one_shot_us,
                             "one_shot_note": note})
                if dist.get_rank() == 0:
                    print(rows[-1], flush=True)
    return rows


def _moe_layers(cfg: dict, device, dtype, group, smoke: bool):
    """The MoE layer of ``cfg`` split over ``group`` both ways (EP all-reduce, EP all-to-all), dummy weights."""
    from atom_core.models.layers.moe import FusedMoE

    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"]
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    if smoke:
        experts, hidden, inter = 8, 64, 32
    ranks, rank = group.size(), group.rank()
    layers = {}
    for comm in ("all_reduce", "all_to_all"):
        with torch.device(device):
            layer = FusedMoE(experts, hidden, inter, ep_rank=rank, ep_size=ranks, group=group, ep_comm=comm,
                             dtype=dtype)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        layers[comm] = layer
    return layers, experts, hidden


def section_moe(args, device, group, control) -> list[dict]:
    """One MoE layer's forward over the EP group: all-reduce, all-to-all padded, all-to-all exact."""
    from atom_core.models.layers.expert_exchange import expected_fill

    dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.moe_models:
        cfg = load_config(name)
        top_k = 2 if args.smoke else cfg["num_experts_per_tok"]
        layers, experts, hidden = _moe_layers(cfg, device, dtype, group, args.smoke)
        for tokens in args.moe_tokens:
            gen = torch.Generator(device=device).manual_seed(tokens)  # the same routing on every rank
            x = torch.randn(tokens, hidden, dtype=dtype, device=device, generator=gen)
            logits = torch.randn(tokens, experts, device=device, generator=gen)
            weights, ids = torch.topk(logits.softmax(-1), top_k)
            ids = ids.int()
            variants = [("all_reduce", "-"), ("all_to_all", "padded"), ("all_to_all", "exact")]
            base = None
            for comm, exchange in variants:
                layer = layers[comm]
                layer.ep_exchange = "auto" if exchange == "-" else exchange
                fn = functools.partial(layer, x, weights, ids)
                fn()
                us = _timed_us(fn, iters=max(1, args.iters // 5), repeats=args.repeats, device=device,
                               group=control)
                base = base or us
                rows.append({"section": "moe", "model": name, "experts": experts, "top_k": top_k, "hidden": hidden,
                             "tokens": tokens, "ranks": group.size(), "ep_comm": comm, "exchange": exchange,
                             "layer_us": us, "vs_all_reduce": base / us,
                             "expected_fill": expected_fill(experts, top_k, group.size())})
                if dist.get_rank() == 0:
                    print(rows[-1], flush=True)
    return rows


def run(args) -> None:
    """One rank (the world is initialized): time, then rank 0 reports."""
    rank = dist.get_rank()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    group = dist.group.WORLD
    control = dist.new_group(backend="gloo") if args.device == "cuda" else group  # host-side barriers and maxima
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])  # (creates the NCCL communicator)
    rows = []
    if args.section in ("all_reduce", "all"):
        rows += section_all_reduce(args, device, group, control)
    if args.section in ("moe", "all"):
        rows += section_moe(args, device, group, control)
    if rank == 0:
        print_table([r for r in rows if r["section"] == "all_reduce"])
        print_table([r for r in rows if r["section"] == "moe"])
        if args.json:
            write_json(rows, args.json, command=getattr(args, "command", None))
    # Every rank leaves together: a gloo rank that tore its group down while another still used it was
    # aborted ("terminate called without an active exception").
    dist.barrier(group=control)


def _spawned(rank: int, world: int, init_file: str, args) -> None:
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        run(args)
    except BaseException:
        dist.destroy_process_group()
        raise
    if args.device != "cuda":
        # A gloo rank can still abort in its group's teardown when its peer closed the connection first, even
        # after the barrier that ends run() ("terminate called without an active exception", once under a loaded
        # CI machine): a spawned CPU rank leaves without tearing gloo down (the process ends here anyway).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", choices=["all_reduce", "moe", "all"], default="all")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "llama-3-8b"],
                        help="all-reduce at these configs' hidden sizes")
    parser.add_argument("--moe-models", nargs="+", default=["qwen3-30b-a3b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=list(MOE_TOKENS))
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and counts (a CPU check)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.smoke:
        args.tokens, args.moe_tokens, args.iters, args.repeats = [1, 5], [1, 5], 5, 2
        args.models, args.moe_models = args.models[:1], args.moe_models[:1]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=300))
        try:
            run(args)
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    args.command = shlex.join(getattr(sys, "orig_argv", sys.argv))  # (rank 0 writes the results: a spawned child)

    with tempfile.TemporaryDirectory() as tmp:
        # spawned on the CPU too: a rank forked from a process that has used CUDA could not read the GPU's name
        # for the result file's metadata
        mp.start_processes(_spawned, args=(args.nproc, os.path.join(tmp, "init"), args), nprocs=args.nproc,
                           join=True, start_method="spawn")


if __name__ == "__main__":
    main()
