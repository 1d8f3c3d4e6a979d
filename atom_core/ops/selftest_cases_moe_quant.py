"""The selftest's grid, continued: fused experts with quantized weights (``fused_experts_quant``).

Inputs are seeded: fp8 weights are the twins' quantization (``reference.quant``: 128 x 128 blocks, or one
scale per output row) of normal matrices scaled so outputs are of order 1; MXFP4 weights are random
E2M1 codes with E8M0 scales around the same magnitude (GPT-OSS's layout, biases with swiglu_clamped).

Tolerances against the twin: MXFP4 is weight-only, its weights decode exactly, so it differs from the
twin as the unquantized op does (``tolerances.MOE``), except that fp32 sums over I = 2880 (GPT-OSS)
taken in another order differ by more than over the small grid's I: sqrt(2880 / 128) ~ 4.7 times
the fp32 atol (measured on an H200: 1.4e-5). FP8 formats quantize the activations, and a
kernel does that exactly as the twin (same fp32 operations), but the activation between the two GEMMs
is first rounded to hidden's dtype from an fp32 sum taken in another order; where that rounding goes
the other way, the element's fp8 value can move by one fp8 step (2**-3 of it) and the outputs it
feeds by ``weight * step * |w2[h, i]|``: activations of the grid reach ~4 (a step of 0.5) and
|w2| ~ 2 I**-0.5 (0.1 at I = 384), so up to ~5e-2 for one flip (measured on an H200: 3.6e-2 at
most), several such flips in one output row being rare: ``MOE_FP8``.

Legend: T tokens, H hidden, E experts, I intermediate, K top-k.
"""

from __future__ import annotations

import math

import torch

from atom_core import ops
from atom_core.ops.fused_moe import fused_experts_quant
from atom_core.ops.reference import quant as reference_quant
from atom_core.ops.reference.moe import E8M0_BIAS, MXFP4_BLOCK
from atom_core.ops.selftest_cases import FP32, Case, closer, grid_dtypes, seeded_randn
from atom_core.ops.tolerances import MOE

# (atol, rtol) per hidden dtype for the fp8 weight formats (see the module docstring).
MOE_FP8 = {
    torch.float32: (5e-2, 1e-4),
    torch.float16: (5e-2, 2e-3),
    torch.bfloat16: (5e-2, 1.6e-2),
}
MOE_MXFP4 = {**MOE, torch.float32: (5e-5, 1e-5)}
TOLERANCES = {"fp8_block": MOE_FP8, "fp8_channel": MOE_FP8, "mxfp4": MOE_MXFP4}


def fp8_experts(weight_format: str, seed: int, experts: int, rows: int, cols: int, device="cpu"):
    """(w fp8 [E, rows, cols], scale fp32) of normal matrices of std cols**-0.5, quantized by the twins:
    fp8_block → scale [E, ceil(rows/128), ceil(cols/128)]; fp8_channel → [E, rows, 1]."""
    w = seeded_randn(seed, experts, rows, cols, scale=cols ** -0.5)
    if weight_format == "fp8_block":
        pairs = [reference_quant.per_block_quant(w[e]) for e in range(experts)]
        q, scale = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    else:
        q, scale = reference_quant.per_token_quant(w.reshape(experts * rows, cols))
        q, scale = q.view(experts, rows, cols), scale.view(experts, rows, 1)
    return q.to(device), scale.to(device)


def mxfp4_experts(seed: int, experts: int, rows: int, cols: int, device="cpu"):
    """(packed uint8 [E, rows, cols/2], scales uint8 [E, rows, cols/32]): uniform random E2M1 codes
    (rms 2.93) with E8M0 exponents within one of 2**round(log2(cols**-0.5 / 2.93)), so the weights
    have a std near cols**-0.5."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=g, dtype=torch.uint8)
    center = E8M0_BIAS + round(math.log2(cols ** -0.5 / 2.93))
    scales = torch.randint(center - 1, center + 2, (experts, rows, cols // MXFP4_BLOCK), generator=g)
    return packed.to(device), scales.to(torch.uint8).to(device)


def quant_experts(weight_format: str, seed: int, experts: int, hidden: int, inter: int, device="cpu"):
    """(w13, w13_scale, w2, w2_scale) of ``experts`` experts in ``weight_format``."""
    make = mxfp4_experts if weight_format == "mxfp4" else (lambda *a, **k: fp8_experts(weight_format, *a, **k))
    return (*make(seed, experts, 2 * inter, hidden, device=device), *make(seed + 1, experts, hidden, inter,
                                                                          device=device))


def _case(weight_format, tokens, hidden, experts, inter, top_k, activation, biases, dtype, device) -> Case:
    def run(backend):
        x = seeded_randn(41, tokens, hidden, dtype=dtype, device=device)
        weights, ids = ops.topk_softmax(seeded_randn(42, tokens, experts, device=device), top_k, renormalize=True,
                                        backend="torch")
        extra = {}
        if biases:
            extra = dict(w13_bias=seeded_randn(43, experts, 2 * inter, dtype=dtype, device=device),
                         w2_bias=seeded_randn(44, experts, hidden, dtype=dtype, device=device))
        w13, s13, w2, s2 = quant_experts(weight_format, 45, experts, hidden, inter, device)
        return (fused_experts_quant(x, w13, s13, w2, s2, weights, ids, weight_format=weight_format,
                                    activation=activation, backend=backend, **extra),)

    label = (f"{weight_format} T={tokens} H={hidden} E={experts} I={inter} K={top_k} {activation}"
             f"{' biases' if biases else ''} {dtype}")
    return Case("fused_experts_quant", label, run, closer(TOLERANCES[weight_format])(dtype))


def fused_experts_quant_cases(grid: str, device) -> list[Case]:
    # (T, H, E, I, K): quick = H and I off the 128 grid (partial blocks), multiples of 32 (MXFP4);
    # full adds decode, a prefill with H, I on the 128 grid (what AITER's block fp8 takes) and GPT-OSS-20B's
    # expert shapes for MXFP4.
    shapes = [(5, 160, 4, 96, 2)] if grid == "quick" else [(1, 256, 16, 128, 4), (67, 1024, 32, 384, 4),
                                                            (33, 2880, 32, 2880, 4)]
    cases = []
    for shape in shapes:
        for dtype in grid_dtypes(grid):
            for weight_format in ("fp8_block", "fp8_channel", "mxfp4"):
                if shape[1] == 2880 and weight_format != "mxfp4":
                    continue
                # fp8: silu (DeepSeek, Qwen3); MXFP4: GPT-OSS's swiglu_clamped with biases. The full grid
                # crosses them once (fp32).
                variants = [("swiglu_clamped", True) if weight_format == "mxfp4" else ("silu", False)]
                if grid == "full" and dtype == FP32:
                    variants.append(("silu", False) if weight_format == "mxfp4" else ("swiglu_clamped", True))
                for activation, biases in variants:
                    cases.append(_case(weight_format, *shape, activation, biases, dtype, device))
    return cases
