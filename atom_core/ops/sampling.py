"""Sampling ops: ``sample`` (greedy / temperature / top-k / top-p / min-p, seeded per row) and
``rejection_sample_greedy`` (greedy acceptance of speculative draft tokens).

Legend: B = rows (one per sequence), V = vocabulary size, K = draft tokens per row.

How a draw is made, and why this way:

* **Seeded per row, counter-based.** The noise of row r at vocab index v is a pure function of
  ``(seeds[r], offsets[r], v)`` — Philox in the Triton kernel, an integer hash in the torch twin —
  so a row's token depends only on its own logits, seed and offset: never on its batch mates, its
  row index or the batch size, and no RNG state lives anywhere. The engine passes a per-request
  seed and ``offset = tokens generated so far``. Backends draw different numbers for the same
  (seed, offset); each is a correct sampler, and the tests are statistical.
* **Exponential trick, no host sync.** ``argmax_v p_v / E_v`` with ``E_v ~ Exp(1)`` picks v with
  probability p_v (equivalently Gumbel-max on ``logits / T``). It is one streaming argmax: no
  ``torch.multinomial``, no ``.item()``, so the op is CUDA-graph capturable.
* **Filters as one cut-off per row, computed in torch and shared by all backends.** top-k, then
  top-p (on the top-k-renormalised distribution), then min-p each keep a prefix of the tokens sorted
  by logit, so together they keep ``logits >= cutoff[r]`` for one number per row
  (``reference.filter_cutoff``; ties with the last kept token are kept). top-k/top-p need a sort
  over V; a sort is what torch does well, and the kernel then needs no mask tensor: it reads the
  logits once, fusing temperature, cut-off, noise, argmax and the log-sum-exp for log-probs.
  Pass ``None`` for a filter that is off in every row — the caller knows that on the host — and
  the sort is skipped (min-p alone costs one row max, no sort).
* **Log-probs** are ``log_softmax(logits)`` of the RAW logits (before temperature and filters) at
  the chosen token: the model's own log-likelihood of the emitted token.

* **Tiny temperatures are greedy.** Rows with ``temperature < 1e-5``
  (``reference.sampling.GREEDY_BELOW_TEMPERATURE``, vLLM's threshold) take the argmax on every
  backend: ``logits / T`` overflows fp32 near T = 1e-38, and the kernels score in fp32.
* **Filter order is HF transformers'**: top-k, top-p, min-p. vLLM v1 applies min-p first, so its
  top-p renormalises over min-p's survivors and can keep fewer tokens (see ``filter_cutoff``).

Arguments are checked in debug mode (``atom_core.ops.set_debug``), contents included: value
ranges (temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1), no NaN logit, no row of all -inf
logits. On a GPU those reads cost a device-to-host sync (debug mode only; skipped while a CUDA
graph is captured).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import sampling as reference_sampling
from atom_core.ops.validation import FLOAT_DTYPES, check_same_device, check_shape, check_tensor, debug_enabled
from atom_core.ops.value_checks import check_logits, check_no_nan, contents_readable, first_true

SAMPLE = Op("sample")
REJECTION_SAMPLE_GREEDY = Op("rejection_sample_greedy")

_INT_DTYPES = (torch.int32, torch.int64)


def _torch_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, token_ids, logprobs):
    result = reference_sampling.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets,
                                       return_logprobs=logprobs is not None)
    if logprobs is None:
        token_ids.copy_(result)
    else:
        token_ids.copy_(result[0])
        logprobs.copy_(result[1])


def _torch_rejection(draft_token_ids, target_logits, output_token_ids, num_accepted):
    output, accepted = reference_sampling.rejection_sample_greedy(draft_token_ids, target_logits)
    output_token_ids.copy_(output)
    num_accepted.copy_(accepted)


def _last_dim_contiguous(name: str, t: Tensor) -> str | None:
    return None if t.stride(-1) == 1 else f"{name} needs its last dim contiguous"


def _triton_sample_supports(logits, *rest) -> str | None:
    return _last_dim_contiguous("triton sample", logits)


def _triton_rejection_supports(draft_token_ids, target_logits, *rest) -> str | None:
    return _last_dim_contiguous("triton rejection_sample_greedy", target_logits)


def _aiter_sample_supports(logits, *rest) -> str | None:
    return _last_dim_contiguous("aiter mixed_sample_outer_exponential", logits)


def _aiter_rejection_supports(draft_token_ids, target_logits, *rest) -> str | None:
    return None if target_logits.is_contiguous() else "aiter greedy_sample needs contiguous target_logits"


def _logits_key(logits, *rest):
    """What the sample rules read."""
    return logits.stride()[-1] == 1


def _target_logits_key(draft_token_ids, target_logits, *rest):
    """What the rejection_sample_greedy rules read."""
    return target_logits.stride()[-1] == 1, target_logits.is_contiguous()


SAMPLE.register("torch", _torch_sample)
SAMPLE.register("triton", "atom_core.ops.triton.sampling:sample", _triton_sample_supports, _logits_key)
SAMPLE.register("aiter", "atom_core.ops.aiter.sampling:sample", _aiter_sample_supports, _logits_key)
REJECTION_SAMPLE_GREEDY.register("torch", _torch_rejection)
REJECTION_SAMPLE_GREEDY.register("triton", "atom_core.ops.triton.sampling:rejection_sample_greedy",
                                 _triton_rejection_supports, _target_logits_key)
REJECTION_SAMPLE_GREEDY.register("aiter", "atom_core.ops.aiter.sampling:rejection_sample_greedy",
                                 _aiter_rejection_supports, _target_logits_key)


@custom_op("sample", mutates_args=("token_ids", "logprobs"))
def _sample_op(logits: Tensor, temperature: Tensor, top_k: Optional[Tensor], top_p: Optional[Tensor],
               min_p: Optional[Tensor], seeds: Tensor, offsets: Tensor, token_ids: Tensor,
               logprobs: Optional[Tensor], backend: Optional[str]) -> None:
    SAMPLE(logits, temperature, top_k, top_p, min_p, seeds, offsets, token_ids, logprobs, backend=backend)


@_sample_op.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, offsets, token_ids, logprobs, backend) -> None:
    return None


@custom_op("rejection_sample_greedy", mutates_args=("output_token_ids", "num_accepted"))
def _rejection_op(draft_token_ids: Tensor, target_logits: Tensor, output_token_ids: Tensor, num_accepted: Tensor,
                  backend: Optional[str]) -> None:
    REJECTION_SAMPLE_GREEDY(draft_token_ids, target_logits, output_token_ids, num_accepted, backend=backend)


@_rejection_op.register_fake
def _(draft_token_ids, target_logits, output_token_ids, num_accepted, backend) -> None:
    return None


def _check_row_param(name: str, t, rows: int, dtypes, optional: bool = False) -> None:
    if t is None and optional:
        return
    check_tensor(name, t, ndim=1, dtypes=dtypes)
    check_shape(name, t, (rows,))


def _check_values(temperature, top_p, min_p) -> None:
    """Value ranges of the row parameters (a host sync for GPU tensors; skipped where contents cannot
    be read, see atom_core.ops.value_checks)."""
    if not contents_readable(temperature, top_p, min_p):
        return
    _raise_first("temperature", temperature, ~(temperature >= 0), "must be >= 0 (0 = greedy)")
    if top_p is not None:
        _raise_first("top_p", top_p, ~((top_p > 0) & (top_p <= 1)), "must be in (0, 1] (1 = off)")
    if min_p is not None:
        _raise_first("min_p", min_p, ~((min_p >= 0) & (min_p <= 1)), "must be in [0, 1] (0 = off)")


def _raise_first(name: str, values: Tensor, bad: Tensor, rule: str) -> None:
    index = first_true(bad)
    if index is not None:
        raise ValueError(f"{name}[{index[0]}] = {float(values[index])} {rule}")


def _check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, offsets, return_logprobs) -> None:
    """The per-call checks, run in debug mode only (atom_core.ops.validation)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits must have at least one column (vocab size 0)")
    _check_row_param("temperature", temperature, rows, (torch.float32,))
    _check_row_param("top_k", top_k, rows, _INT_DTYPES, optional=True)
    _check_row_param("top_p", top_p, rows, (torch.float32,), optional=True)
    _check_row_param("min_p", min_p, rows, (torch.float32,), optional=True)
    _check_row_param("seeds", seeds, rows, (torch.int64,))
    _check_row_param("offsets", offsets, rows, (torch.int64,))
    check_same_device(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      seeds=seeds, offsets=offsets)
    _check_values(temperature, top_p, min_p)
    check_logits(logits)
    if not isinstance(return_logprobs, bool):
        raise TypeError(f"return_logprobs must be a bool, got {type(return_logprobs).__name__}")


