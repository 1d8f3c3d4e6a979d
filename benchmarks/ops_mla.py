"""MLA decode attention (``atom_core.ops.mla_decode_attention``) at DeepSeek-V3 head shapes and DSA sparse
attention (``indexer_topk`` + ``mla_sparse_attention``) at DeepSeek-V3.2's, bf16, latent pool paged at the
engine's block size (16) with its blocks scattered over the pool.

Shapes from ``benchmarks/configs/deepseek-v3.json`` (H 128 heads, L = kv_lora_rank 512, R = qk_rope_head_dim
64, Dn = qk_nope_head_dim 128, Dv = v_head_dim 128) and ``deepseek-v3.2.json`` (Hi = index_n_heads 64,
Di = index_head_dim 128, K = index_topk 2048).

Decode (one query token per row; batch x context 64 x 4096, then 1 / 8 x 4096 and 64 x 1024 / 16384): the
op as a model calls it (``q_nope @ w_uk``, attention over the latent rows, ``@ w_uv^T``); bytes = the latent
rows read, ``B x S x (L + R) x 2`` (the weights ``w_uk`` / ``w_uv``, 33.5 MB, are not counted); that as a
share of a device-to-device copy measured in the same run (issue 13's target: >= 80% at 64 x 4096);
speedups over

* ``sdpa``: torch ``scaled_dot_product_attention`` (torch picks its backend) over per-head K/V already
  expanded out of the latent cache, ``K = [w_uk c_kv, k_pe]`` [B, H, S, Dn + R] and ``V = w_uv c_kv``
  [B, H, S, Dv] (what attention costs without the latent cache; the expansion is built outside the timed
  call; skipped past ``SDPA_MAX_EXPANDED_BYTES`` of K + V; ``max_diff_vs_sdpa``: max |ours - SDPA's output|,
  so a baseline computing something else shows),
* ``twin``: the reference twin (per-row gather, fp32), eager (it reads lengths on the host: no graph);
  only up to ``TWIN_MAX_CONTEXT_TOKENS`` context tokens in the batch.

DSA (one decode token per row at 32k context, top-k 2048; batch 1 and 64): the indexer (``indexer_topk``:
scores over the row's indexer keys, then top-k; bytes = the keys read, ``B x S x Di x 2``), the sparse
attention over the selected rows (``mla_sparse_attention``; bytes = ``B x K x (L + R) x 2``), both in one
timed call (a decode step's DSA attention), and dense MLA decode (``mla_decode_attention``) at the same
context. ``x_dense`` = dense ms / this row's ms (issue 13's target: indexer + sparse >= 4x faster than
dense). Then the same with fp8 pools, as ``Engine(kv_cache_dtype="fp8")`` keeps them: latent rows in e4m3
over a per-tensor scale (dense and sparse read 576 bytes a row), indexer keys in e4m3 with one fp32 scale a
key (``B x S x (Di + 4)`` bytes).

Every figure is timed the same way (``benchmarks.common.adaptive_timing``, warm-up first, so Triton's
compilation never lands in a timed call, and a CUDA graph requested); the ``timing`` column says which
figures fell back to eager calls and why.

    python -m benchmarks.ops_mla [--device cuda] [--json out.json] [--smoke] [--no-twin] [--sweep]

``--sweep`` times the decode kernel's tile configs (heads per program, rows per tile, warps, stages) at
64 x 4096 instead, the default config first (a few minutes: each config compiles).

``--smoke`` runs tiny sizes in fp32 so the script can be checked on a CPU, where the Triton kernels run in
the interpreter.
"""

# B rows, S context, H heads, L kv_lora_rank, R qk_rope_head_dim, Dn / Dv nope / value head dims,
# Hi / Di indexer heads / head dim, K top-k, NB pool blocks, BS block size

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import adaptive_timing, guarded, kernel_backend, ms_of, ratio, timing_column

