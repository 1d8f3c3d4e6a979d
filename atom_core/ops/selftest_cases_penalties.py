"""The selftest's cases of the logits penalty ops (``apply_penalties_``, ``apply_token_bias_``), in the
format of ``atom_core.ops.selftest_cases``: seeded inputs rebuilt at each run, outputs compared with
the twin's. Every case has rows without a slot (left unchanged), allow-list bans, zero logits and
repeated tokens; the bias cases put several entries on one logit and -inf bans. Triton serves
``apply_token_bias_`` on float32 logits only (atomic adds): its bf16/fp16 cases count as refused.
Legend: B rows, V vocabulary, S token-state slots, E bias entries.
"""

from __future__ import annotations

import torch

from atom_core import ops
from atom_core.ops.penalties import init_token_state_
from atom_core.ops.selftest_cases import Case, close_outputs, grid_dtypes
from atom_core.ops.tolerances import ELEMENTWISE, tolerance


def _penalty_inputs(rows: int, vocab: int, dtype, device, seed: int = 31):
    """logits [B, V], token_state [S, V] (S = B + 2), slots (every third row -1), the three penalties."""
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, vocab, generator=g)
    logits[:, ::5] = 0.0
    slots_total = rows + 2
    state = torch.zeros(slots_total, vocab, dtype=torch.int32)
    order = torch.randperm(slots_total, generator=g)
    slots = torch.where(torch.arange(rows) % 3 == 1, -1, order[:rows])
    for r in range(rows):
        if slots[r] < 0:
            continue
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        output = torch.randint(0, max(1, vocab // 4), (int(torch.randint(0, 60, (1,), generator=g)),), generator=g)
        allowed = torch.randperm(vocab, generator=g)[:vocab // 2] if r % 4 == 2 else None
        init_token_state_(state, int(slots[r]), prompt, output, allowed)
    presence = 4 * torch.rand(rows, generator=g) - 2
    frequency = 4 * torch.rand(rows, generator=g) - 2
    repetition = 0.5 + 1.5 * torch.rand(rows, generator=g)
    return (logits.to(device, dtype), state.to(device), slots.to(device), presence.to(device),
            frequency.to(device), repetition.to(device))


def _same_bans_and_close(dtype):
    tol = tolerance(dtype, ELEMENTWISE)

    def check(got, want):
        if not torch.equal(got[0].isinf(), want[0].isinf()):
            return "banned (-inf) logits differ"
        return close_outputs((got[0].float().nan_to_num(),), (want[0].float().nan_to_num(),), tol)

    return check


def penalty_cases(grid: str, device) -> list[Case]:
    shapes = [(5, 300)] if grid == "quick" else [(1, 151_936), (7, 4099), (64, 32_000)]
    cases = []
    for rows, vocab in shapes:
        for dtype in grid_dtypes(grid):
            def penalties(backend, rows=rows, vocab=vocab, dtype=dtype):
                logits, *rest = _penalty_inputs(rows, vocab, dtype, device)
                return (ops.apply_penalties_(logits, *rest, backend=backend),)

            def bias(backend, rows=rows, vocab=vocab, dtype=dtype):
                g = torch.Generator().manual_seed(37)
                logits = torch.randn(rows, vocab, generator=g).to(device, dtype)
                entries = 4 * rows + 3
                where = (torch.randint(0, rows, (entries,), generator=g).to(device),
                         torch.randint(0, min(vocab, 50), (entries,), generator=g).to(device))
                values = torch.randn(entries, generator=g)
                values[::5] = float("-inf")
                return (ops.apply_token_bias_(logits, *where, values.to(device), backend=backend),)

            label = f"B={rows} V={vocab} {dtype}"
            check = _same_bans_and_close(dtype)
            cases += [Case("apply_penalties_", label, penalties, check), Case("apply_token_bias_", label, bias, check)]
    return cases
