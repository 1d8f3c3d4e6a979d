"""Timing helpers shared by the benchmark scripts: medians of timed runs, copy bandwidth, tables, and
the metadata every result file carries.

Timing. ``bench_timed(fn, ...) -> Timing(ms, mode)`` is the one timer; ``mode`` says how the figure
was taken, so a row can say it:

* ``"graph"``: GPU time of CUDA-graph replays (``calls_per_replay`` calls per replay), no launch
  overhead;
* ``"eager (graph capture failed: <reason>)"``: capture was asked for and failed (a host sync, a
  data-dependent size); eager calls were timed with CUDA events instead, launch gaps included;
* ``"eager (graph=False)"``: eager calls timed with CUDA events, by request;
* ``"eager (cpu)"`` (``"eager (<device>)"`` on any non-CUDA device): wall-clock time of eager calls.

``bench(...) -> float`` (``bench_timed(...).ms``) and ``adaptive_timer`` (the same over
``adaptive_timing``) keep the old float API. Ours and every baseline of a row are timed through
the same call with the same ``graph`` request; ``timing_column`` turns their ``Timing``s into the
row's ``timing`` column: one mode when all agree, else which column was timed how. A script that
still uses the float API adopts the new one in three lines::

    timed = adaptive_timing(device, smoke)          # was adaptive_timer(device, smoke)
    t, base = timed(fn), guarded(timed, make_base)  # Timing / Timing | None (guarded is unchanged)
    row = {"ms": t.ms, "base_ms": ms_of(base), "x_base": ratio(ms_of(base), t.ms),
           "timing": timing_column({"ms": t, "base_ms": base})}

Result files. ``write_json`` (and ``report``) write ``{"meta": run_metadata(), "rows": rows}``;
``run_metadata`` says on what and from which commit the rows were measured, and whether Triton's
cache was empty when the process started (cold) or not (warm): see ``triton_cache_state``. Files
written before this were a bare list of rows; ``benchmarks.to_markdown.load_result`` reads both.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def runs_on(backend: str, device) -> bool:
    """Whether ``backend``'s kernels can run on ``device``: the backend is available here and can read that
    device's tensors (a GPU's; for Triton also the CPU's, under its interpreter). On a GPU machine
    ``backend_available("triton")`` is True, but Triton is then no backend for ``--device cpu``."""
    from atom_core.ops.dispatch import backend_available, triton_interpret

    if not backend_available(backend):
        return False
    return torch.device(device).type == "cuda" or (backend == "triton" and triton_interpret())


def require_triton_on(device, what: str) -> None:
    """Exit naming ``what`` when Triton cannot run on ``device`` (see :func:`runs_on`)."""
    if not runs_on("triton", device):
        raise SystemExit(f"{what} times Triton kernels, which cannot run on {device} here (they need a GPU, or "
                         "TRITON_INTERPRET=1 for the CPU)")


def kernel_backend(device) -> str:
    """The backend a benchmark times on ``device``: Triton where it runs there, else the torch twin."""
    return "triton" if runs_on("triton", device) else "torch"


def triton_cache_state() -> dict:
    """Where Triton caches compiled kernels and whether that cache is empty now.

    ``dir``: ``TRITON_CACHE_DIR``, else Triton's default ``$TRITON_HOME/.triton/cache`` (``TRITON_HOME``
    defaults to the home directory); ``empty``: the directory is missing or has no entries;
    ``state``: ``"cold"`` when empty (every kernel the run uses compiles in it), else ``"warm"``.
    """
    cache_dir = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME", os.path.expanduser("~")), ".triton", "cache")
    try:
        empty = not any(os.scandir(cache_dir))
    except OSError:  # missing (or unreadable): nothing cached there
        empty = True
    return {"dir": cache_dir, "empty": empty, "state": "cold" if empty else "warm"}


# Taken once, when the first benchmark module imports this one, before any kernel is compiled:
# the cold/warm marker of the whole process.
TRITON_CACHE_AT_START = triton_cache_state()


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> dict:
    """``{"commit": sha, "dirty": bool}`` of the working tree (``git rev-parse HEAD``; dirty = tracked
    files differ from HEAD). ``ATOM_CORE_COMMIT`` in the environment wins (a copy of a commit run
    outside its repository says which it is; ``dirty`` is then None, not known); without git or a
    repository, ``"unknown"``."""
    if os.environ.get("ATOM_CORE_COMMIT"):
        return {"commit": os.environ["ATOM_CORE_COMMIT"], "dirty": None}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


def run_metadata() -> dict:
    """What a result file says about the run that produced it.

    ``gpu``: device name of GPU 0, or ``"cpu"`` where torch sees none; ``cuda`` / ``hip``: the
    toolkit versions torch was built with (None when not that build); ``torch``, ``triton``,
    ``transformers``, ``python``: versions (None when not installed); ``commit`` / ``dirty``: see
    ``git_commit``; ``hostname``; ``utc``: when the rows were written (ISO 8601);
    ``command``: the command line of the process; ``triton_cache``: ``TRITON_CACHE_AT_START``
    (``dir``, ``empty``, ``state`` = "cold" | "warm" at process start).
    """
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "torch": torch.__version__,
        "triton": _package_version("triton"),
        "transformers": _package_version("transformers"),
        "python": sys.version.split()[0],
        **git_commit(),
        "hostname": socket.gethostname(),
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "triton_cache": dict(TRITON_CACHE_AT_START),
    }


@dataclass(frozen=True)
class Timing:
    """One timed figure: ``ms``, the median milliseconds of one call, and ``mode``, how it was taken
    (``"graph"``, ``"eager (graph capture failed: <reason>)"``, ``"eager (graph=False)"`` or
    ``"eager (<device>)"`` such as ``"eager (cpu)"``; see the module docstring)."""

    ms: float
    mode: str


def bench_timed(fn: Callable[[], object], *, warmup: int = 5, iters: int = 50, device: str = "cuda",
                graph: bool = True, calls_per_replay: int = 10) -> Timing:
    """Median milliseconds of one ``fn()`` and how they were timed.

    On CUDA with ``graph=True``, ``calls_per_replay`` calls are captured in one CUDA graph and the
    replays are timed with events: the figure is the GPU's time alone, without Python's launch
    overhead (which the engine removes the same way). When capture fails, eager calls are timed
    with events and the mode gives the reason. On other devices, wall-clock time of eager calls.
    L2 is not flushed (steady state); the ``warmup`` calls come first, so the figure is warm.
    """
    for _ in range(warmup):
        fn()
    if not device.startswith("cuda"):
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return Timing(statistics.median(times), f"eager ({device})")
    torch.cuda.synchronize()
    run, per_run, mode = fn, 1, "eager (graph=False)"
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls_per_replay):
                    fn()
            run, per_run, mode = g.replay, calls_per_replay, "graph"
        except Exception as e:  # noqa: BLE001 - not capturable: time it eagerly, and say why
            _recover_from_failed_capture()
            mode = f"eager (graph capture failed: {_reason(_first_cause(e))})"
    times = []
    for _ in range(max(iters // per_run, 5)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_run)
    return Timing(statistics.median(times), mode)


def bench(fn: Callable[[], object], *, warmup: int = 5, iters: int = 50, device: str = "cuda",
          graph: bool = True, calls_per_replay: int = 10) -> float:
    """``bench_timed(...).ms``: the median milliseconds alone, without the mode (the older API)."""
    return bench_timed(fn, warmup=warmup, iters=iters, device=device, graph=graph,
                       calls_per_replay=calls_per_replay).ms


def _recover_from_failed_capture() -> None:
    """Make CUDA usable after a capture that raised. The capture registered the device's default
    random generator; its closing step never ran, so the generator still counts itself as captured
    and the next random op outside a graph fails ("Offset increment outside graph capture
    encountered unexpectedly"). A fresh copy of its state (same seed and offset) is not captured."""
    torch.cuda.synchronize()
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    if hasattr(generator, "graphsafe_set_state"):  # torch >= 2.4
        generator.graphsafe_set_state(generator.clone_state())


def _first_cause(e: BaseException) -> BaseException:
    """The error that started a chain: a capture that fails inside ``fn`` raises again when the
    graph's context closes ("operation failed due to a previous error during capture"), with the
    informative first error as its ``__context__``."""
    seen = {id(e)}
    while e.__context__ is not None and id(e.__context__) not in seen:
        e = e.__context__
        seen.add(id(e))
    return e


def _reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:100] if lines else ''}".rstrip(": ")


