"""Launch configurations of the Triton scaled GEMM (``ops/triton/scaled_mm.py``), swept on the shapes of
``benchmarks.ops_scaled_mm``: tiles, pipeline stages, split-K and the fp8 promotion interval, each timed
(CUDA-graph replays) against ``torch._scaled_mm`` (cuBLASLt) and a device-to-device copy in the same run,
with its accumulation error (fp32 output, the same launch) against the fp32 product of the dequantized
operands, as a share of max |out|. The defaults of
``scaled_mm.launch_config`` are read off this table.

At M <= 256 (decode batches) each timed call reads the next of ``WEIGHT_COPIES`` copies of the weight, as a
model's layers each read their own: one weight of 8-60 MB, timed alone, stays in the H200's 50 MB L2 and
reads faster than a decode step ever does (Llama-3-8B's o_proj GEMV: 5.3 us with one copy, 7.7 out of L2).

    python -m benchmarks.ops_scaled_mm_sweep [--json out.json] [--tokens 1 16 128 1024 8192] [--formats block]
        [--smoke]
"""

from __future__ import annotations

import itertools

import torch

from benchmarks.common import (_reason, adaptive_timing, copy_bandwidth_gbs, guarded, ms_of, op_bench_args,
                               print_table, ratio, write_json)
from benchmarks.ops_scaled_mm import SHAPES, SMOKE_SHAPES, _operands

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split-K, promotion interval: "bk" = BLOCK_K, None = Triton's)
SMALL_M = ([(16, bn, 128, 4, 4, sk, "bk") for bn in (32, 64) for sk in (1, 2, 4, 8)]
           # 16-wide column tiles: twice the programs of 32, so fewer K splits (or none) to fill the multiprocessors
           + [(16, 16, 128, warps, stages, sk, "bk") for warps in (2, 4) for stages in (4, 6) for sk in (1, 2)])
# M = 1 also: the GEMV kernel (BLOCK_M = 1: no tensor cores, no split-K), by rows and K step per program (one
# stage count: its K loop is a plain range, which Triton does not stage; staged with tl.range(num_stages=...) it
# was faster alone and no faster in a decode step, docs/benchmarks.md), up to 512 weight values a thread
GEMV = [(1, bn, bk, warps, 4, 1, None) for bn in (2, 4, 8, 16) for bk in (1024, 2048, 4096) for warps in (1, 2, 4, 8)
        if bn * bk <= 512 * 32 * warps]
WEIGHT_COPIES = 10  # the weights a timed call of at most COLD_M rows cycles through (module docstring)
COLD_M = 256
MID_M_TO = 512  # 16 < M <= this: MID_M
MID_M = [(bm, bn, 128, warps, stages, sk, None)
         for bm, bn, warps, stages in [(32, 64, 4, 4), (64, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 4), (128, 64, 4, 4),
                                       (128, 64, 8, 3), (128, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3)]
         for sk in (1, 2, 4)]
LARGE_M = [(bm, bn, bk, w, st, 1, imp)
           for bm, bn, bk, w, st in [(128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (128, 256, 128, 8, 3),
                                     (64, 256, 128, 4, 4)]
           for imp in ("bk", None)]


def _configs(m: int, smoke: bool = False):
    """The launches swept at M = m; ``smoke``: the first of each list only (a CPU check of the script)."""
    from atom_core.ops.triton.scaled_mm import LaunchConfig

    lists = ([GEMV] if m == 1 else []) + [SMALL_M] if m <= 16 else [MID_M] if m <= MID_M_TO else [LARGE_M]
    for bm, bn, bk, warps, stages, split, imprecise in (c for configs in lists for c in configs[:1 if smoke else None]):
        yield LaunchConfig(bm, bn, bk, warps, stages, split, bk if imprecise == "bk" else imprecise)


def run(tokens: list[int], json_path: str | None, device: str = "cuda", smoke: bool = False,
        formats: tuple[str, ...] = ("per_token", "block")) -> list[dict]:
    from atom_core import ops
    from atom_core.ops.triton import scaled_mm as triton_scaled_mm

    timed = adaptive_timing(device, smoke)
    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 20 if smoke else 2 << 30)
    rows = []
    for model, layer, n, k in (SMOKE_SHAPES if smoke else SHAPES):
        for m in tokens:
            for fmt, kind in (("per_token", triton_scaled_mm.PER_TOKEN.value),
                              ("block", triton_scaled_mm.BLOCKWISE.value)):
                if fmt not in formats:
                    continue
                x, a, a_scale, w, w_scale, _ = _operands(m, n, k, fmt, device)
                gemm = ops.scaled_mm_per_token if fmt == "per_token" else ops.scaled_mm_block
                want = gemm(a, a_scale, w, w_scale, out_dtype=torch.float32, backend="torch")
                # (the copies hold the same values: the error check may read any of them)
                weights = itertools.cycle([w] + [w.clone() for _ in range(WEIGHT_COPIES - 1)] if m <= COLD_M else [w])
                cublas = None if smoke else guarded(
                    timed, lambda: lambda: gemm(a, a_scale, next(weights), w_scale, out_dtype=torch.bfloat16,
                                                backend="scaled_mm"))
                nbytes = m * k + n * k + 2 * m * n
                for config in _configs(m, smoke):
                    def call(config=config, out_dtype=torch.bfloat16):
                        return triton_scaled_mm._scaled_mm(kind, a, a_scale, next(weights), w_scale, None, out_dtype,
                                                           config)
                    row = {"model": model, "layer": layer, "format": fmt, "M": m, "N": n, "K": k,
                           "config": f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} "
                                     f"s{config.num_stages} split{config.split_k} imp{config.max_imprecise}"}
                    try:
                        err = (call(out_dtype=torch.float32) - want).abs().max().item() / want.abs().max().item()
                        timing = timed(call)
                        ms = ms_of(timing)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is a row too
                        rows.append({**row, "error": _reason(e)})
                        continue
                    rows.append({**row, "ms": ms, "TFLOP/s": 2 * m * n * k / (ms * 1e-3) / 1e12,
                                 "%copy": 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs, "rel_err": err,
                                 "scaled_mm_ms": ms_of(cublas), "x_scaled_mm": ratio(ms_of(cublas), ms),
                                 "timing": timing.mode})
                    print(rows[-1], flush=True)
                if json_path:
                    write_json(rows, json_path)
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


def main() -> None:
    def flags(parser):
        parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 8192])
        parser.add_argument("--formats", nargs="+", choices=["per_token", "block"], default=["per_token", "block"])

    args = op_bench_args(__doc__.splitlines()[0], flags)
    rows = run([1, 16] if args.smoke else args.tokens, args.json, args.device, args.smoke, tuple(args.formats))
    best = {}
    for r in rows:
        key = (r["model"], r["layer"], r["format"], r["M"])
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    print_table(list(best.values()), ["model", "layer", "format", "M", "config", "ms", "TFLOP/s", "%copy",
                                      "rel_err", "x_scaled_mm", "timing"])


if __name__ == "__main__":
    main()
