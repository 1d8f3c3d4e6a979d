"""Triton token mask of structured output, in place.

Legend: B = rows of logits, V = vocabulary size, G = masked rows, W = 32-bit words per mask row.

A [G, cdiv(V, BLOCK)] grid: each program reads BLOCK / 32 words of its mask row, expands them to
BLOCK bits and writes -inf to the logits of ``rows[g]`` where a bit is 0. Allowed logits are
neither read nor written.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2

_BLOCK_V = 4096  # logits per program


@triton.jit
def _token_mask_kernel(logits_ptr, stride_logits, bitmask_ptr, stride_bitmask, rows_ptr, V, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    words = tl.load(bitmask_ptr + g * stride_bitmask + cols // 32, mask=inside, other=-1)
    disallowed = ((words >> (cols % 32)) & 1) == 0
    row = tl.load(rows_ptr + g)
    tl.store(logits_ptr + row * stride_logits + cols, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty),
             mask=inside & disallowed)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _block(vocab: int) -> int:
    return min(_BLOCK_V, next_power_of_2(vocab))


def apply_token_mask_(logits, bitmask, rows):
    """Backend entry of ``atom_core.ops.token_mask.apply_token_mask_`` (in place)."""
    masked, vocab = rows.shape[0], logits.shape[1]
    if masked == 0 or vocab == 0:
        return
    block = _block(vocab)
    _token_mask_kernel[(masked, cdiv(vocab, block))](logits, logits.stride(0), bitmask, bitmask.stride(0),
                                                     rows.contiguous(),  # read at unit stride
                                                     vocab, BLOCK=block, num_warps=4)
