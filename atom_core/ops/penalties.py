"""Logits penalties and biases, applied in place before ``sample``: ``apply_penalties_`` (repetition,
frequency, presence, and the ban of tokens outside an allow-list, from a dense per-token state) and
``apply_token_bias_`` (sparse additions: ``logit_bias``, and -inf for bad words and ``min_tokens``).

Legend: B = rows (one per sequence), V = vocabulary size, S = token-state slots, E = bias entries.

The token state: one int32 per (slot, token), ``token_state [S, V]``, packing the token's count in
the sequence's output (bits 0..28), a banned bit (29) and an in-prompt bit (30)
(``reference.penalties``). A caller keeps a slot per sequence that uses penalties: set once from
the sequence's tokens (:func:`token_state_row`, :func:`init_token_state_`), then one increment per
sampled token (:func:`count_tokens_`), all on the device, so nothing is rebuilt per step and the
penalty pass reads one int per logit. Dense rather than a per-step bincount of each row's history:
the update per step is B increments, where a bincount re-reads every row's whole history and zeroes
a [B, V] buffer each step; at V = 152k and S = 256 the state is 156 MB of int32.

Definitions (HF transformers' logits processors and vLLM's sampling parameters): for a row with a
slot, each token with output count c — repetition ``r`` (over prompt and output tokens: a positive
logit is divided by r, a negative one multiplied), then ``x -= frequency * c + presence * (c > 0)``
(output tokens only), then banned tokens get -inf. Rows whose slot is -1 are left unchanged.

Arguments are checked in debug mode (``atom_core.ops.set_debug``): dtypes, shapes, devices, and
(contents) slots within [-1, S), bias rows within [0, B) and token ids within [0, V).
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import penalties as reference_penalties
from atom_core.ops.reference.penalties import BANNED_BIT, COUNT_MASK, PROMPT_BIT, token_state_row
from atom_core.ops.validation import FLOAT_DTYPES, check_same_device, check_shape, check_tensor, debug_enabled
from atom_core.ops.value_checks import _raise_first_outside, contents_readable

__all__ = ["BANNED_BIT", "COUNT_MASK", "PROMPT_BIT", "apply_penalties_", "apply_token_bias_", "count_tokens_",
           "init_token_state_", "token_state_row"]

APPLY_PENALTIES = Op("apply_penalties_")
APPLY_TOKEN_BIAS = Op("apply_token_bias_")


def _torch_apply_penalties(logits, token_state, slots, presence, frequency, repetition):
    logits.copy_(reference_penalties.apply_penalties(logits, token_state, slots, presence, frequency, repetition))


def _torch_apply_token_bias(logits, rows, token_ids, bias):
    logits.copy_(reference_penalties.apply_token_bias(logits, rows, token_ids, bias))


def _triton_penalties_supports(logits, token_state, *rest) -> str | None:
    if logits.stride(-1) != 1 or token_state.stride(-1) != 1:
        return "triton apply_penalties_ needs the last dim of logits and token_state contiguous"
    return None


def _triton_penalties_key(logits, token_state, *rest):
    """What :func:`_triton_penalties_supports` reads."""
    return logits.stride()[-1] == 1, token_state.stride()[-1] == 1


def _triton_bias_supports(logits, *rest) -> str | None:
    if logits.dtype != torch.float32:
        return f"triton apply_token_bias_ adds atomically into float32 logits, got {logits.dtype}"
    return None


def _triton_bias_key(logits, *rest):
    """What :func:`_triton_bias_supports` reads."""
    return logits.dtype


APPLY_PENALTIES.register("torch", _torch_apply_penalties)
APPLY_PENALTIES.register("triton", "atom_core.ops.triton.penalties:apply_penalties_", _triton_penalties_supports,
                         _triton_penalties_key)
APPLY_TOKEN_BIAS.register("torch", _torch_apply_token_bias)
APPLY_TOKEN_BIAS.register("triton", "atom_core.ops.triton.penalties:apply_token_bias_", _triton_bias_supports,
                          _triton_bias_key)


@custom_op("apply_penalties_", mutates_args=("logits",))
def _penalties_op(logits: Tensor, token_state: Tensor, slots: Tensor, presence_penalty: Tensor,
                  frequency_penalty: Tensor, repetition_penalty: Tensor, backend: str | None) -> None:
    APPLY_PENALTIES(logits, token_state, slots, presence_penalty, frequency_penalty, repetition_penalty,
                    backend=backend)


@_penalties_op.register_fake
def _(logits, token_state, slots, presence_penalty, frequency_penalty, repetition_penalty, backend) -> None:
    return None


@custom_op("apply_token_bias_", mutates_args=("logits",))
def _token_bias_op(logits: Tensor, rows: Tensor, token_ids: Tensor, bias: Tensor, backend: str | None) -> None:
    APPLY_TOKEN_BIAS(logits, rows, token_ids, bias, backend=backend)


@_token_bias_op.register_fake
def _(logits, rows, token_ids, bias, backend) -> None:
    return None


def _check_penalties_args(logits, token_state, slots, presence, frequency, repetition) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    rows, vocab = logits.shape
    check_tensor("token_state", token_state, ndim=2, dtypes=(torch.int32,))
    check_shape("token_state", token_state, (None, vocab))
    check_tensor("slots", slots, ndim=1, dtypes=(torch.int64,))
    check_shape("slots", slots, (rows,))
    for name, t in (("presence_penalty", presence), ("frequency_penalty", frequency),
                    ("repetition_penalty", repetition)):
        check_tensor(name, t, ndim=1, dtypes=(torch.float32,))
        check_shape(name, t, (rows,))
    check_same_device(logits=logits, token_state=token_state, slots=slots, presence_penalty=presence,
                      frequency_penalty=frequency, repetition_penalty=repetition)
    if contents_readable(slots):
        _raise_first_outside("slots", slots, -1, token_state.shape[0],
                             f"-1 = no penalties; token_state has {token_state.shape[0]} slots")


def _check_bias_args(logits, rows, token_ids, bias) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,))
    entries = rows.shape[0]
    check_tensor("token_ids", token_ids, ndim=1, dtypes=(torch.int64,))
    check_shape("token_ids", token_ids, (entries,))
    check_tensor("bias", bias, ndim=1, dtypes=(torch.float32,))
    check_shape("bias", bias, (entries,))
    check_same_device(logits=logits, rows=rows, token_ids=token_ids, bias=bias)
    if contents_readable(rows, token_ids):
        _raise_first_outside("rows", rows, 0, logits.shape[0], "rows of logits")
        _raise_first_outside("token_ids", token_ids, 0, logits.shape[1], "the vocabulary")


def apply_penalties_(logits: Tensor, token_state: Tensor, slots: Tensor, presence_penalty: Tensor,
                     frequency_penalty: Tensor, repetition_penalty: Tensor, *, backend: str | None = None) -> Tensor:
    """Repetition, frequency and presence penalties and allow-list bans, in place; returns ``logits``.

    logits: [B, V] fp32/fp16/bf16 (computed in fp32). token_state: [S, V] int32 (see the module
    docstring); slots: [B] int64, the state row of each logits row, -1 = leave the row unchanged.
    presence_penalty, frequency_penalty, repetition_penalty: [B] float32 (0, 0, 1 = off).
    No host sync: CUDA-graph capturable.
    """
    if debug_enabled():
        _check_penalties_args(logits, token_state, slots, presence_penalty, frequency_penalty, repetition_penalty)
    call_op("apply_penalties_", logits, token_state, slots, presence_penalty, frequency_penalty, repetition_penalty,
            backend)
    return logits


def apply_token_bias_(logits: Tensor, rows: Tensor, token_ids: Tensor, bias: Tensor, *,
                      backend: str | None = None) -> Tensor:
    """``logits[rows[e], token_ids[e]] += bias[e]`` for each entry, in place (entries on one logit add
    up; a -inf entry bans the token); returns ``logits``. rows, token_ids: [E] int64; bias: [E]
    float32. Triton serves float32 logits (atomic adds); other dtypes fall back to the twin."""
    if debug_enabled():
        _check_bias_args(logits, rows, token_ids, bias)
    call_op("apply_token_bias_", logits, rows, token_ids, bias, backend)
    return logits


def init_token_state_(token_state: Tensor, slot: int, prompt_token_ids: Tensor, output_token_ids: Tensor,
                      allowed_token_ids: Tensor | None = None) -> None:
    """Set slot ``slot`` of ``token_state`` [S, V] for a sequence (``token_state_row``); ids 1-D int64
    on the state's device."""
    token_state[slot] = token_state_row(token_state.shape[1], prompt_token_ids, output_token_ids, allowed_token_ids)


def count_tokens_(token_state: Tensor, slots: Tensor, token_ids: Tensor) -> None:
    """Count one more output occurrence of ``token_ids[i]`` in slot ``slots[i]`` ([N] int64 each,
    slots >= 0, distinct), on the device (no host sync)."""
    token_state.index_put_((slots, token_ids), torch.ones_like(token_ids, dtype=torch.int32), accumulate=True)
