"""The selftest's cases of the DSA ops (``store_indexer_k_``, ``indexer_topk``, ``mla_sparse_attention``), in the
format of ``atom_core.ops.selftest_cases``: seeded inputs rebuilt at each run, outputs compared with the twin's.
Pool slots no row owns hold NaN, so a kernel that reads one fails. The top-k is checked as a choice, not
as a tensor: each query keeps ``min(K, p + 1)`` distinct visible positions and none of them scores below a
position left out by more than the dtype's rounding (fp32 scores recomputed here), so a kernel may order
its picks and break near-ties its own way. Shapes: the quick grid is small; the full grid adds
DeepSeek-V3.2's shapes (Hi = 64, Di = 128, K = 2048 over contexts past 2048; MLA heads 16 of 128 per rank,
L = 512, R = 64) and block size 1.

The cases are the same for every backend; for the Triton kernels they reach: the score kernel's visible and
invisible chunks (tokens at every position of a row), top-k of fewer positions than K (short contexts) and of
K = 2048 out of up to 3000, the sparse kernel's per-entry page lookups at BS = 1, 6, 16 and 64, split-K over the
K entries on a GPU (the long case: the split count follows the SM count), fp8 pools, and fp8 indexer keys with
their per-key scales (the write and the scores).

Legend: T tokens, Hi indexer heads, Di indexer head dim, K top-k, H heads, L kv_lora_rank,
R qk_rope_head_dim, NB blocks, BS block size.
"""

from __future__ import annotations

import torch

from atom_core import ops
from atom_core.cache import build_step_layout
from atom_core.ops.reference import dsa as reference_dsa
from atom_core.ops.reference.attention import gather_context
from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.reference.quant import per_token_quant
from atom_core.ops.selftest_cases import Case, close_outputs, closer, grid_dtypes, seeded_randn
from atom_core.ops.tolerances import ATTENTION, ELEMENTWISE, FP8_KV, tolerance

SMALL = {"index_heads": 4, "index_dim": 32, "heads": 4, "latent": 64, "rope": 16, "nope": 32, "v_dim": 32}
DEEPSEEK_V32 = {"index_heads": 64, "index_dim": 128, "heads": 16, "latent": 512, "rope": 64, "nope": 128,
                "v_dim": 128}


def store_indexer_k_cases(grid: str, device) -> list[Case]:
    shapes = [(6, 4, 16, 32)] if grid == "quick" else [(1, 8, 16, 128), (37, 6, 8, 128), (5, 7, 1, 64)]
    cases = []
    for tokens, blocks, block_size, dim in shapes:
        for dtype in grid_dtypes(grid):
            for fp8 in (False, True):
                def run(backend, dtype=dtype, tokens=tokens, blocks=blocks, block_size=block_size, dim=dim, fp8=fp8):
                    k = seeded_randn(40, tokens, dim, dtype=dtype, device=device)
                    cache = torch.zeros(blocks, block_size, dim, dtype=FP8_DTYPE if fp8 else dtype, device=device)
                    scale = torch.zeros(blocks, block_size, device=device) if fp8 else None
                    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(41))[:tokens]
                    slots[0] = -1  # a padding token writes nothing
                    ops.store_indexer_k_(k, cache, slots.to(device), indexer_scale=scale, backend=backend)
                    return (cache.float(),) if scale is None else (cache.float(), scale)

                label = f"T={tokens} NB={blocks} BS={block_size} Di={dim} {dtype}" + (" fp8 cache" if fp8 else "")
                cases.append(Case("store_indexer_k_", label, run, closer(ELEMENTWISE)(dtype)))
    return cases