def _check_rejection_args(draft_token_ids, target_logits) -> None:
    """The per-call checks, run in debug mode only (atom_core.ops.validation)."""
    check_tensor("draft_token_ids", draft_token_ids, ndim=2, dtypes=(torch.int64,))
    check_tensor("target_logits", target_logits, ndim=2, dtypes=FLOAT_DTYPES)
    rows, k = draft_token_ids.shape
    check_shape("target_logits", target_logits, (rows * (k + 1), None))
    if target_logits.shape[1] == 0:
        raise ValueError("target_logits must have at least one column (vocab size 0)")
    check_same_device(draft_token_ids=draft_token_ids, target_logits=target_logits)
    check_no_nan("target_logits", target_logits)  # the backends' argmaxes would disagree on it


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor | None, top_p: Tensor | None, min_p: Tensor | None,
           seeds: Tensor, offsets: Tensor, *, return_logprobs: bool = False, backend: str | None = None):
    """Draw one token per row, each row with its own parameters, in one call.

    logits: [B, V] fp32/fp16/bf16.
    temperature: [B] float32; ``0`` = greedy (argmax, lowest index on ties), and so is any
    ``T < 1e-5`` (as in vLLM); else logits / T.
    top_k: [B] int32/int64, ``<= 0`` or ``>= V`` = off (keeps the k largest logits and any tied with
    the k-th); top_p: [B] float32 in (0, 1], ``1`` = off (keeps the smallest set of most likely
    tokens whose probability, renormalised over what top-k kept, is >= top_p; always the top
    token); min_p: [B] float32 in [0, 1], ``0`` = off (keeps tokens with p >= min_p * p_max).
    Applied in that order, HF transformers' (temperature, top-k, top-p, min-p); vLLM v1 applies
    min-p before top-k/top-p. Any of the three may be None = off in every row (skips their work).
    seeds, offsets: [B] int64 — the row's draw is a function of (seed, offset) and its logits only.
    Returns token_ids [B] int64, or ``(token_ids, logprobs)`` with logprobs [B] float32 =
    ``log_softmax(logits)[r, token_ids[r]]`` of the raw logits (before temperature and filters).
    """
    if debug_enabled():
        _check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, offsets, return_logprobs)
    rows = logits.shape[0]
    token_ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device) if return_logprobs else None
    call_op("sample", logits, temperature, top_k, top_p, min_p, seeds, offsets, token_ids, logprobs, backend)
    return (token_ids, logprobs) if return_logprobs else token_ids


