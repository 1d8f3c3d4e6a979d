"""Timing helpers shared by the benchmark scripts: medians of timed runs, copy bandwidth, tables."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import torch


def bench(fn: Callable[[], object], *, warmup: int = 5, iters: int = 50, device: str = "cuda",
          graph: bool = True, calls_per_replay: int = 10) -> float:
    """Median milliseconds of one ``fn()``.

    On CUDA with ``graph=True``, ``calls_per_replay`` calls are captured in one CUDA graph and the
    replays are timed with events: the figure is the GPU's time alone, without Python's launch
    overhead (which the engine removes the same way). Falls back to timing eager calls when
    capture fails. L2 is not flushed (steady state).
    """
    for _ in range(warmup):
        fn()
    if not device.startswith("cuda"):
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    run, per_run = fn, 1
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls_per_replay):
                    fn()
            run, per_run = g.replay, calls_per_replay
        except Exception:  # noqa: BLE001 - not capturable: time it eagerly
            torch.cuda.synchronize()
    times = []
    for _ in range(max(iters // per_run, 5)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_run)
    return statistics.median(times)


def copy_bandwidth_gbs(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written (the practical HBM ceiling)."""
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), warmup=3, iters=20, device=device, graph=False)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def print_table(rows: list[dict], columns: list[str] | None = None) -> None:
    if not rows:
        print("(no rows)")
        return
    columns = columns or list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_json(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def op_bench_args(description: str, add_flags: Callable[[argparse.ArgumentParser], None] | None = None):
    """Parse the flags every op benchmark takes (--device, --json, --smoke) plus ``add_flags``'.

    On the CPU the Triton kernels run in Triton's interpreter, which must be switched on before any
    kernel is defined: the benchmark scripts import the kernels only after this returns.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write the rows to this path")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no torch.compile (CPU check)")
    if add_flags is not None:
        add_flags(parser)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args


def adaptive_timer(device: str, smoke: bool) -> Callable:
    """``timed(fn, graph=True)`` -> median ms of ``fn`` (``bench``; on CUDA with ``graph``, GPU time
    of CUDA-graph replays). Slow baselines get fewer iterations (about 0.5 s of timing each);
    ``smoke`` sizes get two."""

    def timed(fn, graph=True):
        if smoke:
            return bench(fn, warmup=1, iters=2, device=device, graph=graph)
        first = bench(fn, warmup=1, iters=1, device=device, graph=False)
        iters = int(min(100, max(3, 500 / max(first, 1e-3))))
        return bench(fn, warmup=min(10, iters), iters=iters, device=device, graph=graph)

    return timed


def guarded(timed: Callable, make_fn: Callable[[], Callable], **timing) -> float | None:
    """``timed(make_fn(), **timing)``; None, with the reason printed, when building or timing the
    baseline fails (out of memory, does not compile)."""
    try:
        return timed(make_fn(), **timing)
    except Exception as e:  # noqa: BLE001 - a baseline that fails is reported, not fatal
        print(f"baseline skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def ratio(base_ms: float | None, ms: float | None) -> float | None:
    """``base_ms / ms`` (the speedup over a baseline), None when either is missing."""
    return None if base_ms is None or ms is None else base_ms / ms


def bandwidth_row(labels: dict, *, ms: float, nbytes: int, copy_gbs: float, eager_ms: float,
                  compile_ms: float | None) -> dict:
    """One op-benchmark row: ``labels``, the op's time, its bandwidth (GB/s, 1e9 bytes/s, and % of
    the measured copy bandwidth), and the eager twin / torch.compile baselines as time and ratio."""
    gbs = nbytes / (ms * 1e-3) / 1e9
    return {**labels, "ms": ms, "GB/s": gbs, "%copy": 100 * gbs / copy_gbs,
            "eager_ms": eager_ms, "x_eager": eager_ms / ms,
            "compile_ms": compile_ms, "x_compile": ratio(compile_ms, ms)}


def report(rows: list[dict], columns: list[str], json_path: str | None) -> None:
    """Print the table; write the rows as JSON when a path is given."""
    print_table(rows, columns)
    if json_path:
        write_json(rows, json_path)
