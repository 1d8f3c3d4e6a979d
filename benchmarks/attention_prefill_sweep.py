"""Long causal prefill through the unified paged-attention kernel against SDPA: a tile-config sweep.

For each shape (model heads x prompt length; one row, no cached prefix, block size 16, bf16, blocks
scattered over the pool) the script

1. checks every variant's output against SDPA's on the same random inputs (relative error
   ``|out - ref| / |ref|`` over the whole output, < 2e-2; NaN fails); a candidate config is also
   checked against the reference twin on a small mixed batch (cached prefixes, a sliding window
   that starts mid-tile, softcap, sinks, a page size that divides BLOCK_N and one that does not).
   A variant that fails is reported, not timed;
2. times each variant with CUDA events after warm-up (back-to-back calls between two events, so
   Python's launch cost hides behind the GPU; median of several runs);
3. prints one table: shape, variant, ms, TFLOP/s (4 * T^2 / 2 * D * Hq per layer), ``vs_flash`` =
   SDPA-flash ms / variant ms (> 1: faster than SDPA), relative error; then the best config per
   shape and the config with the best geometric-mean ``vs_flash`` over all shapes.

Variants: ``sdpa_flash`` (torch SDPA forced to the FlashAttention backend, is_causal=True, on the
same tokens laid out densely, K/V heads repeated to Hq), ``sdpa_cudnn`` (the cuDNN backend, when it
runs), ``old`` (the kernel as of ``OLD_REV``, read with ``git show``), ``new default`` (what
``paged_attention`` launches today) and ``new <BLOCK_M>x<BLOCK_N> w<warps> s<stages>`` per candidate.

    python -m benchmarks.attention_prefill_sweep [--json OUT.json] [--smoke]

``--smoke`` runs one tiny shape on the CPU (Triton interpreter) so the script can be checked there.
About 2-3 minutes on an H200 (each Triton config compiles once per head group, 1-3 s).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.common import write_json

# The kernel module as it was before the full/edge tile split (the "old" row).
OLD_REV = "a91ea4182a0b24d7cf94962d9c3d024ed44d227a"
KERNEL_PATH = "atom_core/ops/triton/attention_unified.py"

MODELS = {"qwen3-0.6b": (16, 8, 128), "llama3-8b": (32, 8, 128)}  # (Hq, Hk, D)
TOKENS = (4096, 8192, 16384)
BLOCK_SIZE = 16
MAX_REL_ERR = 2e-2
# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried on the GPU.
# A first H200 run (4 warps with 128x64 tiles: 0.93-0.96x flash at 16k) pruned the list to these.
CANDIDATES = [
    (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
    (128, 128, 8, 4), (128, 32, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3),
]
# Edge check: rows as (query_len, cached_len); the window is no multiple of any BLOCK_N (starts mid-tile).
EDGE_ROWS, EDGE_WINDOW = [(300, 0), (77, 500), (9, 1000), (1, 130)], 100
SMOKE = dict(models={"tiny": (4, 2, 32)}, tokens=(40,), block_size=4, candidates=[(16, 16, 4, 1), (32, 16, 4, 1)],
             edge_rows=[(20, 0), (7, 30), (9, 50), (1, 13)], edge_window=10)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every row to this path")
    parser.add_argument("--smoke", action="store_true", help="one tiny shape on the CPU (Triton interpreter)")
    parser.add_argument("--old-rev", default=OLD_REV, help="git revision of the 'old' kernel")
    parser.add_argument("--old-file", help="the 'old' kernel module's source file (instead of git show)")
    args = parser.parse_args()
    args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    return args


def load_old_kernel(rev: str, path: str | None):
    """The unified-kernel module as of ``rev`` (or read from ``path``), imported from a temporary file;
    None, with the reason printed, when neither can be read."""
    try:
        if path is not None:
            with open(path) as f:
                source = f.read()
        else:
            source = subprocess.run(["git", "show", f"{rev}:{KERNEL_PATH}"], capture_output=True, text=True,
                                    check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        print(f"old kernel unavailable ({path or 'git show ' + rev[:10]}: {type(e).__name__}); no 'old' rows")
        return None
    folder = tempfile.mkdtemp(prefix="old_attention_")
    path = os.path.join(folder, "old_attention_unified.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_attention_unified", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # triton.jit reads the source through inspect
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- problems


class Prefill:
    """One row of T tokens, no cached prefix: q [T, Hq, D], pool [NB, BS, Hk, D] with scattered blocks,
    and the same tokens densely for SDPA: [1, Hq, T, D] (K/V heads repeated to Hq)."""

    def __init__(self, heads, tokens, block_size, dtype, device, seed=0):
        num_heads, num_kv_heads, head_dim = heads
        g = torch.Generator(device=device).manual_seed(seed)
        pages = -(-tokens // block_size)
        self.q = torch.randn(tokens, num_heads, head_dim, generator=g, device=device).to(dtype)
        k = torch.randn(pages * block_size, num_kv_heads, head_dim, generator=g, device=device).to(dtype)
        v = torch.randn(pages * block_size, num_kv_heads, head_dim, generator=g, device=device).to(dtype)
        order = torch.randperm(pages, generator=g, device=device)
        self.k_cache = torch.empty(pages, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_cache = torch.empty_like(self.k_cache)
        self.k_cache[order] = k.view(pages, block_size, num_kv_heads, head_dim)  # page i lives in block order[i]
        self.v_cache[order] = v.view(pages, block_size, num_kv_heads, head_dim)
        self.block_tables = order.to(torch.int32).view(1, pages)
        self.cu_seqlens_q = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        self.context_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
        self.tokens, self.scale = tokens, head_dim ** -0.5
        group = num_heads // num_kv_heads
        self.q4 = self.q.transpose(0, 1).unsqueeze(0).contiguous()
        self.k4 = k[:tokens].transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0).contiguous()
        self.v4 = v[:tokens].transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0).contiguous()
        self.out = torch.empty_like(self.q)

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q, self.context_lens,
                self.tokens, self.tokens, self.scale, None, 0.0, None, None, None, self.out)

    def dense(self, out4: torch.Tensor) -> torch.Tensor:
        """SDPA's [1, Hq, T, D] as [T, Hq, D]."""
        return out4[0].transpose(0, 1)


