"""Triton logits penalties and biases, in place.

Legend: B = rows, V = vocabulary size, S = token-state slots, E = bias entries.

``apply_penalties_``: a [B, cdiv(V, BLOCK)] grid; each program reads one block of a row's logits
and of its token-state row (one int32 per token: output count, banned bit, prompt bit; see
``reference.penalties``), applies repetition, then frequency and presence, then the ban, in fp32,
and writes the block back. A row whose slot is -1 reads and writes nothing.

``apply_token_bias_``: one program per BLOCK entries, each an atomic add of its bias into
``logits[row, token]`` (entries on the same logit add up; fp32 logits).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.reference.penalties import BANNED_BIT, COUNT_MASK, PROMPT_BIT
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2

_BLOCK_V = 2048  # logits per program
_BLOCK_E = 256  # bias entries per program


@triton.jit
def _penalties_kernel(
    logits_ptr, stride_logits, state_ptr, stride_state, slots_ptr,
    presence_ptr, frequency_ptr, repetition_ptr, V,
    COUNT_MASK_: tl.constexpr, BANNED_BIT_: tl.constexpr, PROMPT_BIT_: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + row)
    mask = cols < tl.where(slot >= 0, V, 0)  # a row without a slot reads nothing
    state = tl.load(state_ptr + tl.maximum(slot, 0) * stride_state + cols, mask=mask, other=0)
    logit_ptrs = logits_ptr + row * stride_logits + cols
    x = tl.load(logit_ptrs, mask=mask, other=0.0).to(tl.float32)
    count = state & COUNT_MASK_
    seen = ((state & PROMPT_BIT_) != 0) | (count > 0)
    r = tl.load(repetition_ptr + row)
    x = tl.where(seen, tl.where(x > 0, x / r, x * r), x)
    f = tl.load(frequency_ptr + row)
    p = tl.load(presence_ptr + row)
    x = x - f * count.to(tl.float32) - p * (count > 0).to(tl.float32)
    x = tl.where((state & BANNED_BIT_) != 0, float("-inf"), x)
    tl.store(logit_ptrs, x.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_bias_kernel(logits_ptr, stride_logits, rows_ptr, tokens_ptr, bias_ptr, E, BLOCK: tl.constexpr):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = e < E
    rows = tl.load(rows_ptr + e, mask=mask, other=0)
    tokens = tl.load(tokens_ptr + e, mask=mask, other=0)
    bias = tl.load(bias_ptr + e, mask=mask, other=0.0)
    tl.atomic_add(logits_ptr + rows * stride_logits + tokens, bias, mask=mask)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _penalties_block(vocab: int) -> int:
    return min(_BLOCK_V, next_power_of_2(vocab))


def apply_penalties_(logits, token_state, slots, presence_penalty, frequency_penalty, repetition_penalty):
    """Backend entry of ``atom_core.ops.penalties.apply_penalties_`` (in place)."""
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return
    block = _penalties_block(vocab)
    _penalties_kernel[(rows, cdiv(vocab, block))](  # the per-row tensors are read at unit stride
        logits, logits.stride(0), token_state, token_state.stride(0), slots.contiguous(),
        presence_penalty.contiguous(), frequency_penalty.contiguous(), repetition_penalty.contiguous(), vocab,
        COUNT_MASK_=COUNT_MASK, BANNED_BIT_=BANNED_BIT, PROMPT_BIT_=PROMPT_BIT, BLOCK=block, num_warps=4,
    )


def apply_token_bias_(logits, rows, token_ids, bias):
    """Backend entry of ``atom_core.ops.penalties.apply_token_bias_`` (in place)."""
    entries = rows.shape[0]
    if entries == 0:
        return
    _token_bias_kernel[(cdiv(entries, _BLOCK_E),)](  # the entries are read at unit stride
        logits, logits.stride(0), rows.contiguous(), token_ids.contiguous(), bias.contiguous(), entries,
        BLOCK=_BLOCK_E, num_warps=4)
