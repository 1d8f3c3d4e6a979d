"""Sampling semantics pinned to HF transformers' logits warpers (temperature, top-k, top-p, min-p, in
HF's order), the documented difference from vLLM v1 (min-p first), and tiny temperatures (greedy
below 1e-5 on every backend)."""

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from atom_core.ops.reference import sampling as reference
from atom_core.ops.reference.sampling import GREEDY_BELOW_TEMPERATURE
from atom_core.ops.sampling import sample
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, needs_triton

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
VOCAB = 24


def hf_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """bool [B, V]: what HF's warpers keep, applied as generate() orders them (temperature, top-k, top-p, min-p)."""
    warpers = [TemperatureLogitsWarper(temperature)]
    if 0 < top_k < logits.shape[1]:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    scores = logits.clone()
    for warper in warpers:
        scores = warper(None, scores)
    return scores > float("-inf")


def our_kept(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    rows = logits.shape[0]
    cutoff = reference.filter_cutoff(logits, torch.full((rows,), temperature), torch.full((rows,), top_k),
                                     torch.full((rows,), top_p), torch.full((rows,), min_p))
    return logits >= cutoff[:, None]


def closed_under_ties(logits, kept):
    """Every token tied with a kept one, kept too: a cut-off cannot split a tie (where HF's sort may)."""
    lowest_kept = logits.masked_fill(~kept, float("inf")).amin(-1, keepdim=True)
    return logits >= lowest_kept


def tied_logits(rows=300, seed=0):
    """Logits on an integer grid: every row has many ties, at the k-th logit and elsewhere."""
    return torch.randint(-4, 5, (rows, VOCAB), generator=torch.Generator().manual_seed(seed)).float()


def test_top_k_keeps_ties_at_the_kth_logit_and_top_p_renormalises_over_all_of_them():
    # probs over the five top-k survivors (T = 1): 0.564, 0.207, 0.076 x 3. top-p 0.6 needs token 1
    # (mass before it 0.564 < 0.6). Renormalising over exactly k = 3 positions (0.665 before token 1)
    # would cut it.
    logits = torch.tensor([[3.0, 2.0, 1.0, 1.0, 1.0, 0.0, -1.0]])
    assert our_kept(logits, 1.0, 3, 1.0, 0.0).tolist() == [[True] * 5 + [False] * 2]
    assert our_kept(logits, 1.0, 3, 0.6, 0.0).tolist() == [[True, True] + [False] * 5]
    assert torch.equal(our_kept(logits, 1.0, 3, 0.6, 0.0), hf_kept(logits, 1.0, 3, 0.6, 0.0))


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
@pytest.mark.parametrize("top_k", [1, 3, 6, 0])
@pytest.mark.parametrize("top_p", [0.3, 0.8, 1.0])
def test_top_k_then_top_p_equals_hf_warpers_on_tied_logits(temperature, top_k, top_p):
    logits = tied_logits()
    want = closed_under_ties(logits, hf_kept(logits, temperature, top_k, top_p, 0.0))
    assert torch.equal(our_kept(logits, temperature, top_k, top_p, 0.0), want)


@pytest.mark.parametrize("temperature", [0.7, 1.5])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (6, 1.0), (0, 0.8), (6, 0.8)])
@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5])
def test_min_p_after_top_k_and_top_p_equals_hf_warpers_in_that_order(temperature, top_k, top_p, min_p):
    logits = tied_logits(seed=1)
    want = closed_under_ties(logits, hf_kept(logits, temperature, top_k, top_p, min_p))
    assert torch.equal(our_kept(logits, temperature, top_k, top_p, min_p), want)


def vllm_v1_kept(row: list[float], top_p: float, min_p: float) -> set[int]:
    """vLLM v1's order at T = 1: min-p on the full softmax first, then top-p renormalised over its survivors."""
    probs = [math.exp(x) / sum(math.exp(y) for y in row) for x in row]
    survivors = [v for v in sorted(range(len(row)), key=lambda v: -row[v]) if probs[v] >= min_p * max(probs)]
    mass = sum(probs[v] for v in survivors)
    kept, before = set(), 0.0
    for v in survivors:
        if before >= top_p:
            break
        kept.add(v)
        before += probs[v] / mass
    return kept


def test_min_p_order_differs_from_vllm_v1_where_documented():
    # probs 0.5, 0.3, 0.1, 0.1 (T = 1), top-p 0.6, min-p 0.3 (p >= 0.15).
    # HF order: top-p keeps {0, 1} (mass before token 1 is 0.5 < 0.6, before token 2 0.8); min-p keeps both.
    # vLLM v1: min-p first keeps {0, 1}; top-p over them (0.625, 0.375) stops before token 1: {0}.
    row = [math.log(p) for p in (0.5, 0.3, 0.1, 0.1)]
    logits = torch.tensor([row])
    ours = set(torch.nonzero(our_kept(logits, 1.0, 0, 0.6, 0.3)[0]).flatten().tolist())
    assert ours == {0, 1} == set(torch.nonzero(hf_kept(logits, 1.0, 0, 0.6, 0.3)[0]).flatten().tolist())
    assert vllm_v1_kept(row, 0.6, 0.3) == {0}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 5e-6])
def test_temperature_below_1e_minus_5_is_greedy(backend, temperature):
    # Most logits are > 2.4, where logit / 1e-38 overflows fp32: an fp32 score ties them all at +inf.
    logits = (3.0 + torch.rand(6, 1000, generator=torch.Generator().manual_seed(2))).to(DEVICE)
    logits[torch.arange(6), torch.tensor([37, 500, 999, 1, 250, 777])] = 4.5
    rows = logits.shape[0]
    temperatures = torch.full((rows,), temperature, device=DEVICE)
    temperatures[3] = 0.0  # an exact greedy row in the same batch
    seeds, offsets = torch.arange(rows, device=DEVICE), torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    tokens = sample(logits, temperatures, None, None, None, seeds, offsets, backend=backend)
    assert tokens.tolist() == [37, 500, 999, 1, 250, 777]
    top_k = torch.full((rows,), 50, device=DEVICE)
    assert sample(logits, temperatures, top_k, None, None, seeds, offsets, backend=backend).tolist() == tokens.tolist()


def test_greedy_threshold_is_vllms():
    assert GREEDY_BELOW_TEMPERATURE == 1e-5


def test_aiter_adapter_passes_tiny_temperatures_as_0(monkeypatch):
    fake = fake_aiter.install(monkeypatch, {"mixed_sample_outer_exponential": lambda out, **kw: out.zero_()})
    from atom_core.ops.aiter import sampling as aiter_sampling

    temperature = torch.tensor([1e-38, 5e-6, 0.0, -1.0, 1e-5, 0.7])
    rows = temperature.shape[0]
    aiter_sampling.sample(torch.randn(rows, 16), temperature, None, None, None, torch.arange(rows),
                          torch.zeros(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int64), None)
    assert fake.calls[0][1]["temperatures"].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 1e-5, 0.7])