def ms_of(timing: Timing | None) -> float | None:
    """``timing.ms``, None for a missing (skipped) figure."""
    return None if timing is None else timing.ms


def timing_column(timings: dict[str, Timing | None]) -> str:
    """A row's ``timing`` cell from its timed columns (``{"ms": ours, "eager_ms": twin, ...}``).

    The shared mode when every present figure was timed the same way (``"graph"``); otherwise each
    mode with the columns it applies to, ``"ms: graph; compile_ms: eager (graph capture failed:
    ...)"``. Missing figures (None) are left out."""
    columns_by_mode: dict[str, list[str]] = {}
    for column, timing in timings.items():
        if timing is not None:
            columns_by_mode.setdefault(timing.mode, []).append(column)
    if len(columns_by_mode) <= 1:
        return next(iter(columns_by_mode), "")
    return "; ".join(f"{', '.join(columns)}: {mode}" for mode, columns in columns_by_mode.items())


def copy_bandwidth_gbs(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written (the practical HBM ceiling)."""
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), warmup=3, iters=20, device=device, graph=False)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def print_table(rows: list[dict], columns: list[str] | None = None) -> None:
    """Right-aligned plain-text table of ``columns`` (default: the first row's keys)."""
    if not rows:
        print("(no rows)")
        return
    columns = columns or list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_json(rows: list[dict], path: str, *, command: str | None = None) -> None:
    """Write ``{"meta": run_metadata(), "rows": rows}`` to ``path`` (see ``run_metadata``), its folder made if
    missing (a run must not end in a FileNotFoundError after its timings). ``command``: the command line to
    record when this process is not the one the user started (a spawned rank)."""
    meta = run_metadata() | ({"command": command} if command is not None else {})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


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


def adaptive_timing(device: str, smoke: bool) -> Callable[..., Timing]:
    """``timed(fn, graph=True)`` -> ``Timing`` of ``fn`` (``bench_timed``; on CUDA with ``graph``, GPU
    time of CUDA-graph replays, else the eager fallback and its reason). Slow baselines get fewer
    iterations (about 0.5 s of timing each); ``smoke`` sizes get two."""

    def timed(fn, graph=True) -> Timing:
        if smoke:
            return bench_timed(fn, warmup=1, iters=2, device=device, graph=graph)
        first = bench(fn, warmup=1, iters=1, device=device, graph=False)
        iters = int(min(100, max(3, 500 / max(first, 1e-3))))
        return bench_timed(fn, warmup=min(10, iters), iters=iters, device=device, graph=graph)

    return timed


def adaptive_timer(device: str, smoke: bool) -> Callable[..., float]:
    """``timed(fn, graph=True)`` -> median ms of ``fn``: ``adaptive_timing`` without the mode."""
    timing = adaptive_timing(device, smoke)
    return lambda fn, graph=True: timing(fn, graph).ms


def guarded(timed: Callable, make_fn: Callable[[], Callable], **timing):
    """``timed(make_fn(), **timing)`` (a float or a ``Timing``, as ``timed`` returns); None, with the
    reason printed, when building or timing the baseline fails (out of memory, does not compile)."""
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
                  compile_ms: float | None, timing: str | None = None) -> dict:
    """One op-benchmark row: ``labels``, the op's time, its bandwidth (GB/s, 1e9 bytes/s, and % of
    the measured copy bandwidth), and the baselines as time and ratio: ``eager_ms`` the reference
    twin run by eager PyTorch (not compiled), ``compile_ms`` the twin under ``torch.compile``.
    ``timing`` (``timing_column`` of the three), when given, says how the figures were timed."""
    gbs = nbytes / (ms * 1e-3) / 1e9
    row = {**labels, "ms": ms, "GB/s": gbs, "%copy": 100 * gbs / copy_gbs,
           "eager_ms": eager_ms, "x_eager": eager_ms / ms,
           "compile_ms": compile_ms, "x_compile": ratio(compile_ms, ms)}
    if timing is not None:
        row["timing"] = timing
    return row


def report(rows: list[dict], columns: list[str], json_path: str | None) -> None:
    """Print the table; write the rows and ``run_metadata()`` as JSON when a path is given."""
    print_table(rows, columns)
    if json_path:
        write_json(rows, json_path)
