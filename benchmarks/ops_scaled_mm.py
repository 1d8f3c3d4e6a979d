"""Scaled GEMMs of quantized linear layers (``ops.scaled_mm_per_token`` and ``ops.scaled_mm_block``)
on Llama-3-8B and Qwen3-30B-A3B projection shapes, M = 1 ... 8192 tokens, per backend.

Each row: one GEMM ``out [M, N] = (a * a_scale) @ (w * w_scale)^T`` with FP8 e4m3 operands and
bf16 output, timed through atom_core's dispatch with ``backend=`` fixed (CUDA-graph replays where
capture works; the ``timing`` column says otherwise). Reported: TFLOP/s (2 M N K), GB/s over the
bytes the GEMM must move (``M K + N K`` bytes of FP8 operands, the scales, ``2 M N`` bytes of bf16
output) and that as a share of a device-to-device copy measured in the same run (the bound that
matters for M <= 16: target >= 80%), and the time of the baselines in the same run: bf16
``torch.mm`` on the dequantized weights, and ``torch._scaled_mm`` (cuBLASLt) where it serves the
format (target for M >= 1024: ours >= 0.9x of it, ``x_scaled_mm`` = its time / ours). The
activation quantization (``per_token_quant`` / ``per_group_quant``) is timed in its own column,
since a linear layer pays it too. ``auto_*``: the op as a model calls it, with no backend named (the one
auto dispatch picks for this M: ``auto_backend``; from 256 rows the block format prefers cuBLAS where it
serves), its time and cuBLAS's time over it.

    python -m benchmarks.ops_scaled_mm [--device cuda] [--json out.json] [--smoke] [--tokens 1 16]

``--smoke`` runs tiny sizes so the script can be checked on a CPU (Triton in its interpreter).
"""

from __future__ import annotations

import torch

from benchmarks.common import adaptive_timing, guarded, ms_of, ratio, timing_column

# (model, layer, N, K): the projections of one decoder layer, full (unsharded) shapes.
SHAPES = [
    ("llama-3-8b", "qkv_proj", 6144, 4096), ("llama-3-8b", "o_proj", 4096, 4096),
    ("llama-3-8b", "gate_up_proj", 28672, 4096), ("llama-3-8b", "down_proj", 4096, 14336),
    ("qwen3-30b-a3b", "qkv_proj", 5120, 2048), ("qwen3-30b-a3b", "o_proj", 2048, 4096),
]
TOKENS = [1, 16, 128, 1024, 8192]
SMOKE_SHAPES = [("smoke", "proj", 256, 256)]
SMOKE_TOKENS = [1, 16]


def _operands(m: int, n: int, k: int, fmt: str, device):
    """(a, a_scale, w, w_scale, w_bf16): FP8 activation and weight in ``fmt``'s scale layout, and the
    bf16 weight they dequantize to (the baseline's operand)."""
    from atom_core import ops
    from atom_core.ops.reference.quant import per_block_quant

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(torch.bfloat16)
    if fmt == "per_token":
        a, a_scale = ops.per_token_quant(x, backend="torch")
        w_q, w_scale = ops.per_token_quant(w, backend="torch")  # per output channel: [N, 1]
        w_deq = (w_q.float() * w_scale).to(torch.bfloat16)
    else:
        a, a_scale = ops.per_group_quant(x, backend="torch")
        w_q, w_scale = per_block_quant(w)
        w_deq = w  # the block layout's dequantized weight is within fp8 of w: the bf16 baseline's cost is the same
    return x, a, a_scale, w_q, w_scale, w_deq