CONFIGS = Path(__file__).with_name("configs")
BLOCK_SIZE = 16  # the engine's default block size
DECODE = [(64, 4096), (1, 4096), (8, 4096), (64, 1024), (64, 16384)]
DSA = [(1, 32768), (64, 32768)]
# K and V expanded for the SDPA baseline: 64 x 4096 needs 21.5 GB; 64 x 16384 would need 86 GB.
SDPA_MAX_EXPANDED_BYTES = 32 << 30
TWIN_MAX_CONTEXT_TOKENS = 64 * 4096
def _configs():
    """(the sweep's tile configs, the smoke sweep's); imported late: Triton's interpreter is switched on first."""
    from atom_core.ops.triton.mla_decode import MLAConfig

    return ([MLAConfig(h, n, w, st) for h in (16, 32, 64) for n in (16, 32, 64) for w in (4, 8) for st in (1, 2)],
            [MLAConfig(4, 16, 4, 1)])


SMOKE = {"heads": 4, "latent": 32, "rope": 8, "nope": 16, "v_dim": 16, "index_heads": 4, "index_dim": 16, "topk": 8,
         "block_size": 4, "dtype": torch.float32, "decode": [(2, 20)], "dsa": [(2, 40)]}


def sizes(smoke: bool) -> dict:
    """Head shapes (from the configs), block size, dtype and the cases to run."""
    if smoke:
        return SMOKE
    v3 = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    v32 = json.loads((CONFIGS / "deepseek-v3.2.json").read_text())
    return {"heads": v3["num_attention_heads"], "latent": v3["kv_lora_rank"], "rope": v3["qk_rope_head_dim"],
            "nope": v3["qk_nope_head_dim"], "v_dim": v3["v_head_dim"], "index_heads": v32["index_n_heads"],
            "index_dim": v32["index_head_dim"], "topk": v32["index_topk"], "block_size": BLOCK_SIZE,
            "dtype": torch.bfloat16, "decode": DECODE, "dsa": DSA}


@dataclass
class Problem:
    """``rows`` decode rows of equal ``context``: queries, the latent pool, kv_b_proj's halves, the layout."""

    q_nope: torch.Tensor        # [B, H, Dn]
    q_pe: torch.Tensor          # [B, H, R]
    mla_cache: torch.Tensor     # [NB, BS, L + R]
    w_uk: torch.Tensor          # [H, Dn, L]
    w_uv: torch.Tensor          # [H, Dv, L]
    block_tables: torch.Tensor  # int32 [B, P]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    context_lens: torch.Tensor  # int32 [B]
    context: int
    scale: float

    def layout(self):
        return self.block_tables, self.cu_seqlens_q, self.context_lens, 1, self.context

    @property
    def latent_bytes(self) -> int:
        """Bytes of the latent rows one decode step reads: every row of every context once."""
        return self.q_nope.shape[0] * self.context * self.mla_cache.shape[2] * self.mla_cache.element_size()


def make_problem(rows: int, context: int, s: dict, device, seed: int = 0) -> Problem:
    g = torch.Generator(device=device).manual_seed(seed)
    heads, latent, rope, block_size, dtype = s["heads"], s["latent"], s["rope"], s["block_size"], s["dtype"]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    pages = math.ceil(context / block_size)
    num_blocks = rows * pages
    kv_b = randn(heads * (s["nope"] + s["v_dim"]), latent, scale=latent ** -0.5)  # kv_b_proj.weight, split as a model does
    w = kv_b.view(heads, s["nope"] + s["v_dim"], latent)
    perm = torch.randperm(num_blocks, generator=g, device=device)
    return Problem(q_nope=randn(rows, heads, s["nope"]), q_pe=randn(rows, heads, rope),
                   mla_cache=randn(num_blocks, block_size, latent + rope), w_uk=w[:, :s["nope"]],
                   w_uv=w[:, s["nope"]:], block_tables=perm.to(torch.int32).view(rows, pages),
                   cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=device),
                   context_lens=torch.full((rows,), context, dtype=torch.int32, device=device), context=context,
                   scale=(s["nope"] + rope) ** -0.5)


def expanded_kv_bytes(rows: int, context: int, s: dict) -> int:
    return rows * s["heads"] * context * (s["nope"] + s["rope"] + s["v_dim"]) * s["dtype"].itemsize


