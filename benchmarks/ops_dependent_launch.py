"""Programmatic dependent launch (``ops/triton/dependent_launch.py``) on a decode step's FP8 chain.

32 Llama-3-8B layers of the ops a decode step runs around its attention, FP8 block-128 with dummy weights
(one set per layer, so the weights stream from memory as in a model): RMSNorm + quantization, the qkv GEMM,
quantization of its first 4096 columns, o_proj, the residual RMSNorm + quantization, gate_up, SiLU-and-mul +
quantization and down_proj, all captured in one CUDA graph and replayed. At each token count the chain runs
with every kernel launched ordinarily ("off"), every kernel launched dependently ("on"), every kernel but
the RMSNorm + quantization one ("on_but_rms_norm_quant"), every kernel but the SiLU-and-mul + quantization one
("on_but_silu_quant"), and as shipped ("shipped"); ``same_bits`` says whether the output equals "off"'s
bit for bit. ``dependent_launch.MAX_ROWS`` and ``norm_quant``'s ``*_PDL_ROWS`` are read off this table.

    python -m benchmarks.ops_dependent_launch [--tokens 1 2 4 16 64] [--json out.json] [--smoke]

On a CPU (``--smoke``: 2 small layers at 3 tokens, Triton's interpreter) dependent launch is never on, and
the variants are the same launches.
"""

from __future__ import annotations

import torch

from benchmarks.common import adaptive_timing, ms_of, op_bench_args, print_table, require_triton_on, write_json

HIDDEN, INTER, QKV, LAYERS = 4096, 14336, 6144, 32
SMOKE = dict(hidden=256, inter=512, qkv=384, layers=2)
ALL = 1 << 30
# variant: (dependent_launch.MAX_ROWS, norm_quant.RMS_NORM_PDL_ROWS, norm_quant.SILU_PDL_ROWS); None: as shipped
VARIANTS = {"off": (0, 0, 0), "on": (ALL, ALL, ALL), "on_but_rms_norm_quant": (ALL, 0, ALL),
            "on_but_silu_quant": (ALL, ALL, 0), "shipped": None}


def _layers(hidden, inter, qkv, layers, device):
    from atom_core.ops.reference.quant import per_block_quant

    def weight(n, k):
        return per_block_quant((torch.randn(n, k, device=device) * k ** -0.5).to(torch.bfloat16))

    ones = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    return [dict(qkv=weight(qkv, hidden), o=weight(hidden, hidden), gate_up=weight(2 * inter, hidden),
                 down=weight(hidden, inter)) for _ in range(layers)], ones


def _chain(x0, layers, norm_weight, hidden):
    from atom_core import ops

    def gemm(a, a_scale, w):
        return ops.scaled_mm_block(a, a_scale, *w, out_dtype=torch.bfloat16, backend="triton")

    def forward():
        x, residual = x0, torch.zeros_like(x0)
        for layer in layers:
            a, a_scale, residual = ops.rms_norm_quant(x, norm_weight, 1e-6, residual=residual, backend="triton")
            qkv = gemm(a, a_scale, layer["qkv"])
            a, a_scale = ops.per_group_quant(qkv[:, :hidden].contiguous(), backend="triton")
            o = gemm(a, a_scale, layer["o"])
            a, a_scale, residual = ops.rms_norm_quant(o, norm_weight, 1e-6, residual=residual, backend="triton")
            a, a_scale = ops.silu_and_mul_quant(gemm(a, a_scale, layer["gate_up"]), backend="triton")
            x = gemm(a, a_scale, layer["down"])
        return x

    return forward


def _settings() -> tuple:
    from atom_core.ops.triton import dependent_launch, norm_quant

    return dependent_launch.MAX_ROWS, norm_quant.RMS_NORM_PDL_ROWS, norm_quant.SILU_PDL_ROWS


def _apply(settings: tuple) -> None:
    from atom_core.ops.triton import dependent_launch, norm_quant

    dependent_launch.MAX_ROWS, norm_quant.RMS_NORM_PDL_ROWS, norm_quant.SILU_PDL_ROWS = settings


def run(tokens: list[int], device: str, smoke: bool) -> list[dict]:
    sizes = SMOKE if smoke else dict(hidden=HIDDEN, inter=INTER, qkv=QKV, layers=LAYERS)
    timed = adaptive_timing(device, smoke)
    torch.manual_seed(0)
    layers, norm_weight = _layers(device=device, **sizes)
    shipped = _settings()
    rows = []
    try:
        for m in tokens:
            x0 = torch.randn(m, sizes["hidden"], device=device, dtype=torch.bfloat16)
            forward = _chain(x0, layers, norm_weight, sizes["hidden"])
            outputs = {}
            for variant in VARIANTS:
                _apply(VARIANTS[variant] or shipped)
                outputs[variant] = forward()
                timing = timed(forward)
                rows.append({"tokens": m, "variant": variant, "layers": sizes["layers"], "ms": ms_of(timing),
                             "same_bits": torch.equal(outputs[variant], outputs["off"]), "timing": timing.mode})
            off = rows[-len(VARIANTS)]["ms"]
            for row in rows[-len(VARIANTS):]:
                row["x_off"] = off / row["ms"]
    finally:
        _apply(shipped)
    return rows


def main() -> None:
    def flags(parser):
        parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 16, 64])

    args = op_bench_args(__doc__.splitlines()[0], flags)
    require_triton_on(args.device, "this benchmark")
    rows = run([3] if args.smoke else args.tokens, args.device, args.smoke)  # smoke: one count, interpreted
    if args.json:
        write_json(rows, args.json)
    print_table(rows, ["tokens", "variant", "layers", "ms", "x_off", "same_bits", "timing"])


if __name__ == "__main__":
    main()
