"""The selftest's cases of the MLA ops (``store_mla_``, ``mla_prefill_attention``, ``mla_decode_attention``),
in the format of ``atom_core.ops.selftest_cases``: seeded inputs rebuilt at each run, outputs compared
with the twin's under ``atom_core.ops.tolerances``. Pool slots no row owns hold NaN, so a kernel that
reads one fails. Shapes: the quick grid is small; the full grid adds DeepSeek-V3's head shapes
(H = 16 of 128 per rank, L = 512, R = 64, Dn = 128, Dv = 128), block size 1 and fp8 pools.

The cases are the same for every backend; for the Triton kernels they reach: the absorbed kernel's
one-block-per-row path (decode, multi-token decode) and its query-block path (``mixed`` with 16 heads,
``prefill``), split-K on a GPU (``long decode``: the split count follows the SM count), the three page
lookups of a key tile (the page holds the tile: BS = 64; the tile holds pages: BS = 1, 16; neither:
BS = 6), fp8 pools, and the expanded form's unified kernel on q/K/V padded to max(Dn + R, Dv).

Legend: T tokens, H heads, L kv_lora_rank, R qk_rope_head_dim, Dn qk_nope_head_dim, Dv v_head_dim,
NB blocks, BS block size.
"""

from __future__ import annotations

import torch

from atom_core import ops
from atom_core.cache import build_step_layout
from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.selftest_cases import Case, close_outputs, closer, grid_dtypes, seeded_randn
from atom_core.ops.tolerances import ATTENTION, ELEMENTWISE, FP8_KV, tolerance

SMALL = {"heads": 4, "latent": 64, "rope": 16, "nope": 32, "v_dim": 32}
DEEPSEEK_V3 = {"heads": 16, "latent": 512, "rope": 64, "nope": 128, "v_dim": 128}


def _fp8_tol() -> dict:
    return dict(zip(("atol", "rtol"), FP8_KV))


def store_mla_cases(grid: str, device) -> list[Case]:
    shapes = [(6, 4, 16, 64, 16)] if grid == "quick" else [(1, 8, 16, 512, 64), (37, 6, 8, 64, 16), (5, 7, 1, 96, 32)]
    cases = []
    for tokens, blocks, block_size, latent, rope in shapes:
        for dtype in grid_dtypes(grid):
            for fp8 in ([False] if grid == "quick" else [False, True]):
                def run(backend, dtype=dtype, fp8=fp8, tokens=tokens, blocks=blocks, block_size=block_size,
                        latent=latent, rope=rope):
                    # kv_c and k_pe as views of one projection output [T, L + R], as a model passes them
                    kv_a = seeded_randn(20, tokens, latent + rope, dtype=dtype, device=device)
                    cache = torch.zeros(blocks, block_size, latent + rope, device=device).to(FP8_DTYPE if fp8 else dtype)
                    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(21))[:tokens]
                    slots[0] = -1  # a padding token writes nothing
                    scale = torch.tensor([0.5], device=device) if fp8 else None
                    ops.store_mla_(kv_a[:, :latent], kv_a[:, latent:], cache, slots.to(device), kv_scale=scale,
                                   backend=backend)
                    return (cache.float(),)

                check = (lambda got, want: close_outputs(got, want, _fp8_tol())) if fp8 else closer(ELEMENTWISE)(dtype)
                label = f"T={tokens} NB={blocks} BS={block_size} L={latent} R={rope} {dtype}{' fp8' if fp8 else ''}"
                cases.append(Case("store_mla_", label, run, check))
    return cases


def _mla_case(op: str, label: str, query_lens, cached_lens, *, dtype, device, block_size=16, fp8=False,
              heads, latent, rope, nope, v_dim) -> Case:
    def run(backend):
        g = torch.Generator().manual_seed(22)
        context = [q + c for q, c in zip(query_lens, cached_lens)]
        pages = [-(-n // block_size) for n in context]
        num_blocks = sum(pages) + 2  # two blocks nobody owns
        order = torch.randperm(num_blocks, generator=g).tolist()
        tables = [order[sum(pages[:r]): sum(pages[:r + 1])] for r in range(len(pages))]
        layout = build_step_layout(query_lens, cached_lens, tables, block_size).to(device)
        owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for table, n in zip(tables, context):
            owned[[table[j // block_size] * block_size + j % block_size for j in range(n)]] = True
        flat = seeded_randn(23, num_blocks * block_size, latent + rope)
        flat[~owned] = float("nan")
        scale = torch.tensor([0.5], device=device) if fp8 else None
        cache = ((flat / 0.5).to(FP8_DTYPE) if fp8 else flat.to(dtype)).view(num_blocks, block_size, -1).to(device)
        q = seeded_randn(24, layout.num_tokens, heads, nope + rope, dtype=dtype, device=device)
        w_kv_b = seeded_randn(25, heads * (nope + v_dim), latent, dtype=dtype, device=device, scale=latent ** -0.5)
        w = w_kv_b.view(heads, nope + v_dim, latent)
        fn = getattr(ops, op)
        return (fn(q[..., :nope], q[..., nope:], cache, w[:, :nope], w[:, nope:], layout.block_tables,
                   layout.cu_seqlens_q, layout.context_lens, layout.max_seqlen_q, layout.max_seqlen_k,
                   scale=(nope + rope) ** -0.5, kv_scale=scale, backend=backend),)

    tol = _fp8_tol() if fp8 else tolerance(dtype, ATTENTION)
    return Case(op, label, run, lambda got, want: close_outputs(got, want, tol))


def mla_attention_cases(grid: str, device) -> list[Case]:
    batches = {"mixed": ([1, 5, 3], [7, 0, 12]), "decode": ([1, 1, 1, 1], [3, 17, 40, 1])}
    if grid == "full":
        batches.update({"prefill": ([33, 20], [0, 0]), "long decode": ([1] * 4, [900, 13, 257, 2000]),
                        "multi-token decode": ([4, 4], [30, 100])})
    cases = []
    for op in ("mla_prefill_attention", "mla_decode_attention"):
        for name, (query_lens, cached_lens) in batches.items():
            for dtype in grid_dtypes(grid):
                label = f"{name} {dtype}"
                cases.append(_mla_case(op, label, query_lens, cached_lens, dtype=dtype, device=device, **SMALL))
                if grid == "full":
                    cases.append(_mla_case(op, f"{label} DeepSeek-V3 heads BS=64", query_lens, cached_lens,
                                           dtype=dtype, device=device, block_size=64, **DEEPSEEK_V3))
                    cases.append(_mla_case(op, f"{label} BS=1", query_lens, cached_lens, dtype=dtype, device=device,
                                           block_size=1, **SMALL))
                    cases.append(_mla_case(op, f"{label} fp8 pool", query_lens, cached_lens, dtype=dtype,
                                           device=device, fp8=True, **SMALL))
                    if name in ("mixed", "decode"):  # keys found page by page within a tile
                        cases.append(_mla_case(op, f"{label} BS=6", query_lens, cached_lens, dtype=dtype,
                                               device=device, block_size=6, **SMALL))
    return cases


def mla_cases(grid: str, device) -> list[Case]:
    """Every MLA op's cases (``selftest_cases.all_cases`` adds them to the grid)."""
    return store_mla_cases(grid, device) + mla_attention_cases(grid, device)
