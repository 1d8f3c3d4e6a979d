"""The radix-select top-k of score rows (triton/topk_select.py, the DSA indexer's top-k).

Each output row is held to a statement of its contract computed here with torch (not the kernel's passes):
the positions above the ``keep``-th largest visible score in increasing order, then the positions tied with it,
earliest first, as many as fill ``keep``, then -1; -inf (not visible) never chosen. Rows come with heavy ties
(scores drawn from a few integers), negative scores, all-invisible rows, widths that are not a multiple of the
chunk, and several chunks a row. The CPU interpreter runs it here; on a GPU the same tests and DeepSeek-V3.2's
shape (32k positions, K = 2048) against ``torch.topk``.

Legend: T rows, W width, K = keep.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.conftest import DEVICE, needs_gpu, needs_triton

pytestmark = needs_triton


def expected_positions(row: torch.Tensor, keep: int) -> list[int]:
    """The contract for one row, in slots s of position order: positions above the K-th largest visible score
    (ascending), then the tied ones (earliest first) up to ``keep``; a row that keeps ``keep`` stores slot s at
    (s * spread) % keep, one that keeps fewer in order, then -1."""
    from atom_core.ops.triton.topk_select import spread_for

    visible = (row != float("-inf")).nonzero().flatten()
    take = min(keep, len(visible))
    if take == 0:
        return [-1] * keep
    kth = row[visible].sort(descending=True).values[take - 1]
    above = [j for j in range(len(row)) if row[j] > kth]
    tied = [j for j in range(len(row)) if row[j] == kth][:take - len(above)]
    in_order = above + tied
    if take < keep:
        return in_order + [-1] * (keep - take)
    spread, out = spread_for(keep), [None] * keep
    for s, position in enumerate(in_order):
        out[s * spread % keep] = position
    return out


@given(keep=st.integers(1, 5000))
def test_spread_fills_every_slot_of_a_full_row_once(keep):
    from atom_core.ops.triton.topk_select import spread_for

    spread = spread_for(keep)
    assert sorted(s * spread % keep for s in range(keep)) == list(range(keep))


def run_topk(scores: torch.Tensor, keep: int, chunk: int) -> torch.Tensor:
    from atom_core.ops.triton import topk_select

    rows, width = scores.shape
    state = torch.zeros(rows, topk_select.state_width(width, chunk), dtype=torch.int32, device=scores.device)
    out = torch.full((rows, keep, 2), 12345, dtype=torch.int32, device=scores.device)[..., 0]  # strided rows
    topk_select.topk_positions(scores, state, out, keep, chunk)
    return out.cpu()


@st.composite
def score_rows(draw):
    rows = draw(st.integers(1, 3))
    width = draw(st.integers(1, 200))
    keep = draw(st.integers(1, width))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["normal", "few values", "tiny"]))
    if kind == "normal":
        scores = torch.randn(rows, width, generator=g)
    elif kind == "few values":  # ties at the threshold, negatives and zeros of both signs (equal: a tie)
        scores = torch.randint(-3, 4, (rows, width), generator=g).float()
        scores[(scores == 0) & (torch.rand(rows, width, generator=g) < 0.5)] = -0.0
    else:  # subnormals and exponents that share a top byte
        scores = torch.randn(rows, width, generator=g) * 1e-40
    hidden = torch.rand(rows, width, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.9, 1.0]))
    scores[hidden] = float("-inf")
    return scores, keep, draw(st.sampled_from([16, 32, 64]))


@settings(max_examples=25, deadline=None)
@given(case=score_rows())
def test_topk_positions_keep_the_largest_visible_scores_in_the_stated_order(case):
    scores, keep, chunk = case
    got = run_topk(scores.to(DEVICE), keep, chunk)
    for t in range(scores.shape[0]):
        assert got[t].tolist() == expected_positions(scores[t], keep)


@needs_gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_topk_positions_choose_what_torch_topk_chooses_at_deepseek_v32_shape(rows):
    from atom_core.ops.triton import topk_select
    from atom_core.ops.triton.launch import num_sms

    width, keep = 32768, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(rows, width, device="cuda", generator=g).relu()  # relu'd head sums: many exact zeros
    scores[:, 30000:] = float("-inf")
    got = run_topk(scores, keep, topk_select.chunk_size(rows, width, num_sms(0)))
    values = torch.topk(scores, keep, dim=1).values.cpu()
    chosen = torch.gather(scores.cpu(), 1, got.long())
    assert torch.equal(chosen.sort(dim=1, descending=True).values, values)
    assert all(len(set(r.tolist())) == keep for r in got)


def test_a_nan_of_either_sign_ranks_above_every_number_as_torch_topk_ranks_it():
    scores = torch.tensor([[1.0, float("inf"), -float("nan"), 2.0, float("nan"), -float("inf")]])
    assert run_topk(scores.to(DEVICE), 3, 16)[0].tolist() == [2, 4, 1]
