"""Paged attention (``atom_core.ops.paged_attention``) at Llama-3-8B head shapes: Hq 32, Hk 8, D 128, bf16,
block size 16, blocks scattered over the pool.

Times are GPU time of CUDA-graph replays (no Python launch overhead) except for the twin, which
syncs with the host and is timed eagerly.

Decode (one query token per row; batch 1/64/256 x context 512/4096/32768): median time, bytes moved
(K and V of every context token read once, q read, out written), that bandwidth as a share of a
device-to-device copy measured in the same run (target: >= 75% at batch 64 x 4096), and speedups over

* ``sdpa``: torch ``scaled_dot_product_attention`` on K/V already gathered out of the pool into dense
  [B, Hk, S, D] tensors (gather time excluded),
* ``sdpa+gather``: the same with the gather inside the timed call (gather time included),
* ``twin``: the reference twin (per-row gather + dense attention), eager and under ``torch.compile``.

Prefill (causal; 1 x 4096, 4 x 2048 and 1 x 16384 tokens, empty cache): TFLOP/s, counting 4 * Hq * D
flops per (query, visible key) pair (two matmuls), against SDPA with the flash backend on dense inputs
(K/V heads already repeated to Hq, so no gather and no GQA handling is timed there). The 16k row has
no twin baselines (the twin's [Hq, T, T] logits would take 34 GB); benchmarks/attention_prefill_sweep.py
sweeps the kernel's tile configs on long prefills.

    python -m benchmarks.ops_attention [--device cuda] [--json out.json] [--smoke]
        [--kv-heads 4] [--fp8-pool] [--decode-only] [--decode 256x1024 64x4096 256x105-1029]

``--fp8-pool`` adds, after each decode row, the same problem over an fp8 (e4m3) pool holding K / 0.5 and
V / 0.25 (as ``store_kv_`` writes it, with those scales), timed in the same run: its bytes count one byte a
cached element, and ``x_bf16_pool`` is the bf16 pool's time over the fp8 pool's. ``--kv-heads`` sets Hk
(4: Qwen3-30B-A3B's heads); ``--decode`` replaces the decode grid (BATCHxCONTEXT). A context LO-HI gives each
row its own, drawn uniformly from [LO, HI] (seeded), as in the decode steps of the nano-vllm workload (prompts of
100-1,024 tokens): rows of uneven length, whose longest set a program's tail; the SDPA baselines need equal
contexts and are left out of such rows (the twin takes them). Every decode launch passes the engine's
``row_order`` (rows longest first); rows of uneven context are also timed without it (``in_row_order_ms``).

``--smoke`` runs tiny sizes without torch.compile so the script can be checked on a CPU, where the
Triton kernels run in the interpreter.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atom_core.cache.token_layout import longest_first
from benchmarks.common import adaptive_timing, guarded, kernel_backend, ms_of, ratio, timing_column

FULL = dict(q_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
            decode=[(b, s) for b in (1, 64, 256) for s in (512, 4096, 32768)],
            prefill=[(1, 4096), (4, 2048), (1, 16384)])
# The twin materialises fp32 logits [Hq, T, T] per row: past this many tokens it is not timed.
TWIN_MAX_PREFILL_TOKENS = 8192
SMOKE = dict(q_heads=4, kv_heads=2, head_dim=32, block_size=4, dtype=torch.float32,
             decode=[(1, 16), (2, 40), (3, (9, 30))], prefill=[(1, 24), (2, 12)])


@dataclass
class Problem:
    """A batch of rows, its pool and layout tensors (on the device)."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [NB, BS, Hk, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, P]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    context_lens: torch.Tensor  # int32 [B]
    max_seqlen_q: int
    max_seqlen_k: int
    contexts: list[int]  # context_lens on the host
    row_order: torch.Tensor  # int32 [B]: the rows longest first, as the engine's layout orders them

    @property
    def even(self) -> bool:
        return len(set(self.contexts)) == 1

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q, self.context_lens,
                self.max_seqlen_q, self.max_seqlen_k)


def row_contexts(rows: int, context) -> list[int]:
    """Each row's context: ``context`` itself, or for a (lo, hi) pair one drawn uniformly from [lo, hi]."""
    if isinstance(context, int):
        return [context] * rows
    rng = random.Random(rows)
    return [rng.randint(*context) for _ in range(rows)]


def context_label(context) -> str:
    return str(context) if isinstance(context, int) else f"{context[0]}-{context[1]}"