def rejection_sample_greedy(draft_token_ids: Tensor, target_logits: Tensor, *, backend: str | None = None):
    """Greedy acceptance of speculative draft tokens.

    draft_token_ids: [B, K] int64, the draft model's K proposals per row.
    target_logits: [B*(K+1), V] fp32/fp16/bf16, row ``r*(K+1) + j`` = the target model's logits
    after row r's first j drafts (j = K gives the bonus position).
    Drafts are accepted while they equal the target's argmax; the first mismatch is replaced by the
    target's argmax; when all K match, the target's argmax at position K is appended (bonus token).
    Returns ``(output_token_ids [B, K+1] int64, num_accepted [B] int32)``: num_accepted counts the
    accepted drafts (0..K), so a row emits ``num_accepted + 1`` tokens; the rest of its output is -1.
    """
    if debug_enabled():
        _check_rejection_args(draft_token_ids, target_logits)
    rows, k = draft_token_ids.shape
    output_token_ids = torch.empty(rows, k + 1, dtype=torch.int64, device=target_logits.device)
    num_accepted = torch.empty(rows, dtype=torch.int32, device=target_logits.device)
    call_op("rejection_sample_greedy", draft_token_ids, target_logits, output_token_ids, num_accepted, backend)
    return output_token_ids, num_accepted

