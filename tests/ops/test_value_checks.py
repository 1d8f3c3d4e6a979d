"""Debug checks that read tensor contents (atom_core.ops.value_checks): with the checks on, each bad
value raises ValueError naming the argument and the first bad index and value; with them off the call
runs and does what docs/ops.md says the backend does with it. Tensors live on DEVICE (the GPU where there is
one: Triton runs CPU tensors only in its interpreter)."""

import math

import pytest
import torch

from atom_core import ops
from tests.ops.conftest import DEVICE, needs_triton

T, H, DH, NB, BS, V = 3, 2, 8, 4, 4, 10
COS_SIN = ops.rope_cos_sin_cache(DH, 16, 10000.0, device=DEVICE)[0]  # 16 positions


def rope(positions, backend="torch"):
    q, k = torch.ones(len(positions), H, DH, device=DEVICE), torch.ones(len(positions), 1, DH, device=DEVICE)
    ops.apply_rope_(q, k, torch.tensor(positions, device=DEVICE), COS_SIN, backend=backend)
    return q, k


def store(slots, backend="torch"):
    k_cache, v_cache = torch.zeros(NB, BS, 1, DH, device=DEVICE), torch.zeros(NB, BS, 1, DH, device=DEVICE)
    k = torch.ones(len(slots), 1, DH, device=DEVICE)
    ops.store_kv_(k, k, k_cache, v_cache, torch.tensor(slots, device=DEVICE), backend=backend)
    return k_cache


def store_fp8(k_scale=1.0, v_scale=1.0):
    k_cache = torch.zeros(NB, BS, 1, DH, device=DEVICE, dtype=torch.float8_e4m3fn)
    k = torch.ones(2, 1, DH, device=DEVICE)
    ops.store_kv_(k, k, k_cache, k_cache.clone(), torch.tensor([0, 1], device=DEVICE),
                  k_scale=torch.tensor([k_scale], device=DEVICE), v_scale=torch.tensor([v_scale], device=DEVICE))


def attend(block_tables, cu_seqlens_q, context_lens, max_seqlen_q=None, max_seqlen_k=None, backend="torch"):
    """paged_attention of T query tokens over a pool of NB blocks of BS slots (one kv head); out starts
    as 7.0, so unwritten tokens show."""
    g = torch.Generator().manual_seed(0)
    q, k_cache, v_cache = (torch.randn(*shape, generator=g).to(DEVICE) for shape in [(T, H, DH), (NB, BS, 1, DH),
                                                                                     (NB, BS, 1, DH)])
    lens = [b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])]
    out = torch.full(q.shape, 7.0, device=DEVICE)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    return ops.paged_attention(
        q, k_cache, v_cache, ints(block_tables), ints(cu_seqlens_q), ints(context_lens),
        max(lens) if max_seqlen_q is None else max_seqlen_q,
        max(context_lens) if max_seqlen_k is None else max_seqlen_k, scale=DH ** -0.5, out=out, backend=backend)


def draw(logits, temperature=1.0, top_k=None, backend="torch"):
    rows = logits.shape[0]
    return ops.sample(logits, torch.full((rows,), temperature, device=DEVICE), top_k, None, None,
                      torch.arange(rows, device=DEVICE), torch.zeros(rows, dtype=torch.int64, device=DEVICE),
                      return_logprobs=True, backend=backend)


def logits_with(**entries):
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    for name, value in entries.items():
        row, col = (int(part) for part in name[1:].split("_"))
        x[row, col] = value
    return x.to(DEVICE)


def all_minus_inf_row(row):
    x = logits_with()
    x[row] = float("-inf")
    return x


X, W = torch.randn(T, DH, device=DEVICE), torch.ones(DH, device=DEVICE)
OK_TABLE = [[0, 1], [2, -1]]  # row 0: 5 tokens on blocks 0, 1; row 1: 2 tokens on block 2