def _row(model, layer, n, k, m, fmt, backend, device, timed, copy_gbs):
    from atom_core import ops
    from atom_core.ops.dispatch import trace_backends

    x, a, a_scale, w, w_scale, w_deq = _operands(m, n, k, fmt, device)
    gemm = ops.scaled_mm_per_token if fmt == "per_token" else ops.scaled_mm_block
    quant = (lambda: ops.per_token_quant(x, backend=backend)) if fmt == "per_token" else \
        (lambda: ops.per_group_quant(x, backend=backend))
    ours = timed(lambda: gemm(a, a_scale, w, w_scale, out_dtype=torch.bfloat16, backend=backend))
    quant_t = guarded(timed, lambda: quant)
    bf16 = guarded(timed, lambda: lambda: torch.mm(x, w_deq.t()))
    cublas = None
    if device.startswith("cuda") and backend != "scaled_mm":
        cublas = guarded(timed, lambda: lambda: gemm(a, a_scale, w, w_scale, out_dtype=torch.bfloat16,
                                                     backend="scaled_mm"))
    with trace_backends() as calls:  # the op as a user calls it: the backend auto picks for this M
        gemm(a, a_scale, w, w_scale, out_dtype=torch.bfloat16)
    auto = guarded(timed, lambda: lambda: gemm(a, a_scale, w, w_scale, out_dtype=torch.bfloat16))
    ms = ours.ms
    nbytes = m * k + n * k + 4 * (a_scale.numel() + w_scale.numel()) + 2 * m * n
    gbs = nbytes / (ms * 1e-3) / 1e9
    return {"model": model, "layer": layer, "format": fmt, "M": m, "N": n, "K": k, "backend": backend, "ms": ms,
            "TFLOP/s": 2 * m * n * k / (ms * 1e-3) / 1e12, "GB/s": gbs, "%copy": 100 * gbs / copy_gbs,
            "quant_ms": ms_of(quant_t), "bf16_mm_ms": ms_of(bf16), "x_bf16": ratio(ms_of(bf16), ms),
            "scaled_mm_ms": ms_of(cublas), "x_scaled_mm": ratio(ms_of(cublas), ms), "auto_backend": calls[0][1],
            "auto_ms": ms_of(auto), "auto_x_scaled_mm": ratio(ms_of(cublas), ms_of(auto)),
            "timing": timing_column({"ms": ours, "quant_ms": quant_t, "bf16_mm_ms": bf16, "scaled_mm_ms": cublas,
                                     "auto_ms": auto})}


def run(device: str = "cuda", smoke: bool = False, tokens: list[int] | None = None) -> list[dict]:
    from benchmarks.common import copy_bandwidth_gbs, runs_on

    timed = adaptive_timing(device, smoke)
    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 20 if smoke else 2 << 30)
    backends = [b for b in ("triton", "aiter") if runs_on(b, device)] or ["torch"]
    rows = []
    for model, layer, n, k in (SMOKE_SHAPES if smoke else SHAPES):
        for m in (SMOKE_TOKENS if smoke else tokens or TOKENS):
            for fmt in ("per_token", "block"):
                for backend in backends:
                    rows.append(guarded_row(model, layer, n, k, m, fmt, backend, device, timed, copy_gbs))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def guarded_row(*args) -> dict:
    """``_row``, or a row saying why the backend could not serve the case."""
    try:
        return _row(*args)
    except Exception as e:  # noqa: BLE001 - a backend refusing a case is reported, not fatal
        model, layer, n, k, m, fmt, backend = args[:7]
        return {"model": model, "layer": layer, "format": fmt, "M": m, "N": n, "K": k, "backend": backend,
                "timing": f"not run: {type(e).__name__}: {str(e).splitlines()[0][:100]}"}


COLUMNS = ["model", "layer", "format", "M", "N", "K", "backend", "ms", "TFLOP/s", "GB/s", "%copy", "quant_ms",
           "bf16_mm_ms", "x_bf16", "scaled_mm_ms", "x_scaled_mm", "auto_backend", "auto_ms", "auto_x_scaled_mm", "timing"]


def main() -> None:
    from benchmarks.common import op_bench_args, report

    def flags(parser):
        parser.add_argument("--tokens", type=int, nargs="+", default=None, help=f"M values (default {TOKENS})")

    args = op_bench_args(__doc__.splitlines()[0], flags)
    report(run(args.device, smoke=args.smoke, tokens=args.tokens), COLUMNS, args.json)


if __name__ == "__main__":
    main()
