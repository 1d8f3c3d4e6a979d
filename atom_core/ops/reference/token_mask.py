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
    """bool [G, V]: which tokens each mask row allows.

    Byte by byte through a [256, 8] table (a word's bytes in memory order are its bits 0-7, 8-15,
    ... on a little-endian machine, as every machine torch runs on): bit j of byte k of word w is
    token 32 w + 8 k + j."""
    table = ((torch.arange(256, device=bitmask.device)[:, None] >> torch.arange(8, device=bitmask.device)) & 1)
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [G, 4 W]
    bits = torch.nn.functional.embedding(as_bytes, table.to(torch.uint8))  # [G, 4 W, 8]
    return bits.reshape(bitmask.shape[0], 32 * bitmask.shape[1])[:, :vocab_size].bool()


def apply_token_mask_(logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
    """:func:`apply_token_mask` in place (the torch backend): only the masked rows are read and written."""
    masked = logits.index_select(0, rows)
    masked.masked_fill_(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))
    logits.index_copy_(0, rows, masked)


def apply_token_mask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> Tensor:
    """The logits with -inf at every token the mask disallows (a new tensor of logits' dtype).

    logits: [B, V] float; bitmask: int32 [G, W]; rows: int64 [G], distinct: mask row g applies to
    logits row ``rows[g]``; the other rows are returned unchanged.
    """
    x = logits.clone()
    apply_token_mask_(x, bitmask, rows)
    return x
