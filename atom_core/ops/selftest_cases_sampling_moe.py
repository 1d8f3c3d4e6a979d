"""The selftest's grid, continued: sampling, greedy speculative acceptance, MoE routing, fused experts.

Draws are not compared token by token (each backend draws its own noise): a backend's draws must be
reproducible, equal the argmax in greedy rows, stay inside each row's filters, carry the right
log-probs, and follow the filtered distribution (cosine of frequencies over 2048 draws).
"""

from __future__ import annotations

import torch

from atom_core import ops
from atom_core.ops.reference.sampling import GREEDY_BELOW_TEMPERATURE, filter_cutoff
from atom_core.ops.selftest_cases import (FP32, WEIGHT_TOL, Case, close_outputs, closer, equal_outputs, grid_dtypes,
                                          seeded_randn)
from atom_core.ops.tolerances import ATTENTION, MOE, tolerance

_ROW_PARAMS = [  # temperature, top_k, top_p, min_p; T = 2e-6 is greedy (below 1e-5)
    (0.0, 0, 1.0, 0.0), (0.5, 5, 1.0, 0.0), (1.0, 40, 0.9, 0.0), (1.3, 0, 0.7, 0.05),
    (0.0, 3, 0.5, 0.0), (0.8, 0, 0.8, 0.1), (1.0, 10, 0.95, 0.02), (2e-6, 0, 1.0, 0.0),
]


def _row_params(rows: int, device, seed: int = 17):
    params = [_ROW_PARAMS[r % len(_ROW_PARAMS)] for r in range(rows)]
    temperature, top_k, top_p, min_p = (torch.tensor(column, device=device) for column in zip(*params))
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=torch.Generator().manual_seed(seed)).to(device)
    offsets = torch.randint(0, 2**40, (rows,), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return temperature.float(), top_k.int(), top_p.float(), min_p.float(), seeds, offsets


def _check_draws(got, want) -> str | None:
    tokens, logprobs, again, allowed, greedy, want_logprobs, argmax = got
    if not torch.equal(tokens, again):
        return "two calls with the same seeds and offsets drew different tokens"
    if not torch.equal(tokens[greedy], argmax[greedy]):
        return "a greedy row did not draw the argmax (lowest index on ties)"
    if not bool(allowed.gather(1, tokens[:, None]).all()):
        return "a row drew a token its filters remove"
    return close_outputs((logprobs,), (want_logprobs,), tolerance(FP32, ATTENTION))


def _draw_case(rows: int, vocab: int, dtype, device) -> Case:
    def run(backend):
        logits = seeded_randn(16, rows, vocab, dtype=dtype, device=device, scale=2.0)
        params = _row_params(rows, device)
        tokens, logprobs = ops.sample(logits, *params, return_logprobs=True, backend=backend)
        again = ops.sample(logits, *params, backend=backend)
        temperature, top_k, top_p, min_p = params[:4]
        allowed = logits.float() >= filter_cutoff(logits, temperature, top_k, top_p, min_p)[:, None]
        want_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None])[:, 0]
        greedy = temperature < GREEDY_BELOW_TEMPERATURE
        return tokens, logprobs, again, allowed, greedy, want_logprobs, logits.float().argmax(-1)

    return Case("sample", f"B={rows} V={vocab} {dtype} mixed rows", run, _check_draws)


def _distribution_case(device, draws: int = 2048) -> Case:
    # Expected 1 - cosine ~ (1 - sum p^2) / (2 N sum p^2) ~ 1e-3 here, far inside the 0.02 margin.
    temperature, top_k, top_p, min_p = 0.8, 10, 0.9, 0.02

    def run(backend):
        row = seeded_randn(18, 1, 24, device=device, scale=1.5)
        logits = row.expand(draws, 24).contiguous()
        full = lambda v, dtype: torch.full((draws,), v, dtype=dtype, device=device)  # noqa: E731
        params = (full(temperature, FP32), full(top_k, torch.int32), full(top_p, FP32), full(min_p, FP32))
        tokens = ops.sample(logits, *params, full(123, torch.int64), torch.arange(draws, device=device),
                            backend=backend)
        cutoff = filter_cutoff(row, *(p[:1] for p in params))
        probs = torch.softmax((row.float() / temperature).masked_fill(row.float() < cutoff[:, None], float("-inf")), -1)
        return torch.bincount(tokens.cpu(), minlength=24).double() / draws, probs[0].double().cpu()

    def check(got, want):
        freq, probs = got
        cosine = float(torch.nn.functional.cosine_similarity(freq, probs, dim=0))
        if bool((freq[probs == 0] > 0).any()):
            return "drew a token the filters remove"
        return None if cosine > 0.98 else f"draw frequencies off the filtered distribution (cosine {cosine:.4f})"

    return Case("sample", f"{draws} draws V=24 T={temperature} top_k={top_k} top_p={top_p} min_p={min_p}", run, check)


