"""Reference twins for the logits penalties and biases: plain torch, no host sync, written to be read.

Legend: B = rows (one per sequence), V = vocabulary size, S = token-state slots, E = bias entries.

The per-token state of a sequence is one int32 per vocabulary entry (a row of ``token_state``
[S, V], addressed by the row's slot), packing three facts so that a penalty pass reads one
integer per logit:

    bits 0..28  COUNT_MASK   occurrences of the token in the sequence's output
    bit  29     BANNED_BIT   the token is not allowed (``allowed_token_ids`` given, token not in it)
    bit  30     PROMPT_BIT   the token occurs in the prompt

:func:`token_state_row` builds one row from a sequence's tokens (the definition the engine's
incremental updates must agree with).
"""

from __future__ import annotations

import torch
from torch import Tensor

COUNT_BITS = 29
COUNT_MASK = (1 << COUNT_BITS) - 1
BANNED_BIT = 1 << 29
PROMPT_BIT = 1 << 30


def token_state_row(vocab_size: int, prompt_token_ids: Tensor, output_token_ids: Tensor,
                    allowed_token_ids: Tensor | None = None) -> Tensor:
    """One sequence's state [V] int32: output counts, PROMPT_BIT on prompt tokens, BANNED_BIT on
    every token outside ``allowed_token_ids`` (None = all allowed). Token ids: 1-D int64."""
    device = prompt_token_ids.device
    row = torch.zeros(vocab_size, dtype=torch.int32, device=device)
    row.index_fill_(0, prompt_token_ids, PROMPT_BIT)
    row.index_add_(0, output_token_ids, torch.ones_like(output_token_ids, dtype=torch.int32))
    if allowed_token_ids is not None:
        banned = torch.full((vocab_size,), BANNED_BIT, dtype=torch.int32, device=device)
        banned.index_fill_(0, allowed_token_ids, 0)
        row |= banned
    return row


def apply_penalties(logits: Tensor, token_state: Tensor, slots: Tensor, presence_penalty: Tensor,
                    frequency_penalty: Tensor, repetition_penalty: Tensor) -> Tensor:
    """The logits after the penalties (a new tensor of logits' dtype, computed in fp32).

    logits: [B, V] float; token_state: [S, V] int32 (see the module docstring); slots: [B] int64,
    row b reads ``token_state[slots[b]]``, and a row with slot -1 is returned unchanged;
    presence_penalty, frequency_penalty, repetition_penalty: [B] float32.

    For a row with a slot, each token v with output count c:
      * repetition (HF's RepetitionPenaltyLogitsProcessor, vLLM): if v is in the prompt or c > 0,
        ``x = x / r`` for x > 0 and ``x * r`` otherwise;
      * then frequency and presence (OpenAI's, vLLM's): ``x -= f * c + p * (c > 0)``;
      * a token with BANNED_BIT gets -inf.
    """
    has_slot = slots >= 0
    state = token_state[slots.clamp(min=0)]  # [B, V]
    count = (state & COUNT_MASK).float()
    seen = ((state & PROMPT_BIT) != 0) | (count > 0)
    x = logits.float()
    r = repetition_penalty.float()[:, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - frequency_penalty.float()[:, None] * count - presence_penalty.float()[:, None] * (count > 0).float()
    x = x.masked_fill((state & BANNED_BIT) != 0, float("-inf"))
    return torch.where(has_slot[:, None], x.to(logits.dtype), logits)


def apply_token_bias(logits: Tensor, rows: Tensor, token_ids: Tensor, bias: Tensor) -> Tensor:
    """The logits with ``bias[e]`` added at ``(rows[e], token_ids[e])`` for each entry e (a new
    tensor; entries on the same logit add up; -inf bans). rows, token_ids: [E] int64; bias: [E]
    float32. The sum is taken in fp32 and rounded to the logits' dtype."""
    x = logits.to(torch.float32, copy=True)
    x.index_put_((rows, token_ids), bias.float(), accumulate=True)
    return x.to(logits.dtype)