CASES = {
    "rms_norm eps 0": (lambda: ops.rms_norm(X, W, 0.0), r"eps must be > 0, got 0\.0"),
    "rms_norm eps < 0": (lambda: ops.rms_norm(X, W, -1e-6), r"eps must be > 0, got -1e-06"),
    "rms_norm eps nan": (lambda: ops.rms_norm(X, W, math.nan), r"eps must be > 0, got nan"),
    "layer_norm eps 0": (lambda: ops.layer_norm(X, W, None, 0.0), r"eps must be > 0, got 0\.0"),
    "layer_norm eps nan": (lambda: ops.layer_norm(X, W, None, math.nan), r"eps must be > 0, got nan"),
    "rope position negative": (lambda: rope([0, -1, 3]), r"positions\[1\] = -1 is outside \[0, 16\)"),
    "rope position past the cache": (lambda: rope([0, 1, 16]), r"positions\[2\] = 16 is outside \[0, 16\)"),
    "store_kv slot < -1": (lambda: store([0, -2, 3]), r"slot_mapping\[1\] = -2 is outside \[-1, 16\)"),
    "store_kv slot past the pool": (lambda: store([0, 16]), r"slot_mapping\[1\] = 16 is outside \[-1, 16\)"),
    "attention block id past the pool": (lambda: attend([[0, 4], [2, -1]], [0, 2, 3], [5, 2]),
                                         r"block_tables\[0, 1\] = 4 is outside \[-1, 4\)"),
    "attention block id < -1": (lambda: attend([[0, 1], [2, -2]], [0, 2, 3], [5, 2]),
                                r"block_tables\[1, 1\] = -2 is outside \[-1, 4\)"),
    "attention block -1 inside the context": (lambda: attend([[0, -1], [2, -1]], [0, 2, 3], [5, 2]),
                                              r"block_tables\[0, 1\] = -1 lies within the 2 pages "
                                              r"context_lens\[0\] = 5 needs"),
    "attention context beyond the table": (lambda: attend(OK_TABLE, [0, 2, 3], [9, 2]),
                                           r"context_lens\[0\] = 9 needs 3 pages of 4 slots but block_tables "
                                           r"has 2 columns"),
    "attention cu_seqlens_q not from 0": (lambda: attend(OK_TABLE, [1, 2, 3], [5, 2]),
                                          r"cu_seqlens_q\[0\] = 1 must be 0"),
    "attention cu_seqlens_q not ending at T": (lambda: attend(OK_TABLE, [0, 2, 2], [5, 2]),
                                               r"cu_seqlens_q\[-1\] = 2 must equal the 3 query tokens"),
    "attention cu_seqlens_q decreasing": (lambda: attend([[0, 1], [2, -1], [3, -1]], [0, 3, 1, 3], [5, 2, 2]),
                                          r"cu_seqlens_q\[2\] = 1 < cu_seqlens_q\[1\] = 3"),
    "attention more queries than context": (lambda: attend(OK_TABLE, [0, 1, 3], [5, 1]),
                                            r"row 1 has 2 query tokens but context_lens\[1\] = 1"),
    "attention max_seqlen_q too small": (lambda: attend(OK_TABLE, [0, 2, 3], [5, 2], max_seqlen_q=1),
                                         r"max_seqlen_q = 1 is below row 0's 2 query tokens"),
    "attention max_seqlen_k too small": (lambda: attend(OK_TABLE, [0, 2, 3], [5, 2], max_seqlen_k=4),
                                         r"max_seqlen_k = 4 is below context_lens\[0\] = 5"),
    "per_tensor_quant scale < 0": (lambda: ops.per_tensor_quant(X, scale=torch.tensor([-1.0], device=DEVICE)),
                                   r"scale\[0\] = -1\.0: a static scale must be finite and > 0"),
    "per_tensor_quant scale 0": (lambda: ops.per_tensor_quant(X, scale=torch.zeros(1, device=DEVICE)),
                                 r"scale\[0\] = 0\.0: a static scale"),
    "per_tensor_quant scale nan": (lambda: ops.per_tensor_quant(X, scale=torch.full((1,), math.nan, device=DEVICE)),
                                   r"scale\[0\] = nan: a static scale"),
    "store_kv fp8 k_scale 0": (lambda: store_fp8(k_scale=0.0), r"k_scale\[0\] = 0\.0: a static scale"),
    "store_kv fp8 v_scale inf": (lambda: store_fp8(v_scale=math.inf), r"v_scale\[0\] = inf: a static scale"),
    "sample NaN logit": (lambda: draw(logits_with(x1_3=math.nan, x2_0=math.nan)), r"logits\[1, 3\] is NaN"),
    "sample all -inf row": (lambda: draw(all_minus_inf_row(2)), r"logits row 2 is all -inf"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_with_checks_on_a_bad_value_raises_naming_argument_index_and_value(case):
    call, message = CASES[case]
    with ops.debug_checks(), pytest.raises(ValueError, match=message):
        call()


def test_with_checks_on_a_padding_row_with_context_0_may_hold_queries_and_outputs_zeros():
    # build_step_layout's padding rows (pad_tokens_to): context 0, any query count, a table row of -1.
    with ops.debug_checks():
        out = attend([[0, 1], [-1, -1]], [0, 1, 3], [5, 0])
    assert bool((out[1:] == 0).all())


# With the checks off: what docs/ops.md says each backend does (only cases that stay in bounds run).
def _eps_0_makes_a_zero_row_nan(backend):
    x = X.clone()
    x[1] = 0
    out = ops.rms_norm(x, W, 0.0, backend=backend)
    assert bool(out[1].isnan().all()) and bool(out[[0, 2]].isfinite().all())


def _rope_position_minus_1_torch_wraps_to_the_last_row():
    q, _ = rope([0, -1, 3])
    want, _ = rope([0, 15, 3])
    assert torch.equal(q, want)


def _rope_position_outside_triton_zeroes_the_rotary_dims():
    q, k = rope([0, -1, 16], backend="triton")
    assert bool((q[1:] == 0).all()) and bool((k[1:] == 0).all()) and not bool((q[0] == 0).all())


def _slot_minus_2_writes_nothing(backend):
    cache = store([-2, 5], backend=backend)
    assert cache.flatten(0, 1)[5].eq(1).all() and int(cache.ne(0).sum()) == DH


def _more_queries_than_context_the_first_queries_output_zeros(backend):
    out = attend(OK_TABLE, [0, 1, 3], [5, 1], backend=backend)
    assert bool((out[1] == 0).all()) and bool((out[2] != 0).all())


def _cu_seqlens_q_not_from_0_leaves_the_first_tokens(backend, want):
    out = attend(OK_TABLE, [1, 2, 3], [5, 2], backend=backend)
    assert bool((out[0] == want).all()) and bool((out[1:] != 7.0).all())


def _all_minus_inf_row_draws_token_0_with_logprob_nan(backend):
    tokens, logprobs = draw(all_minus_inf_row(2), backend=backend)
    assert tokens[2].item() == 0 and math.isnan(logprobs[2].item())


def _nan_logit_torch_draws_the_first_nan():
    tokens, logprobs = draw(logits_with(x1_3=math.nan, x1_6=math.nan))
    assert tokens[1].item() == 3 and math.isnan(logprobs[1].item())


UNCHECKED = {
    "rms_norm eps 0, torch": lambda: _eps_0_makes_a_zero_row_nan("torch"),
    "rms_norm eps 0, triton": lambda: _eps_0_makes_a_zero_row_nan("triton"),
    "rope position -1, torch": _rope_position_minus_1_torch_wraps_to_the_last_row,
    "rope positions outside, triton": _rope_position_outside_triton_zeroes_the_rotary_dims,
    "store_kv slot -2, torch": lambda: _slot_minus_2_writes_nothing("torch"),
    "store_kv slot -2, triton": lambda: _slot_minus_2_writes_nothing("triton"),
    "attention more queries than context, torch": lambda: _more_queries_than_context_the_first_queries_output_zeros(
        "torch"),
    "attention more queries than context, triton": lambda: _more_queries_than_context_the_first_queries_output_zeros(
        "triton"),
    "attention cu_seqlens_q from 1, torch": lambda: _cu_seqlens_q_not_from_0_leaves_the_first_tokens("torch", 0.0),
    "attention cu_seqlens_q from 1, triton": lambda: _cu_seqlens_q_not_from_0_leaves_the_first_tokens("triton", 7.0),
    "sample all -inf row, torch": lambda: _all_minus_inf_row_draws_token_0_with_logprob_nan("torch"),
    "sample all -inf row, triton": lambda: _all_minus_inf_row_draws_token_0_with_logprob_nan("triton"),
    "sample NaN logit, torch": _nan_logit_torch_draws_the_first_nan,
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=needs_triton) if c.endswith("triton") else c
                                  for c in sorted(UNCHECKED)])
def test_with_checks_off_the_value_checks_are_skipped_and_the_backend_does_what_docs_say(case):
    with ops.debug_checks(False):
        UNCHECKED[case]()