def mixed_batch(heads, rows, block_size, dtype, device, seed=1):
    """A small mixed batch of ``rows`` (query_len, cached_len): the op's first eight arguments."""
    from atom_core.cache import build_step_layout

    query_lens, cached_lens = [q for q, _ in rows], [c for _, c in rows]
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(seed)
    pages = [-(-(q + c) // block_size) for q, c in zip(query_lens, cached_lens)]
    order = torch.randperm(sum(pages) + 2, generator=g).tolist()
    tables, used = [], 0
    for n in pages:
        tables.append(order[used:used + n])
        used += n
    layout = build_step_layout(query_lens, cached_lens, tables, block_size).to(device)
    shape = (len(order), block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(layout.num_tokens, num_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    return (q, k_cache, v_cache, layout.block_tables, layout.cu_seqlens_q, layout.context_lens,
            layout.max_seqlen_q, layout.max_seqlen_k)


# ---------------------------------------------------------------- checks and timing


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    return float("nan") if not torch.isfinite(err) else err.item()


def edge_error(launch, heads, sizes, dtype, device) -> float:
    """Worst relative error against the reference twin over the edge cases (see the module docstring)."""
    from atom_core.ops.reference import attention as twin

    worst = 0.0
    sinks = torch.randn(heads[0], generator=torch.Generator().manual_seed(2)).to(device)
    window = dict(sliding_window=sizes["edge_window"], logit_softcap=30.0, sinks=sinks)
    for block_size, features in ((16, {}), (3, window)):
        args = mixed_batch(heads, sizes["edge_rows"], block_size, dtype, device)
        scale = heads[2] ** -0.5
        out = torch.full_like(args[0], float("nan"))
        launch(*args, scale, features.get("sliding_window"), features.get("logit_softcap", 0.0),
               features.get("sinks"), None, None, out)
        err = rel_err(out, twin.paged_attention(*args, scale=scale, **features))
        worst = err if math.isnan(err) else max(worst, err)
        if math.isnan(worst):
            break
    return worst


def time_ms(fn, device, reps=5, target_ms=40.0) -> float:
    """Median ms per call: ``reps`` runs of n back-to-back calls between two CUDA events (n fills ~target_ms)."""
    if device == "cpu":
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(1, min(200, int(target_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def sdpa_fn(problem: Prefill, backend_name: str, device: str):
    """SDPA on the dense tokens, forced to one backend on CUDA."""
    if device == "cpu":
        return lambda: F.scaled_dot_product_attention(problem.q4, problem.k4, problem.v4, is_causal=True,
                                                      scale=problem.scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(problem.q4, problem.k4, problem.v4, is_causal=True,
                                                  scale=problem.scale)

    return call


# ---------------------------------------------------------------- the sweep


def config_name(cfg) -> str:
    return f"{cfg[0]}x{cfg[1]} w{cfg[2]} s{cfg[3]}"


def run_shape(model, heads, tokens, sizes, variants, device, edge_errors) -> list[dict]:
    dtype = torch.bfloat16
    problem = Prefill(heads, tokens, sizes["block_size"], dtype, device)
    flops = 4 * tokens ** 2 / 2 * heads[2] * heads[0]
    rows = []

    def add(variant, config, fn, output, edge=None):
        row = dict(model=model, heads=f"{heads[0]}/{heads[1]}x{heads[2]}", T=tokens, variant=variant,
                   config=config, ms=None, tflops=None, vs_flash=None, rel_err=None, edge_err=edge, status="ok")
        try:
            got = output(fn)
            row["rel_err"] = rel_err(got, ref)
            if math.isnan(row["rel_err"]) or row["rel_err"] >= MAX_REL_ERR or (edge is not None and not
                                                                              edge < MAX_REL_ERR):
                row["status"] = "WRONG"
            else:
                row["ms"] = time_ms(fn, device)
                row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001 - a variant that fails to build or run is reported
            row["status"] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        rows.append(row)
        print(_line(row), flush=True)

    ref = problem.dense(sdpa_fn(problem, "FLASH_ATTENTION", device)())
    for name, backend_name in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        if device == "cpu" and name != "sdpa_flash":
            continue
        fn = sdpa_fn(problem, backend_name, device)
        add(name, "dense", fn, lambda f: problem.dense(f()))

    def paged(launch):
        def call():
            launch(*problem.args())
            return problem.out
        return call

    def paged_output(fn):
        problem.out.fill_(float("nan"))
        return fn()

    for variant, config, launch in variants:
        key = (variant, config, heads)
        if key not in edge_errors and variant.startswith("new "):
            try:
                edge_errors[key] = edge_error(launch, heads, sizes, dtype, device)
            except Exception as e:  # noqa: BLE001
                edge_errors[key] = float("nan")
                print(f"edge check of {variant} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        add(variant, config, paged(launch), paged_output, edge_errors.get(key))

    flash = next((r["ms"] for r in rows if r["variant"] == "sdpa_flash"), None)
    for r in rows:
        r["vs_flash"] = None if flash is None or r["ms"] is None else flash / r["ms"]
    problem = None  # (frees its tensors: the closures above share this cell)
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def build_variants(sizes, old_module, device):
    from atom_core.ops.triton import attention_unified as new

    variants = []
    if old_module is not None:
        variants.append(("old", "HEAD default", old_module.paged_attention_unified))
    default = new.default_config(128, torch.bfloat16, 2, device == "cpu",
                                 torch.cuda.current_device() if device == "cuda" else None)
    variants.append(("new default", config_name(default), new.paged_attention_unified))
    for cfg in sizes["candidates"]:
        config = new.TileConfig(*cfg)
        variants.append((f"new {config_name(cfg)}", config_name(cfg),
                         lambda *a, _c=config: new.paged_attention_unified(*a, config=_c)))
    return variants


COLUMNS = ["model", "T", "variant", "ms", "tflops", "vs_flash", "rel_err", "edge_err", "status"]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _line(row) -> str:
    return "  ".join(f"{c}={_fmt(row.get(c))}" for c in COLUMNS)


def print_table(rows):
    cells = [[_fmt(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(COLUMNS, widths))))
    for x in cells:
        print("  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(x, widths))))


def summarize(rows):
    """Best config per shape, and the config with the best geometric mean of vs_flash over all shapes."""
    shapes = sorted({(r["model"], r["T"]) for r in rows}, key=lambda s: (s[0], s[1]))
    print("\nbest per shape (vs_flash > 1: faster than SDPA flash):")
    for model, tokens in shapes:
        timed = [r for r in rows if (r["model"], r["T"]) == (model, tokens) and r["variant"].startswith("new ")
                 and r["ms"] is not None]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            old = next((r for r in rows if (r["model"], r["T"], r["variant"]) == (model, tokens, "old")), None)
            old_note = "" if old is None or old["ms"] is None else f", old {old['ms']:.3f} ms ({old['vs_flash']:.3f})"
            print(f"  {model:11s} T={tokens:6d}: {best['config']:16s} {best['ms']:.3f} ms "
                  f"{best['tflops']:.1f} TFLOP/s vs_flash {_fmt(best['vs_flash'])}{old_note}")
    scores = {}
    for config in {r["config"] for r in rows if r["variant"].startswith("new ") and r["variant"] != "new default"}:
        mine = [r for r in rows if r["config"] == config and r["variant"] != "new default"]
        if len(mine) == len(shapes) and all(r["vs_flash"] is not None for r in mine):
            scores[config] = math.exp(statistics.mean(math.log(r["vs_flash"]) for r in mine))
    if scores:
        winner = max(scores, key=scores.get)
        print("\ngeometric mean of vs_flash over all shapes (every shape correct and timed):")
        for config, score in sorted(scores.items(), key=lambda kv: -kv[1]):
            print(f"  {config:16s} {score:.3f}")
        print(f"\nRECOMMENDED default: {winner} (geomean vs_flash {scores[winner]:.3f})")
    wrong = [r for r in rows if r["status"] != "ok"]
    print(f"\n{len(wrong)} variant(s) wrong or failing" + (":" if wrong else "."))
    for r in wrong:
        print(f"  {r['model']} T={r['T']} {r['variant']}: {r['status']} rel_err={_fmt(r['rel_err'])} "
              f"edge_err={_fmt(r['edge_err'])}")


def main() -> None:
    args = parse_args()
    sizes = (dict(SMOKE) if args.smoke else
             dict(models=MODELS, tokens=TOKENS, block_size=BLOCK_SIZE, candidates=CANDIDATES, edge_rows=EDGE_ROWS,
                  edge_window=EDGE_WINDOW))
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs)"
             if args.device == "cuda" else ""))
    old_module = load_old_kernel(args.old_rev, args.old_file)
    variants = build_variants(sizes, old_module, args.device)
    rows, edge_errors = [], {}
    t0 = time.perf_counter()
    for model, heads in sizes["models"].items():
        for tokens in sizes["tokens"]:
            rows += run_shape(model, heads, tokens, sizes, variants, args.device, edge_errors)
    print(f"\n(sweep took {time.perf_counter() - t0:.0f} s)\n")
    print_table(rows)
    summarize(rows)
    if args.json:
        write_json(rows, args.json)


if __name__ == "__main__":
    main()
