"""The selftest's grid: for every op, calls on seeded inputs and how a backend's result is compared
with the twin's (``atom_core.ops.selftest`` runs them).

A :class:`Case` runs the public op with ``backend=name`` on inputs rebuilt from a fixed seed at each
run (so a mutating op starts from the same tensors for every backend) and returns its outputs;
``check(got, want)`` returns None, or why the backend's outputs differ from the twin's, under the
tolerances of ``atom_core.ops.tolerances``. ``grid="quick"`` is one or two small shapes per op and
fp32 + bf16 (fast enough for the Triton CPU interpreter); ``grid="full"`` adds odd and model-sized
shapes, fp16, fp8 KV pools and the attention features (window, softcap, sinks, GQA); the quantization
ops and scaled GEMMs are in ``selftest_cases_quant``, the fused norm / activation + quantization ops in
``selftest_cases_norm_quant``.

Legend: T tokens, D hidden, I intermediate, Hq/Hk heads, Dh head dim, R rotary dim, NB blocks,
BS block size, B rows, V vocabulary, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from atom_core import ops
from atom_core.cache import build_step_layout
from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.tolerances import ATTENTION, ELEMENTWISE, FP8_KV, tolerance

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
WEIGHT_TOL = {"atol": 1e-6, "rtol": 1e-5}  # fp32 routing weights: exp/sum rounding only


@dataclass(frozen=True)
class Case:
    op: str
    label: str
    run: Callable[[str], tuple]  # backend name -> outputs
    check: Callable[[tuple, tuple], str | None]  # (got, want) -> None or why they differ


def seeded_randn(seed: int, *shape, dtype=FP32, device="cpu", scale: float = 1.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)


def close_outputs(got: tuple, want: tuple, tol: dict) -> str | None:
    for i, (a, b) in enumerate(zip(got, want)):
        try:
            torch.testing.assert_close(a.float(), b.float(), equal_nan=True, **tol)
        except AssertionError as error:
            return f"output {i}: " + " ".join(line for line in str(error).split("\n") if line)
    return None


def closer(table) -> Callable[[torch.dtype], Callable]:
    return lambda dtype: (lambda got, want: close_outputs(got, want, tolerance(dtype, table)))


def equal_outputs(got: tuple, want: tuple) -> str | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            return f"output {i} differs at {int((a != b).sum())} of {a.numel()} entries"
    return None


def grid_dtypes(grid: str) -> list[torch.dtype]:
    return [FP32, BF16] if grid == "quick" else [FP32, FP16, BF16]


def norm_cases(grid: str, device) -> list[Case]:
    shapes = [(7, 96)] if grid == "quick" else [(1, 128), (19, 111), (256, 4096)]
    cases = []
    for (rows, hidden) in shapes:
        for dtype in grid_dtypes(grid):
            def inputs(dtype=dtype, rows=rows, hidden=hidden):
                """x [T, D], weight [D], bias [D], residual [T, D]."""
                shapes = ((rows, hidden), (hidden,), (hidden,), (rows, hidden))
                return tuple(seeded_randn(seed, *shape, dtype=dtype, device=device)
                             for seed, shape in enumerate(shapes, start=1))

            def rms(backend, inputs=inputs):
                x, w, _, r = inputs()
                return (ops.rms_norm(x, w, 1e-6, backend=backend),
                        *ops.rms_norm(x, w, 1e-6, residual=r, backend=backend))

            def rms_gemma(backend, inputs=inputs):
                x, w, _, _ = inputs()
                return (ops.rms_norm(x, w, 1e-6, gemma=True, backend=backend),)

            def layer(backend, inputs=inputs):
                x, w, b, r = inputs()
                return (ops.layer_norm(x, w, None, 1e-5, backend=backend),
                        *ops.layer_norm(x, w, b, 1e-5, residual=r, backend=backend))

            check = closer(ELEMENTWISE)(dtype)
            label = f"T={rows} D={hidden} {dtype}"
            cases += [Case("rms_norm", label, rms, check), Case("layer_norm", label, layer, check)]
            if grid == "full":
                cases.append(Case("rms_norm", label + " gemma", rms_gemma, check))
    return cases


def activation_cases(grid: str, device) -> list[Case]:
    shapes = [(5, 48)] if grid == "quick" else [(1, 64), (33, 1408)]
    cases = []
    for (rows, inter) in shapes:
        for dtype in grid_dtypes(grid):
            def x(dtype=dtype, rows=rows, inter=inter):
                return seeded_randn(5, rows, 2 * inter, dtype=dtype, device=device, scale=3.0)

            check = closer(ELEMENTWISE)(dtype)
            label = f"T={rows} I={inter} {dtype}"
            cases += [
                Case("silu_and_mul", label, lambda b, x=x: (ops.silu_and_mul(x(), backend=b),), check),
                Case("gelu_and_mul", label,
                     lambda b, x=x: (ops.gelu_and_mul(x(), backend=b),
                                     ops.gelu_and_mul(x(), approximate="tanh", backend=b)), check),
                Case("swiglu_clamped", label, lambda b, x=x: (ops.swiglu_clamped(x(), backend=b),), check),
            ]
    return cases


def _rope_inputs(seed, tokens, hq, hk, head, rotary, dtype, device, scale=1.0):
    """A fused qkv buffer [T, (Hq + 2 Hk) Dh], q and k as strided head views of it, a rope table of 256
    positions for R = ``rotary`` and positions drawn from it."""
    qkv = seeded_randn(seed, tokens, (hq + 2 * hk) * head, dtype=dtype, device=device, scale=scale)
    q = qkv[:, : hq * head].view(tokens, hq, head)
    k = qkv[:, hq * head: (hq + hk) * head].view(tokens, hk, head)
    cache, _ = ops.rope_cos_sin_cache(rotary, 256, 10000.0, device=device)
    positions = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(7)).to(device)
    return qkv, q, k, cache, positions


def _rope_label(tokens, hq, hk, head, rotary, is_neox, dtype) -> str:
    return f"T={tokens} Hq={hq} Hk={hk} Dh={head} R={rotary} {'neox' if is_neox else 'gptj'} {dtype}"


def rope_cases(grid: str, device) -> list[Case]:
    # (T, Hq, Hk, Dh, R, is_neox)
    shapes = [(5, 4, 2, 64, 64, True), (5, 4, 2, 64, 32, False)] if grid == "quick" else \
        [(1, 32, 8, 128, 128, True), (77, 16, 2, 64, 64, True), (19, 8, 1, 128, 64, False), (3, 4, 4, 80, 80, True)]
    cases = []
    for (tokens, hq, hk, head, rotary, is_neox) in shapes:
        for dtype in grid_dtypes(grid):
            def run(backend, dtype=dtype, tokens=tokens, hq=hq, hk=hk, head=head, rotary=rotary, is_neox=is_neox):
                _, q, k, cache, positions = _rope_inputs(6, tokens, hq, hk, head, rotary, dtype, device)
                ops.apply_rope_(q, k, positions, cache, is_neox=is_neox, backend=backend)
                return q, k

            label = _rope_label(tokens, hq, hk, head, rotary, is_neox, dtype)
            cases.append(Case("apply_rope_", label, run, closer(ELEMENTWISE)(dtype)))
    return cases


def qk_norm_rope_cases(grid: str, device) -> list[Case]:
    # (T, Hq, Hk, Dh, R, is_neox): Qwen3-0.6B decode, a Qwen3 prefill, GLM-4-MoE's half rotary, odd sizes.
    shapes = [(5, 4, 2, 64, 64, True), (5, 4, 2, 64, 32, False)] if grid == "quick" else \
        [(1, 16, 8, 128, 128, True), (77, 32, 4, 128, 128, True), (19, 12, 1, 128, 64, True), (3, 4, 4, 80, 40, False)]
    cases = []
    for (tokens, hq, hk, head, rotary, is_neox) in shapes:
        for dtype in grid_dtypes(grid):
            def run(backend, dtype=dtype, tokens=tokens, hq=hq, hk=hk, head=head, rotary=rotary, is_neox=is_neox):
                qkv, q, k, cache, positions = _rope_inputs(16, tokens, hq, hk, head, rotary, dtype, device, scale=4.0)
                # Weights in [0.05, 0.2] keep the normalised values below 1, where the one-ulp flips that
                # rounding them may make (tests/ops/test_qk_norm_rope.py) stay within ELEMENTWISE.
                q_weight, k_weight = ((0.05 + 0.15 * torch.rand(head, generator=torch.Generator().manual_seed(seed)))
                                      .to(device=device, dtype=dtype) for seed in (17, 18))
                ops.qk_norm_rope_(q, k, q_weight, k_weight, positions, cache, eps=1e-6, is_neox=is_neox,
                                  backend=backend)
                return (qkv,)  # q and k, and v untouched

            label = _rope_label(tokens, hq, hk, head, rotary, is_neox, dtype)
            cases.append(Case("qk_norm_rope_", label, run, closer(ELEMENTWISE)(dtype)))
    return cases


def store_kv_cases(grid: str, device) -> list[Case]:
    shapes = [(6, 2, 64, 4, 16)] if grid == "quick" else [(1, 8, 128, 64, 16), (37, 2, 64, 8, 32), (5, 4, 80, 4, 16)]
    cases = []
    for (tokens, heads, head, blocks, block_size) in shapes:
        for dtype in grid_dtypes(grid):
            for fp8 in ([False] if grid == "quick" else [False, True]):
                def run(backend, dtype=dtype, fp8=fp8, tokens=tokens, heads=heads, head=head, blocks=blocks,
                        block_size=block_size):
                    k, v = (seeded_randn(s, tokens, heads, head, dtype=dtype, device=device) for s in (8, 9))
                    cache_dtype = FP8_DTYPE if fp8 else dtype
                    caches = [torch.zeros(blocks, block_size, heads, head, device=device).to(cache_dtype)
                              for _ in range(2)]
                    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(10))[:tokens]
                    slots[0] = -1  # a padding token writes nothing
                    scales = (torch.tensor([0.5], device=device), torch.tensor([0.25], device=device)) if fp8 \
                        else (None, None)
                    ops.store_kv_(k, v, *caches, slots.to(device), k_scale=scales[0], v_scale=scales[1],
                                  backend=backend)
                    return tuple(c.float() for c in caches)

                check = (lambda got, want: close_outputs(got, want, dict(zip(("atol", "rtol"), FP8_KV)))) if fp8 \
                    else closer(ELEMENTWISE)(dtype)
                label = f"T={tokens} Hk={heads} Dh={head} NB={blocks} BS={block_size} {dtype}{' fp8' if fp8 else ''}"
                cases.append(Case("store_kv_", label, run, check))
    return cases


def rope_store_kv_cases(grid: str, device) -> list[Case]:
    # (T, Hq, Hk, Dh, R, is_neox): q, k and v head views of one fused qkv buffer
    shapes = [(5, 4, 2, 64, 32, True)] if grid == "quick" else \
        [(1, 32, 8, 128, 128, True), (19, 8, 1, 128, 64, False), (3, 4, 4, 80, 80, True)]
    cases = []
    for (tokens, hq, hk, head, rotary, is_neox) in shapes:
        for dtype in grid_dtypes(grid):
            def run(backend, dtype=dtype, tokens=tokens, hq=hq, hk=hk, head=head, rotary=rotary, is_neox=is_neox):
                qkv, q, k, cache, positions = _rope_inputs(6, tokens, hq, hk, head, rotary, dtype, device)
                v = qkv[:, (hq + hk) * head:].view(tokens, hk, head)
                caches = [torch.zeros(8, 16, hk, head, dtype=dtype, device=device) for _ in range(2)]
                slots = torch.randperm(128, generator=torch.Generator().manual_seed(10))[:tokens]
                slots[0] = -1  # a padding token writes nothing
                ops.rope_store_kv_(q, k, v, positions, cache, *caches, slots.to(device), is_neox=is_neox,
                                   backend=backend)
                return q, k, *caches

            label = _rope_label(tokens, hq, hk, head, rotary, is_neox, dtype)
            cases.append(Case("rope_store_kv_", label, run, closer(ELEMENTWISE)(dtype)))
    return cases


def _attention_case(label: str, query_lens, cached_lens, *, dtype, device, num_heads=4, num_kv_heads=2, head_dim=64,
                    block_size=16, fp8=False, **features) -> Case:
    def run(backend):
        g = torch.Generator().manual_seed(11)
        context = [q + c for q, c in zip(query_lens, cached_lens)]
        pages = [-(-n // block_size) for n in context]
        num_blocks = sum(pages) + 2  # two blocks nobody owns
        order = torch.randperm(num_blocks, generator=g).tolist()
        tables = [order[sum(pages[:r]): sum(pages[:r + 1])] for r in range(len(pages))]
        layout = build_step_layout(query_lens, cached_lens, tables, block_size).to(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # NaN where no row's context lies: a kernel must never let those slots into a result.
        owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for table, n in zip(tables, context):
            owned[[table[j // block_size] * block_size + j % block_size for j in range(n)]] = True
        scales = (torch.tensor([0.5], device=device), torch.tensor([0.25], device=device)) if fp8 else (None, None)
        caches = []
        for seed, scale in ((12, 0.5), (13, 0.25)):
            flat = seeded_randn(seed, num_blocks * block_size, num_kv_heads, head_dim)
            flat[~owned] = float("nan")
            caches.append((flat / scale).to(FP8_DTYPE) if fp8 else flat.to(dtype))
        k_cache, v_cache = (c.view(shape).to(device) for c in caches)
        q = seeded_randn(14, layout.num_tokens, num_heads, head_dim, dtype=dtype, device=device)
        sinks = features.get("sinks")
        return (ops.paged_attention_from_layout(
            q, k_cache, v_cache, layout, scale=head_dim ** -0.5, sliding_window=features.get("sliding_window"),
            logit_softcap=features.get("logit_softcap", 0.0),
            sinks=None if sinks is None else seeded_randn(15, num_heads, device=device),
            k_scale=scales[0], v_scale=scales[1], backend=backend),)

    tol = dict(zip(("atol", "rtol"), FP8_KV)) if fp8 else tolerance(dtype, ATTENTION)
    return Case("paged_attention", label, run, lambda got, want: close_outputs(got, want, tol))


def attention_cases(grid: str, device) -> list[Case]:
    batches = {"mixed": ([1, 5, 3], [7, 0, 12]), "decode": ([1, 1, 1, 1], [3, 17, 40, 1])}
    if grid == "full":
        batches.update({"prefill": ([33, 70], [0, 0]), "long decode": ([1] * 8, [900, 13, 257, 64, 1, 2000, 5, 511]),
                        "multi-token decode": ([4, 4], [30, 100])})
    cases = []
    for name, (query_lens, cached_lens) in batches.items():
        for dtype in grid_dtypes(grid):
            label = f"{name} {dtype}"
            cases.append(_attention_case(label, query_lens, cached_lens, dtype=dtype, device=device))
            if grid == "full":
                for head_dim, heads, kv_heads, block_size in ((128, 8, 1, 32), (64, 8, 8, 16)):
                    cases.append(_attention_case(f"{label} Dh={head_dim} Hq={heads} Hk={kv_heads} BS={block_size}",
                                                 query_lens, cached_lens, dtype=dtype, device=device,
                                                 num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                                 block_size=block_size))
                for feature, value in (("sliding_window", 8), ("logit_softcap", 30.0), ("sinks", True)):
                    cases.append(_attention_case(f"{label} {feature}", query_lens, cached_lens, dtype=dtype,
                                                 device=device, **{feature: value}))
                cases.append(_attention_case(f"{label} fp8 pool", query_lens, cached_lens, dtype=dtype, device=device,
                                             fp8=True))
    return cases


def all_cases(grid: str, device) -> dict[str, list[Case]]:
    """op name -> its cases, for every op."""
    from atom_core.ops.selftest_cases_comm import comm_cases
    from atom_core.ops.selftest_cases_dsa import dsa_cases
    from atom_core.ops.selftest_cases_mla import mla_cases
    from atom_core.ops.selftest_cases_moe_quant import fused_experts_quant_cases
    from atom_core.ops.selftest_cases_norm_quant import norm_quant_cases
    from atom_core.ops.selftest_cases_penalties import penalty_cases
    from atom_core.ops.selftest_cases_quant import quant_cases, scaled_mm_cases
    from atom_core.ops.selftest_cases_sampling_moe import moe_cases, sampling_cases
    from atom_core.ops.selftest_cases_token_mask import token_mask_cases

    by_op: dict[str, list[Case]] = {}
    for make in (norm_cases, activation_cases, rope_cases, qk_norm_rope_cases, store_kv_cases, rope_store_kv_cases,
                 attention_cases, sampling_cases, moe_cases, fused_experts_quant_cases, quant_cases, norm_quant_cases,
                 scaled_mm_cases, mla_cases, dsa_cases, penalty_cases, token_mask_cases, comm_cases):
        for case in make(grid, device):
            by_op.setdefault(case.op, []).append(case)
    return by_op