def _inputs(query_lens, cached_lens, *, dtype, device, block_size, fp8=False, fp8_keys=False, index_heads,
            index_dim, heads, latent, rope, nope, v_dim):
    """A step over shuffled blocks: the indexer's q / weights / key cache (fp8_keys: float8_e4m3fn with one
    scale a key, quantized as ``store_indexer_k_`` does) and MLA's q / pool / weights."""
    g = torch.Generator().manual_seed(42)
    context = [q + c for q, c in zip(query_lens, cached_lens)]
    pages = [-(-n // block_size) for n in context]
    num_blocks = sum(pages) + 2  # two blocks nobody owns
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[sum(pages[:r]): sum(pages[:r + 1])] for r in range(len(pages))]
    layout = build_step_layout(query_lens, cached_lens, tables, block_size).to(device)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for table, n in zip(tables, context):
        owned[[table[j // block_size] * block_size + j % block_size for j in range(n)]] = True
    keys = seeded_randn(43, num_blocks * block_size, index_dim)
    keys[~owned] = float("nan")
    index_scale = None
    if fp8_keys:  # NaN rows stay NaN (scale and values)
        keys, index_scale = per_token_quant(keys, FP8_DTYPE)
        index_scale = index_scale.view(num_blocks, block_size).to(device)
    else:
        keys = keys.to(dtype)
    rows = seeded_randn(44, num_blocks * block_size, latent + rope)
    rows[~owned] = float("nan")
    kv_scale = torch.tensor([0.5], device=device) if fp8 else None
    pool = (rows / 0.5).to(FP8_DTYPE) if fp8 else rows.to(dtype)
    tokens = layout.num_tokens
    q_w = seeded_randn(47, heads * (nope + v_dim), latent, dtype=dtype, device=device, scale=latent ** -0.5)
    w = q_w.view(heads, nope + v_dim, latent)
    return {
        "layout": layout,
        "index_q": seeded_randn(45, tokens, index_heads, index_dim, dtype=dtype, device=device),
        "index_w": seeded_randn(46, tokens, index_heads, device=device),
        "index_cache": keys.view(num_blocks, block_size, index_dim).to(device), "index_scale": index_scale,
        "q": seeded_randn(48, tokens, heads, nope + rope, dtype=dtype, device=device),
        "nope": nope, "w_uk": w[:, :nope], "w_uv": w[:, nope:], "kv_scale": kv_scale,
        "mla_cache": pool.view(num_blocks, block_size, -1).to(device),
    }


def _layout_args(layout):
    return (layout.block_tables, layout.cu_seqlens_q, layout.context_lens, layout.max_seqlen_q, layout.max_seqlen_k)


def _topk_case(label: str, query_lens, cached_lens, *, topk, dtype, device, block_size=16, **shape) -> Case:
    def build():
        return _inputs(query_lens, cached_lens, dtype=dtype, device=device, block_size=block_size, **shape)

    def run(backend):
        x = build()
        return (ops.indexer_topk(x["index_q"], x["index_w"], x["index_cache"], *_layout_args(x["layout"]),
                                 topk=topk, scale=shape["index_dim"] ** -0.5, indexer_scale=x["index_scale"],
                                 backend=backend),)

    def check(got, want) -> str | None:
        x = build()
        lay = x["layout"]
        indices = got[0].cpu().long()
        if indices.shape != want[0].shape:
            return f"shape {tuple(indices.shape)}, expected {tuple(want[0].shape)}"
        starts, scale = lay.cu_seqlens_q.tolist(), shape["index_dim"] ** -0.5
        # A kernel scores in its own summation order from inputs rounded to ``dtype``: near-ties may flip.
        slack = tolerance(dtype, ATTENTION)["atol"] * 10
        for row, context_len in enumerate(lay.context_lens.tolist()):
            first, last = starts[row], starts[row + 1]
            pool = reference_dsa.indexer_keys(x["index_cache"], x["index_scale"]).unsqueeze(2).cpu()
            keys = gather_context(pool, lay.block_tables[row].cpu(), context_len)[:, 0] if context_len else None
            for i in range(last - first):
                t, pos = first + i, context_len - (last - first) + i
                kept = [int(j) for j in indices[t] if j >= 0]
                if len(kept) != len(set(kept)) or len(kept) != min(topk, pos + 1) or any(j > pos for j in kept):
                    return f"token {t} (position {pos}) keeps {sorted(kept)}"
                if not kept or len(kept) == pos + 1:
                    continue
                q = reference_dsa.indexer_queries(x["index_q"][t:t + 1].cpu(), x["index_cache"])
                scores = reference_dsa.index_scores(q, x["index_w"][t:t + 1].cpu(), keys[:pos + 1], scale=scale)[0]
                left_out = torch.ones(pos + 1, dtype=torch.bool)
                left_out[kept] = False
                if scores[kept].min() < scores[left_out].max() - slack * max(1.0, float(scores.abs().max())):
                    return (f"token {t} keeps a position scoring {float(scores[kept].min()):.4g} and leaves one "
                            f"scoring {float(scores[left_out].max()):.4g}")
        return None

    return Case("indexer_topk", label, run, check)


def _sparse_case(label: str, query_lens, cached_lens, *, topk, dtype, device, block_size=16, fp8=False,
                 **shape) -> Case:
    def run(backend):
        x = _inputs(query_lens, cached_lens, dtype=dtype, device=device, block_size=block_size, fp8=fp8, **shape)
        lay, nope = x["layout"], x["nope"]
        # The twin's choice, so that every backend attends over the same positions.
        indices = reference_dsa.indexer_topk(x["index_q"], x["index_w"], x["index_cache"], *_layout_args(lay),
                                             topk=topk, scale=shape["index_dim"] ** -0.5,
                                             indexer_scale=x["index_scale"])
        return (ops.mla_sparse_attention(x["q"][..., :nope], x["q"][..., nope:], x["mla_cache"], x["w_uk"],
                                         x["w_uv"], indices, *_layout_args(lay),
                                         scale=(nope + shape["rope"]) ** -0.5, kv_scale=x["kv_scale"],
                                         backend=backend),)

    tol = dict(zip(("atol", "rtol"), FP8_KV)) if fp8 else tolerance(dtype, ATTENTION)
    return Case("mla_sparse_attention", label, run, lambda got, want: close_outputs(got, want, tol))


def dsa_attention_cases(grid: str, device) -> list[Case]:
    batches = {"mixed": ([1, 5, 3], [7, 0, 12]), "decode": ([1, 1, 1, 1], [3, 17, 40, 1])}
    cases = []
    for dtype in grid_dtypes(grid):
        for name, (query_lens, cached_lens) in batches.items():
            for make in (_topk_case, _sparse_case):
                cases.append(make(f"{name} K=8 {dtype}", query_lens, cached_lens, topk=8, dtype=dtype,
                                  device=device, **SMALL))
                if grid == "full":
                    cases.append(make(f"{name} K=8 BS=1 {dtype}", query_lens, cached_lens, topk=8, dtype=dtype,
                                      device=device, block_size=1, **SMALL))
                    cases.append(make(f"{name} K=8 BS=6 {dtype}", query_lens, cached_lens, topk=8, dtype=dtype,
                                      device=device, block_size=6, **SMALL))
            cases.append(_topk_case(f"{name} K=8 fp8 keys {dtype}", query_lens, cached_lens, topk=8, dtype=dtype,
                                    device=device, fp8_keys=True, **SMALL))
        if grid == "full":
            long = ([1, 1, 3], [2100, 600, 3000])   # contexts past K = 2048 and below it
            for make in (_topk_case, _sparse_case):
                cases.append(make(f"long decode K=2048 DeepSeek-V3.2 shapes BS=64 {dtype}", *long, topk=2048,
                                  dtype=dtype, device=device, block_size=64, **DEEPSEEK_V32))
            cases.append(_sparse_case(f"mixed K=8 fp8 pool {dtype}", *batches["mixed"], topk=8, dtype=dtype,
                                      device=device, fp8=True, **SMALL))
            cases.append(_topk_case(f"long decode K=2048 fp8 keys DeepSeek-V3.2 shapes BS=64 {dtype}", *long,
                                    topk=2048, dtype=dtype, device=device, block_size=64, fp8_keys=True,
                                    **DEEPSEEK_V32))
    return cases


def dsa_cases(grid: str, device) -> list[Case]:
    """Every DSA op's cases (to be added to ``selftest_cases.all_cases``)."""
    return store_indexer_k_cases(grid, device) + dsa_attention_cases(grid, device)
