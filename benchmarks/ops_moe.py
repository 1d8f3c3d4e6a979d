"""One Qwen3-30B-A3B MoE layer (``benchmarks/configs/qwen3-30b-a3b.json``: E 128, K 8, H 2048,
I 768, bf16) at T = 1, 8, 64, 512, 4096 tokens: ``fused_experts`` and its routing, ``topk_softmax``;
and ``fused_experts_quant`` with quantized expert weights: FP8 128 x 128 blocks (``fp8_block``) and FP8
per-channel (``fp8_channel``) at the same Qwen3-30B-A3B shapes, MXFP4 kept packed (``mxfp4``) at
GPT-OSS-20B's (``benchmarks/configs/gpt-oss-20b.json``: E 32, K 4, H = I = 2880, ``swiglu_clamped`` with
biases), each against bf16 ``fused_experts`` on the same (dequantized) weights, routing and tokens, timed
in the same run (``bf16_ms``, ``x_bf16``: the speedup of reading fewer bytes).

For ``fused_experts``: median time of the op through atom_core's dispatch — on a GPU, of CUDA-graph
replays (``ms``: what a decode step captured in a graph pays) and of eager calls (``eager_ms``:
Python and launch overhead included); the bytes of expert weights the step must read,
``experts hit x 3 x H x I x bytes per element`` (the distinct experts in topk_ids: each needs its
gate, up and down matrices once), over ``ms``, as GB/s and as a share of a device-to-device copy
measured in the same run (target: >= 50% at 1-64 tokens, where reading the weights is the whole
cost; for quantized weights the bytes per weight are 1 for fp8 and 0.5 + 1/32 for MXFP4, scales
counted in; issue 12's target for fp8: >= 60% at 1-64 tokens); speedup over the expert-loop twin, eager
and (bf16 only) under ``torch.compile`` (its per-expert token
lists have data-dependent sizes, so the compiled twin runs in pieces between graph breaks, and
neither can be captured in a CUDA graph). Routing rows give the time and the speedup over the twin.

Every figure but ``eager_ms`` is timed the same way (``benchmarks.common.adaptive_timing`` with a CUDA
graph requested); the row's ``timing`` column says which figures fell back to eager calls and why
(on a GPU, the twins', whose data-dependent sizes defeat capture) and that ``eager_ms`` is eager by
design.

    python -m benchmarks.ops_moe [--device cuda] [--json out.json] [--smoke] [--no-compile]
                                 [--formats bf16 fp8_block fp8_channel mxfp4] [--tokens 1 2 4 8]
    python -m benchmarks.ops_moe --sweep {bf16,fp8_block,fp8_channel,mxfp4} [--which regime | all] [--tokens 1 8 64 512 4096]
                                 [--json out.json]

``--smoke`` runs tiny sizes (and no torch.compile) so the script can be checked on a CPU, where the
Triton kernels run in the interpreter.

``--sweep FORMAT`` runs nothing else: it times the Triton kernels with FORMAT experts under every launch
candidate (MXFP4: GPT-OSS-20B's layer and ``atom_core.ops.triton.fused_moe.MXFP4_BLOCK_CONFIGS``; fp8:
Qwen3-30B-A3B's layer and :func:`fp8_sweep_configs`; bf16: ``fused_experts`` on that layer's dequantized fp8
weights, :func:`bf16_sweep_configs`; ``--which regime``, the default: the candidates of
the token count's own regime of rows per expert; ``all``: every candidate at every token count), one row
per (tokens, config), each against bf16 ``fused_experts`` on the same layer and routing
(``bf16_ms``, ``x_bf16``), with ``%copy`` as above and ``rel_err``, the output's largest difference from
the bf16 kernel's as a share of its largest magnitude (accumulation order alone: a config that computes
something else shows); ``default`` marks ``quant_block_config``'s choice. A second table gives the
fastest config per token count.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from benchmarks.common import adaptive_timing, guarded, ms_of, ratio, timing_column

CONFIG = Path(__file__).with_name("configs") / "qwen3-30b-a3b.json"
GPT_OSS_CONFIG = Path(__file__).with_name("configs") / "gpt-oss-20b.json"
TOKENS = [1, 8, 64, 512, 4096]
SMOKE = dict(num_experts=8, top_k=2, hidden=64, inter=32, tokens=[1, 8], dtype=torch.float32)
FORMATS = ("bf16", "fp8_block", "fp8_channel", "mxfp4")
# Bytes of one expert weight as stored, scales included: fp8 blocks add 4 bytes per 128 x 128, per-channel
# 4 per row (both < 0.1%: counted as 1); MXFP4 half a byte plus one e8m0 byte per 32.
BYTES_PER_WEIGHT = {"fp8_block": 1.0, "fp8_channel": 1.0, "mxfp4": 0.5 + 1 / 32}
MXFP4_E8M0 = 127 - 7  # random MXFP4 weights: codes of RMS 2.9 times 2**-7, about the bf16 weights' H**-0.5


def layer_sizes(smoke: bool, config: Path = CONFIG) -> dict:
    if smoke:
        return SMOKE
    cfg = json.loads(config.read_text())
    return dict(num_experts=cfg.get("num_experts", cfg.get("num_local_experts")), top_k=cfg["num_experts_per_tok"],
                hidden=cfg["hidden_size"], inter=cfg.get("moe_intermediate_size", cfg["intermediate_size"]),
                tokens=TOKENS, dtype=torch.bfloat16)


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
        "op": "fused_experts", "format": "bf16", "shapes": "qwen3-30b-a3b", "tokens": tokens, "backend": backend,
        "experts_hit": experts_hit,
        "weight_MB": weight_bytes / 1e6, "ms": ms, "eager_ms": eager.ms, "GB/s": gbs, "%copy": 100 * gbs / copy_gbs,
        "twin_ms": twin_ms, "x_twin": ratio(twin_ms, ms),
        "compile_ms": compile_ms, "x_compile": ratio(compile_ms, ms),
        "timing": timing_column({"ms": ours, "eager_ms": eager, "twin_ms": twin_t, "compile_ms": compiled}),
    }


def quantized_layer(weight_format: str, layer: dict, sizes: dict, device, seed: int = 0) -> dict:
    """The layer's expert weights in ``weight_format`` and the bf16 (or smoke fp32) weights they dequantize to:
    ``w13 / w13_scale / w2 / w2_scale`` and ``w13_ref / w2_ref``. fp8: the random weights of ``make_layer``
    quantized one expert at a time (``models.quantization.quantize_weight``); MXFP4: random codes and one
    power-of-two scale (GPT-OSS's layout)."""
    from atom_core.models.quantization import (
        FP8_BLOCK_128,
        FP8_PER_CHANNEL,
        quantize_weight,
    )
    from atom_core.ops.reference.moe import dequantize_weight

    out = {}
    if weight_format == "mxfp4":
        g = torch.Generator(device=device).manual_seed(seed + 1)
        e, h, i = sizes["num_experts"], sizes["hidden"], sizes["inter"]
        for name, rows, cols in (("w13", 2 * i, h), ("w2", h, i)):
            codes = torch.randint(0, 256, (e, rows, cols // 2), generator=g, device=device, dtype=torch.int32)
            out[name] = codes.to(torch.uint8)
            out[f"{name}_scale"] = torch.full((e, rows, cols // 32), MXFP4_E8M0, dtype=torch.uint8, device=device)
    else:
        fmt = FP8_BLOCK_128 if weight_format == "fp8_block" else FP8_PER_CHANNEL
        for name in ("w13", "w2"):
            pairs = [quantize_weight(w, fmt) for w in layer[name]]
            out[name] = torch.stack([q for q, _ in pairs])
            out[f"{name}_scale"] = torch.stack([s for _, s in pairs])
    for name in ("w13", "w2"):
        out[f"{name}_ref"] = torch.stack([dequantize_weight(w, s, weight_format).to(sizes["dtype"])
                                          for w, s in zip(out[name], out[f"{name}_scale"])])
    return out


def quant_layer_inputs(weight_format: str, tokens: int, sizes: dict, device) -> dict:
    """One quantized MoE layer's call: ``hidden``, routing ``weights`` / ``ids``, ``quant``
    (:func:`quantized_layer`), ``activation`` and ``biases`` (MXFP4: GPT-OSS's swiglu_clamped and expert
    biases; fp8: silu, none)."""
    from atom_core.ops.moe_routing import topk_softmax

    layer = make_layer(tokens, sizes, device)
    weights, ids = topk_softmax(layer["router_logits"], sizes["top_k"], renormalize=True)
    quant = quantized_layer(weight_format, layer, sizes, device)
    del layer["w13"], layer["w2"]
    gpt_oss = weight_format == "mxfp4"
    biases = {}
    if gpt_oss:  # GPT-OSS's expert biases
        g = torch.Generator(device=device).manual_seed(7)
        biases = {name: (0.1 * torch.randn(sizes["num_experts"], rows, generator=g, device=device)).to(sizes["dtype"])
                  for name, rows in (("w13_bias", 2 * sizes["inter"]), ("w2_bias", sizes["hidden"]))}
    return {"hidden": layer["hidden"], "weights": weights, "ids": ids, "quant": quant,
            "activation": "swiglu_clamped" if gpt_oss else "silu", "biases": biases}


def _quant_row(weight_format, shapes, tokens, sizes, device, timed, copy_gbs, backend):
    """``fused_experts_quant`` against bf16 ``fused_experts`` on the weights it dequantizes to."""
    from atom_core.ops.fused_moe import fused_experts, fused_experts_quant
    from atom_core.ops.reference import moe as twin

    inputs = quant_layer_inputs(weight_format, tokens, sizes, device)
    hidden, weights, ids, quant = inputs["hidden"], inputs["weights"], inputs["ids"], inputs["quant"]
    activation, biases = inputs["activation"], inputs["biases"]
    out = torch.empty_like(hidden)
    args = (hidden, quant["w13"], quant["w13_scale"], quant["w2"], quant["w2_scale"], weights, ids)

    def call():
        return fused_experts_quant(*args, weight_format=weight_format, activation=activation, out=out,
                                   backend=backend, **biases)

    ours = timed(call)
    eager = timed(call, graph=False) if str(device).startswith("cuda") else ours
    bf16_args = (hidden, quant["w13_ref"], quant["w2_ref"], weights, ids)
    bf16_out = torch.empty_like(hidden)
    bf16 = guarded(timed, lambda: lambda: fused_experts(*bf16_args, activation=activation, out=bf16_out,
                                                       backend=backend, **biases))
    twin_t = guarded(timed, lambda: lambda: twin.fused_experts_quant(*args, weight_format, activation,
                                                                     biases.get("w13_bias"), biases.get("w2_bias")))
    experts_hit = int(torch.unique(ids).numel())
    weight_bytes = experts_hit * 3 * sizes["hidden"] * sizes["inter"] * BYTES_PER_WEIGHT[weight_format]
    gbs = weight_bytes / (ours.ms * 1e-3) / 1e9
    bf16_ms, twin_ms = ms_of(bf16), ms_of(twin_t)
    return {
        "op": "fused_experts_quant", "format": weight_format, "shapes": shapes, "tokens": tokens, "backend": backend,
        "experts_hit": experts_hit, "weight_MB": weight_bytes / 1e6, "ms": ours.ms, "eager_ms": eager.ms,
        "GB/s": gbs, "%copy": 100 * gbs / copy_gbs, "bf16_ms": bf16_ms, "x_bf16": ratio(bf16_ms, ours.ms),
        "twin_ms": twin_ms, "x_twin": ratio(twin_ms, ours.ms), "compile_ms": None, "x_compile": None,
        "timing": timing_column({"ms": ours, "eager_ms": eager, "bf16_ms": bf16, "twin_ms": twin_t}),
    }


def _routing_row(tokens, sizes, device, timed, backend):
    from atom_core.ops.moe_routing import topk_softmax
    from atom_core.ops.reference import moe as twin

    logits = make_layer(tokens, sizes, device)["router_logits"]
    ours = timed(lambda: topk_softmax(logits, sizes["top_k"], renormalize=True, backend=backend))
    twin_t = guarded(timed, lambda: lambda: twin.topk_softmax(logits, sizes["top_k"], True))
    return {"op": "topk_softmax", "tokens": tokens, "backend": backend, "ms": ours.ms, "twin_ms": ms_of(twin_t),
            "x_twin": ratio(ms_of(twin_t), ours.ms), "timing": timing_column({"ms": ours, "twin_ms": twin_t})}


def run(device: str = "cuda", smoke: bool = False, compile_twin: bool = True, formats=FORMATS,
        tokens=None) -> list[dict]:
    """One row per (op, weight format, token count; ``tokens`` default: the layer's TOKENS). Times in ms;
    bandwidth in GB/s (1e9 bytes/s)."""
    from benchmarks.common import copy_bandwidth_gbs, kernel_backend

    sizes = layer_sizes(smoke)
    if tokens:
        sizes = {**sizes, "tokens": list(tokens)}
    timed = adaptive_timing(device, smoke)
    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 20 if smoke else 2 << 30)
    backend = kernel_backend(device)
    rows = []
    for weight_format in formats:
        for tokens in sizes["tokens"]:
            if weight_format == "bf16":
                rows.append(_moe_row(tokens, sizes, device, smoke, compile_twin, timed, copy_gbs, backend))
            elif weight_format == "mxfp4":
                gpt_oss = {**layer_sizes(smoke, GPT_OSS_CONFIG), "tokens": sizes["tokens"]}
                rows.append(_quant_row(weight_format, "gpt-oss-20b", tokens, gpt_oss, device, timed, copy_gbs,
                                       backend))
            else:
                rows.append(_quant_row(weight_format, "qwen3-30b-a3b", tokens, sizes, device, timed, copy_gbs,
                                       backend))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    for tokens in sizes["tokens"]:
        rows.append(_routing_row(tokens, sizes, device, timed, backend))
    return rows


COLUMNS = ["op", "format", "shapes", "tokens", "backend", "experts_hit", "weight_MB", "ms", "eager_ms", "GB/s",
           "%copy", "bf16_ms", "x_bf16", "twin_ms", "x_twin", "compile_ms", "x_compile", "timing"]


# Launch candidates of ``--sweep FORMAT`` for the fp8 formats, by token count (BLOCK_K is 128: one weight
# block column / activation group per K step). Decode sizes try 16-row tiles; from 12 rows per expert, where
# many experts pass 16 rows, 32-row tiles beside them and the 64-row ones above; prefill sizes (compute-bound)
# try taller and wider tiles than the defaults. The gate/up kernel holds two [BLOCK_M, BLOCK_N] fp32
# accumulators: 128 x 128 needs 8 warps.
def fp8_sweep_configs(tokens: int, sizes: dict, which: str = "regime") -> list:
    """The launch configs ``--sweep fp8_*`` times at ``tokens`` (``which="all"``: every candidate below at every
    token count; ``"regime"``: those of the token count's rows per expert: decode, 32-row blocks or prefill)."""
    from atom_core.ops.triton.fused_moe import BlockConfig, rows_per_expert

    decode = [BlockConfig(16, 32, 128, 1, 4, 3), BlockConfig(16, 64, 128, 1, 4, 3), BlockConfig(16, 64, 128, 1, 4, 4),
              BlockConfig(16, 64, 128, 1, 4, 6), BlockConfig(16, 128, 128, 1, 4, 4)]
    rows32 = [BlockConfig(*c) for c in (
        (16, 64, 128, 1, 4, 3), (32, 64, 128, 1, 4, 3), (32, 64, 128, 4, 4, 3), (32, 64, 128, 1, 4, 2),
        (32, 128, 128, 1, 4, 3), (32, 128, 128, 1, 8, 3), (64, 64, 128, 8, 4, 3))]
    prefill = [BlockConfig(*c) for c in (
        (64, 64, 128, 8, 4, 3), (128, 64, 128, 8, 8, 3), (64, 128, 128, 8, 4, 3), (64, 128, 128, 8, 8, 4),
        (128, 128, 128, 8, 8, 3), (128, 128, 128, 8, 8, 4), (128, 64, 128, 8, 4, 4), (256, 64, 128, 8, 8, 3))]
    if which == "all":
        return list(dict.fromkeys(decode + rows32 + prefill))
    m = rows_per_expert(tokens, sizes["top_k"], sizes["num_experts"])
    return decode if m <= 12 else rows32 if m <= 32 else prefill


def bf16_sweep_configs(tokens: int, sizes: dict, which: str = "regime") -> list:
    """The launch configs ``--sweep bf16`` times (``fused_experts``' own tiles, ``block_config``) at ``tokens``:
    the same candidates at every count (``which`` has nothing to choose between)."""
    from atom_core.ops.triton.fused_moe import BlockConfig

    return [BlockConfig(*c) for c in (
        (16, 32, 128, 1, 4, 3), (16, 64, 64, 1, 4, 3), (32, 64, 64, 4, 4, 4), (32, 64, 64, 1, 4, 3),
        (32, 64, 128, 1, 4, 3), (64, 64, 64, 8, 4, 3), (64, 64, 128, 8, 4, 3), (128, 64, 64, 8, 8, 3))]


def mxfp4_sweep_configs(tokens: int, sizes: dict, which: str = "regime") -> list:
    """The launch configs ``--sweep mxfp4`` times at ``tokens``: the candidates of the call's regime of
    rows per expert (``which="regime"``) or every candidate of every regime, each once (``"all"``)."""
    from atom_core.ops.triton.fused_moe import MXFP4_BLOCK_CONFIGS, mxfp4_regime

    if which == "regime":
        return list(MXFP4_BLOCK_CONFIGS[mxfp4_regime(tokens, sizes["top_k"], sizes["num_experts"])])
    return list(dict.fromkeys(cfg for configs in MXFP4_BLOCK_CONFIGS.values() for cfg in configs))


def config_name(cfg) -> str:
    """``BLOCK_MxBLOCK_NxBLOCK_K gGROUP_M wWARPS sSTAGES``."""
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}"


def sweep(weight_format: str = "mxfp4", device: str = "cuda", smoke: bool = False, which: str = "regime",
          tokens=None, json_path: str | None = None) -> list[dict]:
    """One row per (token count, launch config) of the Triton kernels with ``weight_format`` experts (MXFP4:
    GPT-OSS-20B's layer; fp8: Qwen3-30B-A3B's; smoke: the tiny sizes), timed as :func:`_quant_row` times them,
    against bf16 ``fused_experts`` on the same (dequantized) weights, routing and tokens. A config that fails
    (does not compile, too much shared memory) is a row with its ``error``. The rows are written to
    ``json_path`` after every token count."""
    from benchmarks.common import copy_bandwidth_gbs, require_triton_on, write_json

    require_triton_on(device, "--sweep")
    sizes = layer_sizes(smoke, GPT_OSS_CONFIG if weight_format == "mxfp4" else CONFIG)
    timed = adaptive_timing(device, smoke)
    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 20 if smoke else 2 << 30)
    candidates = {"mxfp4": mxfp4_sweep_configs, "bf16": bf16_sweep_configs}.get(weight_format, fp8_sweep_configs)
    rows = []
    for t in tokens or sizes["tokens"]:
        rows += _sweep_rows(weight_format, candidates(t, sizes, which), t, sizes, device, timed, copy_gbs)
        if json_path:
            write_json(rows, json_path)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _sweep_rows(weight_format, configs, tokens, sizes, device, timed, copy_gbs):
    """:func:`sweep`'s rows of one token count."""
    from atom_core.ops.fused_moe import fused_experts
    from atom_core.ops.triton import fused_moe as triton_moe
    from benchmarks.common import _reason

    plain = weight_format == "bf16"  # fused_experts' own tiles, on the fp8 layer's dequantized weights
    inputs = quant_layer_inputs("fp8_block" if plain else weight_format, tokens, sizes, device)
    hidden, weights, ids, quant = inputs["hidden"], inputs["weights"], inputs["ids"], inputs["quant"]
    activation, biases = inputs["activation"], inputs["biases"]
    bf16_out, out = torch.empty_like(hidden), torch.empty_like(hidden)

    def bf16_call():
        return fused_experts(hidden, quant["w13_ref"], quant["w2_ref"], weights, ids, activation=activation,
                             out=bf16_out, backend="triton", **biases)

    def call(cfg):
        if plain:
            return triton_moe.fused_experts(hidden, quant["w13_ref"], quant["w2_ref"], weights, ids, activation,
                                            None, None, out, config=cfg)
        return triton_moe.fused_experts_quant(hidden, quant["w13"], quant["w13_scale"], quant["w2"], quant["w2_scale"],
                                              weights, ids, weight_format, activation, biases.get("w13_bias"),
                                              biases.get("w2_bias"), out, config=cfg)

    bf16 = guarded(timed, lambda: bf16_call)  # (its runs leave bf16_out written)
    scale = None if bf16 is None else max(bf16_out.float().abs().max().item(), 1e-30)
    experts_hit = int(torch.unique(ids).numel())
    bytes_per_weight = hidden.element_size() if plain else BYTES_PER_WEIGHT[weight_format]
    weight_bytes = experts_hit * 3 * sizes["hidden"] * sizes["inter"] * bytes_per_weight
    if plain:
        default = triton_moe.block_config(tokens, sizes["top_k"], sizes["num_experts"], hidden.dtype)
    else:
        default = triton_moe.quant_block_config(tokens, sizes["top_k"], sizes["num_experts"], hidden.dtype,
                                                weight_format)
    regime = (triton_moe.mxfp4_regime(tokens, sizes["top_k"], sizes["num_experts"]) if weight_format == "mxfp4"
              else f"{triton_moe.rows_per_expert(tokens, sizes['top_k'], sizes['num_experts']):g} rows/expert")
    rows = []
    for cfg in dict.fromkeys([default, *configs]):  # the default always, first, as the others' yardstick
        row = {"format": weight_format, "tokens": tokens, "regime": regime, "config": config_name(cfg),
               "default": cfg == default, "experts_hit": experts_hit}
        try:
            call(cfg)
            err = None if scale is None else (out.float() - bf16_out.float()).abs().max().item() / scale
            ours = timed(functools.partial(call, cfg))
        except Exception as e:  # noqa: BLE001 - a config that fails is a row too
            rows.append({**row, "error": _reason(e)})
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        gbs = weight_bytes / (ours.ms * 1e-3) / 1e9
        rows.append({**row, "ms": ours.ms, "GB/s": gbs, "%copy": 100 * gbs / copy_gbs, "bf16_ms": ms_of(bf16),
                     "x_bf16": ratio(ms_of(bf16), ours.ms), "rel_err": err,
                     "timing": timing_column({"ms": ours, "bf16_ms": bf16})})
        print(rows[-1], flush=True)
    return rows


SWEEP_COLUMNS = ["format", "tokens", "regime", "config", "default", "experts_hit", "ms", "GB/s", "%copy", "bf16_ms", "x_bf16",
                 "rel_err", "timing", "error"]


def main() -> None:
    from benchmarks.common import op_bench_args, print_table, report

    def flags(parser):
        parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
        parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS),
                            help="expert weight formats to run (bf16: fused_experts)")
        parser.add_argument("--sweep", choices=FORMATS,
                            help="time the Triton kernels of this expert format under each launch candidate instead "
                                 "(bf16: fused_experts)")
        parser.add_argument("--which", choices=("regime", "all"), default="regime",
                            help="--sweep's candidates: the token count's own regime (default), or all at every count")
        parser.add_argument("--tokens", type=int, nargs="+",
                            help="token counts (default 1 8 64 512 4096; --smoke: 1 8)")

    args = op_bench_args(__doc__.splitlines()[0], flags)
    if args.sweep:
        rows = sweep(args.sweep, args.device, smoke=args.smoke, which=args.which, tokens=args.tokens,
                     json_path=args.json)
        report(rows, SWEEP_COLUMNS, args.json)
        best = {}
        for r in rows:
            if "ms" in r and (r["tokens"] not in best or r["ms"] < best[r["tokens"]]["ms"]):
                best[r["tokens"]] = r
        print("\nfastest per token count:")
        print_table(list(best.values()), SWEEP_COLUMNS[:-1])
        return
    report(run(args.device, smoke=args.smoke, compile_twin=not args.no_compile, formats=args.formats,
               tokens=args.tokens), COLUMNS, args.json)


if __name__ == "__main__":
    main()