def expand_kv(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head K [B, H, S, Dn + R] and V [B, H, S, Dv] from the latent rows, one row of the batch at a time
    (peak memory: K and V plus one row's expansion)."""
    rows, heads, nope = p.q_nope.shape
    latent, v_dim = p.w_uk.shape[2], p.w_uv.shape[1]
    rope = p.mla_cache.shape[2] - latent
    k = torch.empty(rows, heads, p.context, nope + rope, dtype=p.q_nope.dtype, device=p.q_nope.device)
    v = torch.empty(rows, heads, p.context, v_dim, dtype=p.q_nope.dtype, device=p.q_nope.device)
    for b in range(rows):
        dense = p.mla_cache[p.block_tables[b].long()].reshape(-1, latent + rope)[:p.context]  # [S, L + R]
        c_kv, k_pe = dense[:, :latent], dense[:, latent:]
        k[b, :, :, :nope] = (c_kv @ p.w_uk.reshape(heads * nope, latent).T).view(p.context, heads, nope).transpose(0, 1)
        k[b, :, :, nope:] = k_pe[None]
        v[b] = (c_kv @ p.w_uv.reshape(heads * v_dim, latent).T).view(p.context, heads, v_dim).transpose(0, 1)
    return k, v


def _device_index(device: str) -> int | None:
    """The CUDA device index of ``device`` (the kernels' default config depends on it), None off CUDA."""
    d = torch.device(device)
    return (torch.cuda.current_device() if d.index is None else d.index) if d.type == "cuda" else None


def _bandwidth(nbytes: int, ms: float, copy_gbs: float) -> dict:
    gbs = nbytes / (ms * 1e-3) / 1e9
    return {"MB_read": nbytes / 1e6, "GB/s": gbs, "%copy": 100 * gbs / copy_gbs}


def _decode_row(rows, context, s, device, timed, copy_gbs, twin_baseline) -> dict:
    from atom_core.ops import mla_decode_attention
    from atom_core.ops.dispatch import triton_interpret
    from atom_core.ops.reference import mla as twin
    from atom_core.ops.triton.mla_decode import choose_splits, default_config, latent_pads

    backend = kernel_backend(device)
    p = make_problem(rows, context, s, device)
    out = torch.empty(rows, s["heads"], s["v_dim"], dtype=s["dtype"], device=device)
    ours = timed(lambda: mla_decode_attention(p.q_nope, p.q_pe, p.mla_cache, p.w_uk, p.w_uv, *p.layout(),
                                              scale=p.scale, out=out, backend=backend))
    dense = {}

    def expanded_sdpa():
        if expanded_kv_bytes(rows, context, s) > SDPA_MAX_EXPANDED_BYTES:
            raise MemoryError(f"expanded K/V of {expanded_kv_bytes(rows, context, s) / 2**30:.0f} GiB "
                              f"(limit {SDPA_MAX_EXPANDED_BYTES / 2**30:.0f} GiB)")
        dense["k"], dense["v"] = expand_kv(p)
        q = torch.cat([p.q_nope, p.q_pe], dim=-1)[:, :, None]  # [B, H, 1, Dn + R]
        sdpa_out = F.scaled_dot_product_attention(q, dense["k"], dense["v"], scale=p.scale)[:, :, 0]
        # Same math: a baseline that disagrees would time something else.
        dense["max_diff"] = (sdpa_out.float() - out.float()).abs().max().item()
        return lambda: F.scaled_dot_product_attention(q, dense["k"], dense["v"], scale=p.scale)

    sdpa = guarded(timed, expanded_sdpa)
    max_diff = dense.get("max_diff")
    dense.clear()
    twin_t = None
    if twin_baseline and rows * context <= TWIN_MAX_CONTEXT_TOKENS:
        twin_t = guarded(timed, lambda: lambda: twin.mla_decode_attention(
            p.q_nope, p.q_pe, p.mla_cache, p.w_uk, p.w_uv, *p.layout(), scale=p.scale), graph=False)
    block_h = default_config(s["heads"], latent_pads(s["latent"], s["rope"])[0], s["dtype"], triton_interpret(),
                             _device_index(device)).block_h
    splits = choose_splits(rows, math.ceil(s["heads"] / block_h), max(16, block_h), context, torch.device(device))
    ms = ours.ms
    return {"case": "mla decode", "batch": rows, "context": context, "topk": None, "backend": backend,
            "splits": splits, "ms": ms,
            **_bandwidth(p.latent_bytes, ms, copy_gbs),
            "sdpa_ms": ms_of(sdpa), "x_sdpa": ratio(ms_of(sdpa), ms), "max_diff_vs_sdpa": max_diff,
            "twin_ms": ms_of(twin_t),
            "x_twin": ratio(ms_of(twin_t), ms), "dense_ms": None, "x_dense": None,
            "timing": timing_column({"ms": ours, "sdpa_ms": sdpa, "twin_ms": twin_t})}


def _dsa_rows(rows, context, s, device, timed, copy_gbs, fp8=False) -> list[dict]:
    """Dense MLA decode, the indexer, the sparse attention and indexer + sparse at one (batch, context); fp8:
    both pools as ``kv_cache_dtype="fp8"`` makes them (latent rows over a per-tensor scale, indexer keys
    quantized by ``store_indexer_k_`` with one scale a key), the dense side over the same fp8 latent pool."""
    from atom_core.ops import indexer_topk, mla_decode_attention, mla_sparse_attention, store_indexer_k_

    backend = kernel_backend(device)
    p = make_problem(rows, context, s, device, seed=1)
    g = torch.Generator(device=device).manual_seed(2)
    index_heads, index_dim, topk = s["index_heads"], s["index_dim"], s["topk"]
    q_idx = torch.randn(rows, index_heads, index_dim, generator=g, device=device).to(s["dtype"])
    weights = torch.randn(rows, index_heads, generator=g, device=device) * index_heads ** -0.5
    keys = torch.randn(p.mla_cache.shape[0] * p.mla_cache.shape[1], index_dim, generator=g, device=device)
    kv_scale = key_scale = None
    if fp8:
        kv_scale = (p.mla_cache.float().abs().amax() / 448).reshape(1)
        p.mla_cache = (p.mla_cache.float() / kv_scale).to(torch.float8_e4m3fn)
        indexer_cache = torch.empty(*p.mla_cache.shape[:2], index_dim, dtype=torch.float8_e4m3fn, device=device)
        key_scale = torch.empty(p.mla_cache.shape[:2], device=device)
        store_indexer_k_(keys.to(s["dtype"]), indexer_cache, torch.arange(keys.shape[0], device=device),
                         indexer_scale=key_scale, backend=backend)
    else:
        indexer_cache = keys.to(s["dtype"]).view(*p.mla_cache.shape[:2], index_dim)
    del keys
    index_scale = index_dim ** -0.5
    selected = torch.empty(rows, topk, dtype=torch.int32, device=device)
    out = torch.empty(rows, s["heads"], s["v_dim"], dtype=s["dtype"], device=device)

    def indexer():
        indexer_topk(q_idx, weights, indexer_cache, *p.layout(), topk=topk, scale=index_scale, indexer_scale=key_scale,
                     out=selected, backend=backend)

    def sparse():
        mla_sparse_attention(p.q_nope, p.q_pe, p.mla_cache, p.w_uk, p.w_uv, selected, *p.layout(), scale=p.scale,
                             kv_scale=kv_scale, out=out, backend=backend)

    def both():
        indexer()
        sparse()

    indexer()  # the selection the sparse rows read (random scores: scattered positions)
    dense = timed(lambda: mla_decode_attention(p.q_nope, p.q_pe, p.mla_cache, p.w_uk, p.w_uv, *p.layout(),
                                               scale=p.scale, kv_scale=kv_scale, out=out, backend=backend))
    row_bytes = p.mla_cache.shape[2] * p.mla_cache.element_size()
    key_bytes = rows * context * (index_dim * indexer_cache.element_size() + (4 if fp8 else 0))
    selected_rows = rows * min(topk, context)
    tag = " (fp8 pools)" if fp8 else ""
    cases = [("mla decode (dense)" + tag, None, dense, p.latent_bytes),
             ("dsa indexer" + tag, None, timed(indexer), key_bytes),
             ("dsa sparse attention" + tag, topk, timed(sparse), selected_rows * row_bytes),
             ("dsa indexer + sparse" + tag, topk, timed(both), key_bytes + selected_rows * row_bytes)]
    out_rows = []
    for case, k, timing, nbytes in cases:
        out_rows.append({"case": case, "batch": rows, "context": context, "topk": k, "backend": backend,
                         "splits": None, "ms": timing.ms, **_bandwidth(nbytes, timing.ms, copy_gbs),
                         "sdpa_ms": None, "x_sdpa": None, "twin_ms": None, "x_twin": None,
                         "dense_ms": dense.ms, "x_dense": dense.ms / timing.ms,
                         "timing": timing_column({"ms": timing, "dense_ms": dense})})
    return out_rows


def _sweep_rows(s, device, timed, copy_gbs, smoke) -> list[dict]:
    """The Triton decode kernel's tile configs (``mla_decode.MLAConfig``) at the first decode case, each
    timed alone; the default config is the one ``default_config`` picks."""
    from atom_core.ops.dispatch import triton_interpret
    from atom_core.ops.triton import mla_decode

    rows, context = s["decode"][0]
    p = make_problem(rows, context, s, device)
    out = torch.empty(rows, s["heads"], s["v_dim"], dtype=s["dtype"], device=device)
    default = mla_decode.default_config(s["heads"], mla_decode.latent_pads(s["latent"], s["rope"])[0], s["dtype"],
                                        triton_interpret(), _device_index(device))
    configs = _configs()[1 if smoke else 0]
    out_rows = []
    for config in [default] + [c for c in configs if c != default]:
        def call(config=config):
            mla_decode.mla_decode_attention(p.q_nope, p.q_pe, p.mla_cache, p.w_uk, p.w_uv, *p.layout(), p.scale, None,
                                            out, config=config)

        timing = guarded(timed, lambda call=call: call)
        row = {"case": "mla decode config" + (" (default)" if config == default else ""), "batch": rows,
               "context": context, "backend": "triton", "block_h": config.block_h, "block_n": config.block_n,
               "num_warps": config.num_warps, "num_stages": config.num_stages, "ms": ms_of(timing),
               "timing": timing_column({"ms": timing})}
        if timing is not None:
            row |= _bandwidth(p.latent_bytes, timing.ms, copy_gbs)
        out_rows.append(row)
        print(row, flush=True)
    return out_rows


def run(device: str = "cuda", smoke: bool = False, twin_baseline: bool = True, sweep: bool = False) -> list[dict]:
    """One row per case. Times in ms; bandwidth in GB/s (1e9 bytes/s) and % of the copy bandwidth. ``sweep``:
    the decode kernel's tile configs at the first decode case instead."""
    from benchmarks.common import copy_bandwidth_gbs

    s = sizes(smoke)
    timed = adaptive_timing(device, smoke)
    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 20 if smoke else 2 << 30)
    if sweep:
        return _sweep_rows(s, device, timed, copy_gbs, smoke)
    rows = []
    for batch, context in s["decode"]:
        rows.append(_decode_row(batch, context, s, device, timed, copy_gbs, twin_baseline))
        print(rows[-1], flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for fp8 in (False, True):
        for batch, context in s["dsa"]:
            rows += _dsa_rows(batch, context, s, device, timed, copy_gbs, fp8=fp8)
            for row in rows[-4:]:
                print(row, flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


SWEEP_COLUMNS = ["case", "batch", "context", "block_h", "block_n", "num_warps", "num_stages", "ms", "GB/s", "%copy",
                 "timing"]
COLUMNS = ["case", "batch", "context", "topk", "backend", "splits", "ms", "MB_read", "GB/s", "%copy", "sdpa_ms",
           "x_sdpa", "max_diff_vs_sdpa", "twin_ms", "x_twin", "x_dense", "timing"]


def main() -> None:
    from benchmarks.common import op_bench_args, report

    def flags(parser):
        parser.add_argument("--no-twin", action="store_true", help="baselines: SDPA only (skip the slow reference twin)")
        parser.add_argument("--sweep", action="store_true",
                            help="instead: the decode kernel's tile configs at batch 64 x 4096 (a few minutes)")

    args = op_bench_args(__doc__.splitlines()[0], flags)
    report(run(args.device, smoke=args.smoke, twin_baseline=not args.no_twin, sweep=args.sweep),
           SWEEP_COLUMNS if args.sweep else COLUMNS, args.json)


if __name__ == "__main__":
    main()
