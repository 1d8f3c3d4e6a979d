"""One Qwen3-30B-A3B MoE layer (``benchmarks/configs/qwen3-30b-a3b.json``: E 128, K 8, H 2048,
I 768, bf16) at T = 1, 8, 64, 512, 4096 tokens: ``fused_experts`` and its routing, ``topk_softmax``.

For ``fused_experts``: median time of the op through atom_core's dispatch — on a GPU, of CUDA-graph
replays (``ms``: what a decode step captured in a graph pays) and of eager calls (``eager_ms``:
Python and launch overhead included); the bytes of expert weights the step must read,
``experts hit x 3 x H x I x bytes per element`` (the distinct experts in topk_ids: each needs its
gate, up and down matrices once), over ``ms``, as GB/s and as a share of a device-to-device copy
measured in the same run (target: >= 50% at 1-64 tokens, where reading the weights is the whole
cost); speedup over the expert-loop twin, eager and under ``torch.compile`` (its per-expert token
lists have data-dependent sizes, so the compiled twin runs in pieces between graph breaks, and
neither can be captured in a CUDA graph). Routing rows give the time and the speedup over the twin.

Every figure but ``eager_ms`` is timed the same way (``benchmarks.common.adaptive_timing`` with a CUDA
graph requested); the row's ``timing`` column says which figures fell back to eager calls and why
(on a GPU, the twins', whose data-dependent sizes defeat capture) and that ``eager_ms`` is eager by
design.

    python -m benchmarks.ops_moe [--device cuda] [--json out.json] [--smoke] [--no-compile]

``--smoke`` runs tiny sizes (and no torch.compile) so the script can be checked on a CPU, where the
Triton kernels run in the interpreter.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.common import adaptive_timing, guarded, ms_of, ratio, timing_column

CONFIG = Path(__file__).with_name("configs") / "qwen3-30b-a3b.json"
TOKENS = [1, 8, 64, 512, 4096]
SMOKE = dict(num_experts=8, top_k=2, hidden=64, inter=32, tokens=[1, 8], dtype=torch.float32)


def layer_sizes(smoke: bool) -> dict:
    if smoke:
        return SMOKE
    cfg = json.loads(CONFIG.read_text())
    return dict(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"], hidden=cfg["hidden_size"],
                inter=cfg["moe_intermediate_size"], tokens=TOKENS, dtype=torch.bfloat16)


def make_layer(tokens: int, sizes: dict, device, seed: int = 0) -> dict:
    """Inputs of one MoE layer: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], router logits [T, E]."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i, dtype = sizes["num_experts"], sizes["hidden"], sizes["inter"], sizes["dtype"]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    return dict(hidden=randn(tokens, h), w13=randn(e, 2 * i, h, scale=h ** -0.5), w2=randn(e, h, i, scale=i ** -0.5),
                router_logits=torch.randn(tokens, e, generator=g, device=device))


def _moe_row(tokens, sizes, device, smoke, compile_twin, timed, copy_gbs, backend):
    from atom_core.ops.fused_moe import fused_experts
    from atom_core.ops.moe_routing import topk_softmax
    from atom_core.ops.reference import moe as twin

    layer = make_layer(tokens, sizes, device)
    weights, ids = topk_softmax(layer["router_logits"], sizes["top_k"], renormalize=True)
    args = (layer["hidden"], layer["w13"], layer["w2"], weights, ids)
    out = torch.empty_like(layer["hidden"])

    def call():
        return fused_experts(*args, out=out, backend=backend)

    ours = timed(call)
    eager = timed(call, graph=False) if str(device).startswith("cuda") else ours
    ms = ours.ms

    experts_hit = int(torch.unique(ids).numel())
    weight_bytes = experts_hit * 3 * sizes["hidden"] * sizes["inter"] * layer["w13"].element_size()
    gbs = weight_bytes / (ms * 1e-3) / 1e9
    twin_t = guarded(timed, lambda: lambda: twin.fused_experts(*args))
    compiled = None
    if compile_twin and not smoke:
        compiled = guarded(timed, lambda: (lambda f: lambda: f(*args))(torch.compile(twin.fused_experts,
                                                                                        dynamic=True)))
    twin_ms, compile_ms = ms_of(twin_t), ms_of(compiled)
    return {
        "op": "fused_experts", "tokens": tokens, "backend": backend, "experts_hit": experts_hit,
        "weight_MB": weight_bytes / 1e6, "ms": ms, "eager_ms": eager.ms, "GB/s": gbs, "%copy": 100 * gbs / copy_gbs,
        "twin_ms": twin_ms, "x_twin": ratio(twin_ms, ms),
        "compile_ms": compile_ms, "x_compile": ratio(compile_ms, ms),
        "timing": timing_column({"ms": ours, "eager_ms": eager, "twin_ms": twin_t, "compile_ms": compiled}),
    }


def _routing_row(tokens, sizes, device, timed, backend):
    from atom_core.ops.moe_routing import topk_softmax
    from atom_core.ops.reference import moe as twin

    logits = make_layer(tokens, sizes, device)["router_logits"]
    ours = timed(lambda: topk_softmax(logits, sizes["top_k"], renormalize=True, backend=backend))
    twin_t = guarded(timed, lambda: lambda: twin.topk_softmax(logits, sizes["top_k"], True))
    return {"op": "topk_softmax", "tokens": tokens, "backend": backend, "ms": ours.ms, "twin_ms": ms_of(twin_t),
            "x_twin": ratio(ms_of(twin_t), ours.ms), "timing": timing_column({"ms": ours, "twin_ms": twin_t})}


def run(device: str = "cuda", smoke: bool = False, compile_twin: bool = True) -> list[dict]:
    """One row per (op, token count). Times in ms; bandwidth in GB/s (1e9 bytes/s)."""
    from atom_core.ops.dispatch import backend_available
    from benchmarks.common import copy_bandwidth_gbs

    sizes = layer_sizes(smoke)
    timed = adaptive_timing(device, smoke)
    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 20 if smoke else 2 << 30)
    backend = "triton" if backend_available("triton") else "torch"
    rows = []
    for tokens in sizes["tokens"]:
        rows.append(_moe_row(tokens, sizes, device, smoke, compile_twin, timed, copy_gbs, backend))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for tokens in sizes["tokens"]:
        rows.append(_routing_row(tokens, sizes, device, timed, backend))
    return rows


COLUMNS = ["op", "tokens", "backend", "experts_hit", "weight_MB", "ms", "eager_ms", "GB/s", "%copy", "twin_ms",
           "x_twin", "compile_ms", "x_compile", "timing"]


def main() -> None:
    from benchmarks.common import op_bench_args, report

    args = op_bench_args(__doc__.splitlines()[0], lambda p: p.add_argument("--no-compile", action="store_true",
                                    help="skip the torch.compile baseline"))
    report(run(args.device, smoke=args.smoke, compile_twin=not args.no_compile), COLUMNS, args.json)


if __name__ == "__main__":
    main()