def _rejection_case(rows: int, drafts: int, vocab: int, dtype, device) -> Case:
    def run(backend):
        target = seeded_randn(19, rows * (drafts + 1), vocab, dtype=dtype, device=device)
        argmax = target.float().argmax(-1).view(rows, drafts + 1)
        draft = argmax[:, :drafts].clone()
        for r in range(rows):  # row r agrees for r drafts, then differs
            if r < drafts:
                draft[r, r] = (draft[r, r] + 1) % vocab
        return ops.rejection_sample_greedy(draft, target, backend=backend)

    return Case("rejection_sample_greedy", f"B={rows} K={drafts} V={vocab} {dtype}", run, equal_outputs)


def sampling_cases(grid: str, device) -> list[Case]:
    shapes = [(8, 300)] if grid == "quick" else [(8, 300), (64, 32000), (3, 151936)]
    cases = [_draw_case(rows, vocab, dtype, device) for rows, vocab in shapes for dtype in grid_dtypes(grid)]
    cases.append(_distribution_case(device))
    cases += [_rejection_case(4, 3, vocab, dtype, device) for vocab in ([500] if grid == "quick" else [500, 32000])
              for dtype in grid_dtypes(grid)]
    return cases


def _by_expert(weights, ids):
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


def _check_routing(got, want) -> str | None:
    """Same experts per token (order within a row may differ) and the same weights for them."""
    (got_w, got_i), (want_w, want_i) = _by_expert(*got), _by_expert(*want)
    if not torch.equal(got_i, want_i):
        return f"chose other experts in {int((got_i != want_i).any(-1).sum())} of {got_i.shape[0]} tokens"
    return close_outputs((got_w,), (want_w,), WEIGHT_TOL)


def routing_cases(grid: str, device) -> list[Case]:
    tokens = 9 if grid == "quick" else 133

    def logits(experts: int, dtype=FP32):
        return seeded_randn(20, tokens, experts, dtype=dtype, device=device)

    cases = []
    for dtype in grid_dtypes(grid):
        for renormalize in (False, True):
            def topk(b, dtype=dtype, renormalize=renormalize):
                return ops.topk_softmax(logits(60, dtype), 4, renormalize=renormalize, backend=b)

            cases.append(Case("topk_softmax", f"T={tokens} E=60 K=4 renormalize={renormalize} {dtype}", topk,
                              _check_routing))
        cases.append(Case("gpt_oss_topk", f"T={tokens} E=32 K=4 {dtype}",
                          lambda b, dtype=dtype: ops.gpt_oss_topk(logits(32, dtype), 4, backend=b), _check_routing))

    # Grouped routing sums group scores: fp32 only, where random logits leave no near-ties.
    def grouped_sigmoid(b):
        return ops.grouped_topk(logits(64), 6, num_expert_group=8, topk_group=3, renormalize=True, scoring="sigmoid",
                                e_score_correction_bias=seeded_randn(21, 64, device=device, scale=0.1),
                                routed_scaling_factor=2.5, backend=b)

    def grouped_softmax(b):
        return ops.grouped_topk(logits(64), 4, num_expert_group=4, topk_group=2, renormalize=False, scoring="softmax",
                                backend=b)

    cases.append(Case("grouped_topk", f"T={tokens} E=64 K=6 groups 8/3 sigmoid bias", grouped_sigmoid, _check_routing))
    cases.append(Case("grouped_topk", f"T={tokens} E=64 K=4 groups 4/2 softmax", grouped_softmax, _check_routing))
    return cases


def fused_experts_cases(grid: str, device) -> list[Case]:
    shapes = [(7, 64, 8, 32, 2)] if grid == "quick" else [(1, 128, 8, 64, 2), (67, 256, 16, 128, 4)]
    cases = []
    for (tokens, hidden, experts, inter, top_k) in shapes:
        for dtype in grid_dtypes(grid):
            for activation in ("silu", "swiglu_clamped"):
                def run(backend, dtype=dtype, activation=activation, tokens=tokens, hidden=hidden, experts=experts,
                        inter=inter, top_k=top_k):
                    x = seeded_randn(22, tokens, hidden, dtype=dtype, device=device)
                    w13 = seeded_randn(23, experts, 2 * inter, hidden, dtype=dtype, device=device, scale=hidden ** -0.5)
                    w2 = seeded_randn(24, experts, hidden, inter, dtype=dtype, device=device, scale=inter ** -0.5)
                    weights, ids = ops.topk_softmax(seeded_randn(25, tokens, experts, device=device), top_k,
                                                    renormalize=True, backend="torch")
                    biases = {}
                    if activation == "swiglu_clamped":  # GPT-OSS has biases
                        biases = dict(w13_bias=seeded_randn(26, experts, 2 * inter, dtype=dtype, device=device),
                                      w2_bias=seeded_randn(27, experts, hidden, dtype=dtype, device=device))
                    return (ops.fused_experts(x, w13, w2, weights, ids, activation=activation, backend=backend,
                                              **biases),)

                label = f"T={tokens} H={hidden} E={experts} I={inter} K={top_k} {activation} {dtype}"
                cases.append(Case("fused_experts", label, run, closer(MOE)(dtype)))
    return cases


def moe_cases(grid: str, device) -> list[Case]:
    return routing_cases(grid, device) + fused_experts_cases(grid, device)
