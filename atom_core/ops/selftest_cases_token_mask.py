"""The selftest's cases of the token-mask op of structured output (``apply_token_mask_``), in the format
of ``atom_core.ops.selftest_cases``: seeded inputs rebuilt at each run, outputs compared with the
twin's. Each case masks some rows (not in order, not all of them) with random bitmasks whose words
include 0, -1 (all allowed) and words with bit 31 set; the masked logits must be -inf exactly where the
twin's are and the others unchanged.
Legend: B rows, V vocabulary, G masked rows, W words per mask row.
"""

from __future__ import annotations

import torch

from atom_core import ops
from atom_core.ops.selftest_cases import Case, grid_dtypes
from atom_core.ops.token_mask import bitmask_words


def token_mask_inputs(rows: int, vocab: int, dtype, device, seed: int = 41):
    """logits [B, V], bitmask int32 [G, W] and rows int64 [G] (every other row, in reverse order)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    masked = torch.arange(rows - 1, -1, -2)
    words = bitmask_words(vocab)
    bitmask = torch.randint(-2**31, 2**31, (len(masked), words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[:, ::7] = -1
    bitmask[:, 1::11] = 0
    return logits.to(device, dtype), bitmask.to(device), masked.to(device)


def _equal(got, want):
    if not torch.equal(got[0].isinf(), want[0].isinf()):
        return "masked (-inf) logits differ"
    if not torch.equal(got[0].nan_to_num(), want[0].nan_to_num()):
        return "an allowed logit changed"
    return None


def token_mask_cases(grid: str, device) -> list[Case]:
    shapes = [(5, 300)] if grid == "quick" else [(1, 151_936), (64, 151_936), (7, 4099)]
    cases = []
    for rows, vocab in shapes:
        for dtype in grid_dtypes(grid):
            def mask(backend, rows=rows, vocab=vocab, dtype=dtype):
                logits, bitmask, masked = token_mask_inputs(rows, vocab, dtype, device)
                return (ops.apply_token_mask_(logits, bitmask, masked, backend=backend),)

            cases.append(Case("apply_token_mask_", f"B={rows} V={vocab} {dtype}", mask, _equal))
    return cases
