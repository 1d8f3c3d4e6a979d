"""Reference twin of the token mask of structured output: plain torch, no host sync, written to be read.

Legend: B = rows of logits, V = vocabulary size, G = masked rows, W = 32-bit words per mask row.

A token bitmask is int32 [G, W] with W >= ceil(V / 32): token v of mask row g is allowed when bit
``v % 32`` of word ``bitmask[g, v // 32]`` is 1 (the layout xgrammar, llguidance and outlines-core
fill). Bits past V are ignored.
"""

from __future__ import annotations

import torch
from torch import Tensor


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """bool [G, V]: which tokens each mask row allows."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]; an arithmetic shift keeps bit 0 exact
    return bits.reshape(bitmask.shape[0], 32 * bitmask.shape[1])[:, :vocab_size].bool()


def apply_token_mask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> Tensor:
    """The logits with -inf at every token the mask disallows (a new tensor of logits' dtype).

    logits: [B, V] float; bitmask: int32 [G, W]; rows: int64 [G], distinct: mask row g applies to
    logits row ``rows[g]``; the other rows are returned unchanged.
    """
    x = logits.clone()
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    x[rows] = x[rows].masked_fill(~allowed, float("-inf"))
    return x