def make_problem(rows, query_len, context, sizes, device) -> Problem:
    """``context``: every row's, or (lo, hi): each row's own (:func:`row_contexts`); pages scattered over the pool
    (a row's table padded with -1 past its pages)."""
    block_size, kv_heads, head_dim, dtype = sizes["block_size"], sizes["kv_heads"], sizes["head_dim"], sizes["dtype"]
    contexts = row_contexts(rows, context)
    pages = [math.ceil(c / block_size) for c in contexts]
    num_blocks = sum(pages)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    scattered = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = torch.full((rows, max(pages)), -1, dtype=torch.int32, device=device)
    for row, start in enumerate(itertools.accumulate([0] + pages[:-1])):
        block_tables[row, :pages[row]] = scattered[start:start + pages[row]]
    q = torch.randn(rows * query_len, sizes["q_heads"], head_dim, dtype=dtype, device=device)
    cu_seqlens_q = torch.arange(0, rows * query_len + 1, query_len, dtype=torch.int32, device=device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return Problem(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, query_len, max(contexts), contexts,
                   longest_first(contexts).to(device))


def gather_dense(problem: Problem, cache: torch.Tensor) -> torch.Tensor:
    """[B, Hk, S, D]: every row's context copied out of the pool (rows of equal context S only)."""
    rows, pages = problem.block_tables.shape
    pages_kv = cache[problem.block_tables.long()]  # [B, P, BS, Hk, D]
    return pages_kv.reshape(rows, pages * cache.shape[1], *cache.shape[2:])[:, : problem.max_seqlen_k].transpose(1, 2)


def _sdpa(q, k, v, scale, causal):
    """q [B, Hq, L, D]; k, v [B, Hk, S, D]; GQA through enable_gqa, else by repeating kv heads."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    except (RuntimeError, TypeError):
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              is_causal=causal, scale=scale)


def _decode_row(rows, context, sizes, device, smoke, timed, copy_gbs, twin_baselines=True):
    from atom_core.ops.attention import paged_attention, uses_split_k_decode
    from atom_core.ops.reference import attention as twin
    from atom_core.ops.triton.attention_decode import choose_num_splits

    backend = kernel_backend(device)
    p = make_problem(rows, 1, context, sizes, device)
    scale = sizes["head_dim"] ** -0.5
    out = torch.empty_like(p.q)
    main = timed(lambda: paged_attention(*p.args(), scale=scale, out=out, row_order=p.row_order, backend=backend))
    ms = main.ms
    # Rows of uneven context: the same launch in row order (without the engine's longest-first row_order).
    in_row_order = None if p.even else timed(
        lambda: paged_attention(*p.args(), scale=scale, out=out, backend=backend))
    in_row_order_ms = ms_of(in_row_order)
    elt = p.q.element_size()
    kv_bytes = 2 * sum(p.contexts) * sizes["kv_heads"] * sizes["head_dim"] * p.k_cache.element_size()
    nbytes = kv_bytes + 2 * p.q.numel() * elt  # K and V read once; q read, out written
    gbs = nbytes / (ms * 1e-3) / 1e9

    q4 = p.q.view(rows, 1, sizes["q_heads"], sizes["head_dim"]).transpose(1, 2)  # [B, Hq, 1, D]
    dense = {}

    def pre_gathered():
        dense["k"], dense["v"] = gather_dense(p, p.k_cache), gather_dense(p, p.v_cache)
        return lambda: _sdpa(q4, dense["k"], dense["v"], scale, False)

    sdpa = guarded(timed, pre_gathered) if p.even else None
    dense.clear()
    sdpa_gather = guarded(timed, lambda: lambda: _sdpa(q4, gather_dense(p, p.k_cache), gather_dense(p, p.v_cache),
                                                        scale, False)) if p.even else None
    twin_t = None if not twin_baselines else guarded(
        timed, lambda: lambda: twin.paged_attention(*p.args(), scale=scale), graph=False)
    compiled = None if smoke or not twin_baselines else guarded(
        timed, lambda: (lambda f: lambda: f(*p.args(), scale=scale))(torch.compile(twin.paged_attention)), graph=False)
    sdpa_ms, sdpa_gather_ms, twin_ms, compile_ms = map(ms_of, (sdpa, sdpa_gather, twin_t, compiled))
    split_k = uses_split_k_decode(1, sizes["q_heads"], sizes["kv_heads"])
    return {
        "case": "decode", "batch": rows, "context": context_label(context), "backend": backend,
        "path": "split-k" if split_k else "unified",
        "splits": choose_num_splits(rows, sizes["kv_heads"], p.max_seqlen_k, torch.device(device)) if split_k else 1,
        "ms": ms, "GB/s": gbs, "%copy": 100 * gbs / copy_gbs, "TFLOP/s": None,
        "in_row_order_ms": in_row_order_ms, "x_in_row_order": ratio(in_row_order_ms, ms),
        "sdpa_ms": sdpa_ms, "x_sdpa": ratio(sdpa_ms, ms),
        "sdpa+gather_ms": sdpa_gather_ms, "x_sdpa+gather": ratio(sdpa_gather_ms, ms),
        "twin_ms": twin_ms, "x_twin": ratio(twin_ms, ms),
        "compile_ms": compile_ms, "x_compile": ratio(compile_ms, ms),
        "timing": timing_column({"ms": main, "in_row_order_ms": in_row_order, "sdpa_ms": sdpa,
                                 "sdpa+gather_ms": sdpa_gather, "twin_ms": twin_t, "compile_ms": compiled}),
    }


def _fp8_pool_row(rows, context, sizes, device, timed, copy_gbs, bf16_row):
    """The decode row's problem over an fp8 pool (K / 0.5, V / 0.25 in e4m3, the scales passed)."""
    from atom_core.ops.attention import paged_attention

    p = make_problem(rows, 1, context, sizes, device)
    k_scale, v_scale = (torch.tensor([s], device=device) for s in (0.5, 0.25))
    p.k_cache = (p.k_cache.float() / k_scale).to(torch.float8_e4m3fn)
    p.v_cache = (p.v_cache.float() / v_scale).to(torch.float8_e4m3fn)
    scale = sizes["head_dim"] ** -0.5
    out = torch.empty_like(p.q)
    main = timed(lambda: paged_attention(*p.args(), scale=scale, k_scale=k_scale, v_scale=v_scale, out=out,
                                         row_order=p.row_order, backend=bf16_row["backend"]))
    ms = main.ms
    in_row_order = None if p.even else timed(lambda: paged_attention(
        *p.args(), scale=scale, k_scale=k_scale, v_scale=v_scale, out=out, backend=bf16_row["backend"]))
    in_row_order_ms = ms_of(in_row_order)
    nbytes = 2 * sum(p.contexts) * sizes["kv_heads"] * sizes["head_dim"] + 2 * p.q.numel() * p.q.element_size()
    gbs = nbytes / (ms * 1e-3) / 1e9
    return {**{k: bf16_row[k] for k in ("batch", "context", "backend", "path", "splits")},
            "case": "decode (fp8 pool)", "ms": ms, "GB/s": gbs, "%copy": 100 * gbs / copy_gbs,
            "in_row_order_ms": in_row_order_ms, "x_in_row_order": ratio(in_row_order_ms, ms),
            "bf16_pool_ms": bf16_row["ms"], "x_bf16_pool": ratio(bf16_row["ms"], ms),
            "timing": timing_column({"ms": main, "in_row_order_ms": in_row_order})}


def _flash_backend(device):
    if not str(device).startswith("cuda"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _prefill_row(rows, length, sizes, device, smoke, timed, copy_gbs, twin_baselines=True):
    from atom_core.ops.attention import paged_attention
    from atom_core.ops.reference import attention as twin

    backend = kernel_backend(device)
    p = make_problem(rows, length, length, sizes, device)
    scale = sizes["head_dim"] ** -0.5
    out = torch.empty_like(p.q)
    main = timed(lambda: paged_attention(*p.args(), scale=scale, out=out, backend=backend))
    ms = main.ms
    pairs = rows * length * (length + 1) // 2  # (query, visible key) pairs under the causal mask
    flops = 4 * pairs * sizes["q_heads"] * sizes["head_dim"]
    group = sizes["q_heads"] // sizes["kv_heads"]
    q4 = p.q.view(rows, length, sizes["q_heads"], sizes["head_dim"]).transpose(1, 2).contiguous()
    k4 = gather_dense(p, p.k_cache).repeat_interleave(group, 1).contiguous()
    v4 = gather_dense(p, p.v_cache).repeat_interleave(group, 1).contiguous()

    def flash():
        with _flash_backend(device):
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)

    sdpa = guarded(timed, lambda: flash)
    twin_t = None if not twin_baselines else guarded(
        timed, lambda: lambda: twin.paged_attention(*p.args(), scale=scale), graph=False)
    compiled = None if smoke or not twin_baselines else guarded(
        timed, lambda: (lambda f: lambda: f(*p.args(), scale=scale))(torch.compile(twin.paged_attention)), graph=False)
    sdpa_ms, twin_ms, compile_ms = map(ms_of, (sdpa, twin_t, compiled))
    return {
        "case": "prefill", "batch": rows, "context": length, "backend": backend, "path": "unified", "splits": 1,
        "ms": ms, "GB/s": None, "%copy": None, "TFLOP/s": flops / (ms * 1e-3) / 1e12,
        "sdpa_ms": sdpa_ms, "x_sdpa": ratio(sdpa_ms, ms),
        "sdpa_TFLOP/s": None if sdpa_ms is None else flops / (sdpa_ms * 1e-3) / 1e12,
        "twin_ms": twin_ms, "x_twin": ratio(twin_ms, ms),
        "compile_ms": compile_ms, "x_compile": ratio(compile_ms, ms),
        "timing": timing_column({"ms": main, "sdpa_ms": sdpa, "twin_ms": twin_t, "compile_ms": compiled}),
    }


def run(device: str = "cuda", smoke: bool = False, twin_baselines: bool = True, kv_heads: int | None = None,
        fp8_pool: bool = False, decode_only: bool = False, decode: list[tuple[int, int]] | None = None) -> list[dict]:
    """One row per case. Times in ms; bandwidth in GB/s (1e9 bytes/s); TFLOP/s = 1e12 flop/s."""
    from benchmarks.common import copy_bandwidth_gbs

    sizes = dict(SMOKE if smoke else FULL)
    if kv_heads:
        sizes["kv_heads"] = kv_heads
    if decode:
        sizes["decode"] = decode
    timed = adaptive_timing(device, smoke)
    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 20 if smoke else 2 << 30)
    rows = []
    for batch, context in sizes["decode"]:
        rows.append(_decode_row(batch, context, sizes, device, smoke, timed, copy_gbs, twin_baselines))
        print(rows[-1], flush=True)
        if fp8_pool:
            rows.append(_fp8_pool_row(batch, context, sizes, device, timed, copy_gbs, rows[-1]))
            print(rows[-1], flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for batch, length in [] if decode_only else sizes["prefill"]:
        rows.append(_prefill_row(batch, length, sizes, device, smoke, timed, copy_gbs,
                                 twin_baselines and batch * length <= TWIN_MAX_PREFILL_TOKENS))
        print(rows[-1], flush=True)
    return rows


COLUMNS = ["case", "batch", "context", "backend", "path", "splits", "ms", "GB/s", "%copy", "TFLOP/s", "x_sdpa",
           "x_sdpa+gather", "sdpa_TFLOP/s", "x_twin", "x_compile", "x_bf16_pool", "x_in_row_order", "timing"]


def _flags(parser) -> None:
    parser.add_argument("--sdpa-only", action="store_true",
                        help="baselines: SDPA only (skip the slow twin and its torch.compile)")
    parser.add_argument("--kv-heads", type=int, help="kv heads (default 8; Qwen3-30B-A3B has 4)")
    parser.add_argument("--fp8-pool", action="store_true", help="each decode row again over an fp8 pool")
    parser.add_argument("--decode-only", action="store_true", help="no prefill rows")
    parser.add_argument("--decode", nargs="+", metavar="BATCHxCONTEXT", help="decode cases, e.g. 256x1024")


def parse_decode_case(case: str) -> tuple:
    """"BATCHxCONTEXT" → (batch, context); "BATCHxLO-HI" → (batch, (lo, hi))."""
    batch, context = case.split("x")
    lo, _, hi = context.partition("-")
    return int(batch), int(lo) if not hi else (int(lo), int(hi))


def main() -> None:
    from benchmarks.common import op_bench_args, report

    args = op_bench_args(__doc__.splitlines()[0], _flags)
    decode = [parse_decode_case(case) for case in args.decode] if args.decode else None
    report(run(args.device, smoke=args.smoke, twin_baselines=not args.sdpa_only, kv_heads=args.kv_heads,
               fp8_pool=args.fp8_pool, decode_only=args.decode_only, decode=decode), COLUMNS, args.json)


if __name__ == "__main__":
    main()
