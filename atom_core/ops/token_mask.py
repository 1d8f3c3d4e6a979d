"""The token mask of structured output, applied in place before ``sample``: ``apply_token_mask_``
sets to -inf every logit a grammar disallows, from a packed bitmask per masked row.

Legend: B = rows of logits, V = vocabulary size, G = masked rows, W = 32-bit words per mask row.

The bitmask is int32 [G, W], W >= ceil(V / 32), bit ``v % 32`` of word ``v // 32`` = token v allowed
(the layout the grammar libraries fill on the host: xgrammar, llguidance, outlines-core), so a
step moves V / 8 bytes per masked row to the device instead of a [G, V] bool or float mask. Only
the rows that need a mask are sent (``rows``); the others are untouched.

Arguments are checked in debug mode (``atom_core.ops.set_debug``): dtypes, shapes, devices, and
(contents) rows within [0, B) and distinct.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import token_mask as reference_token_mask
from atom_core.ops.validation import (
    FLOAT_DTYPES,
    check_same_device,
    check_shape,
    check_tensor,
    debug_enabled,
)
from atom_core.ops.value_checks import _raise_first_outside, contents_readable

__all__ = ["apply_token_mask_", "bitmask_words"]

APPLY_TOKEN_MASK = Op("apply_token_mask_")


def bitmask_words(vocab_size: int) -> int:
    """W: the 32-bit words of one mask row over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def _torch_apply_token_mask(logits, bitmask, rows):
    reference_token_mask.apply_token_mask_(logits, bitmask, rows)


def _triton_supports(logits, bitmask, rows) -> str | None:
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        return "triton apply_token_mask_ needs the last dim of logits and bitmask contiguous"
    return None


def _triton_key(logits, bitmask, rows):
    """What :func:`_triton_supports` reads."""
    return logits.stride()[-1] == 1, bitmask.stride()[-1] == 1


APPLY_TOKEN_MASK.register("torch", _torch_apply_token_mask)
APPLY_TOKEN_MASK.register("triton", "atom_core.ops.triton.token_mask:apply_token_mask_", _triton_supports,
                          _triton_key)


@custom_op("apply_token_mask_", mutates_args=("logits",))
def _token_mask_op(logits: Tensor, bitmask: Tensor, rows: Tensor, backend: str | None) -> None:
    APPLY_TOKEN_MASK(logits, bitmask, rows, backend=backend)


@_token_mask_op.register_fake
def _(logits, bitmask, rows, backend) -> None:
    return None


def _check_args(logits, bitmask, rows) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_rows, vocab = logits.shape
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,))
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,))
    check_shape("bitmask", bitmask, (rows.shape[0], None))
    if bitmask.shape[1] < bitmask_words(vocab):
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row; V={vocab} needs "
                         f"{bitmask_words(vocab)} (ceil(V / 32))")
    check_same_device(logits=logits, bitmask=bitmask, rows=rows)
    if contents_readable(rows):
        _raise_first_outside("rows", rows, 0, num_rows, "rows of logits")
        if rows.unique().numel() != rows.numel():
            raise ValueError(f"rows must be distinct, got {rows.tolist()}")


def apply_token_mask_(logits: Tensor, bitmask: Tensor, rows: Tensor, *, backend: str | None = None) -> Tensor:
    """``logits[rows[g], v] = -inf`` for every token v that mask row g disallows, in place; returns ``logits``.

    logits: [B, V] fp32/fp16/bf16; bitmask: int32 [G, W] (W >= ceil(V / 32), bit v % 32 of word
    v // 32 = token v allowed); rows: int64 [G], distinct. No host sync: CUDA-graph capturable.
    """
    if debug_enabled():
        _check_args(logits, bitmask, rows)
    call_op("apply_token_mask_", logits, bitmask, rows, backend)
    return logits
