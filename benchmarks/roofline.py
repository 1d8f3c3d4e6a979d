"""Draw the H200 roofline with the measured ops on it: python -m benchmarks.roofline [OUT.png].

Reads benchmarks/results/h200_*.json. Arithmetic intensity (FLOP per byte of HBM traffic) is
counted by hand per op below; achieved FLOP/s = intensity x achieved bytes/s (memory-bound ops)
or the measured TFLOP/s (prefill attention). Ceilings: the copy bandwidth measured in the same
runs and the bf16 dense-matmul rate measured on this machine type (8192^3 torch.matmul).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.to_markdown import load_result

RESULTS = Path(__file__).resolve().parent / "results"
COPY_TBS = 4.25        # TB/s, read + write, measured by benchmarks.common.copy_bandwidth_gbs
MATMUL_TFLOPS = 790.0  # bf16, 8192^3 torch.matmul on an H200


def load(name):
    """The rows of ``results/h200_NAME.json`` (either result form), [] when there is none."""
    path = RESULTS / f"h200_{name}.json"
    return load_result(path)[1] if path.exists() else []


def points():
    # Elementwise, bf16: FLOP per element over bytes per element (read + write).
    flop_per_byte = {"rms_norm+residual": 6 / 8, "silu_and_mul": 6 / 6, "apply_rope_": 3 / 4, "store_kv_": 0.0}
    for r in load("ops_elementwise"):
        if r["tokens"] >= 4096 and flop_per_byte.get(r["op"]):
            yield r["op"], flop_per_byte[r["op"]], flop_per_byte[r["op"]] * r["GB/s"] / 1e3
    for r in load("ops_attention"):
        if r["case"] == "decode" and r["batch"] >= 64:
            intensity = 32 / 8  # 4 * Hq * D FLOP per key over 2 * Hk * D * 2 bytes: Hq / Hk
            yield f"decode attn bs{r['batch']}", intensity, intensity * r["GB/s"] / 1e3
        elif r["case"] == "prefill":
            tflops = r["TFLOP/s"]
            length = r["context"]
            intensity = 32 / 8 * length / 2  # each K/V byte serves ~length/2 queries under the causal mask
            yield f"prefill attn {r['batch']}x{length}", intensity, tflops
    for r in load("ops_moe"):
        if r["op"] == "fused_experts":
            # 2 * 3 * H * I FLOP per (token, choice); bytes = expert weights touched.
            flops = 2 * 3 * 2048 * 768 * r["tokens"] * 8
            nbytes = r["weight_MB"] * 1e6
            yield f"fused MoE T={r['tokens']}", flops / nbytes, flops / (r["ms"] * 1e-3) / 1e12


def main():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import argparse

    parser = argparse.ArgumentParser(description="The roofline plot of the H200 result files.")
    parser.add_argument("out", nargs="?", default=str(Path(__file__).resolve().parent.parent / "docs" / "roofline.png"),
                        help="the PNG to write (default: docs/roofline.png)")
    out = parser.parse_args().out
    xs = [10 ** (k / 10) for k in range(-10, 41)]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.loglog(xs, [min(MATMUL_TFLOPS, x * COPY_TBS) for x in xs], "k-", label="roofline (copy BW, bf16 matmul)")
    for name, intensity, tflops in points():
        ax.loglog(intensity, tflops, "o")
        ax.annotate(name, (intensity, tflops), fontsize=7, xytext=(4, -3), textcoords="offset points")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of HBM traffic)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title("atom_core Triton kernels on an H200 (bf16)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
