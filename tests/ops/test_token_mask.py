"""The token-mask op of structured output: the twin against a per-token definition and against the
grammar libraries' own bitmask application, Triton (interpreter on CPU) against the twin, validation,
the custom op, and the dispatch-cache nominal call."""

import pytest
import torch

from atom_core import ops
from atom_core.ops.reference.token_mask import apply_token_mask, unpack_bitmask
from atom_core.ops.selftest_cases_token_mask import token_mask_inputs
from atom_core.ops.token_mask import apply_token_mask_, bitmask_words
from tests.ops.conftest import DEVICE, needs_triton

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


def test_twin_equals_the_bit_by_bit_definition():
    logits, bitmask, rows = token_mask_inputs(5, 77, torch.float32, "cpu")
    got = apply_token_mask(logits, bitmask, rows)
    for g, row in enumerate(rows.tolist()):
        for v in range(77):
            allowed = (int(bitmask[g, v // 32]) >> (v % 32)) & 1
            assert got[row, v] == (logits[row, v] if allowed else float("-inf"))
    for row in set(range(5)) - set(rows.tolist()):
        assert torch.equal(got[row], logits[row])


def test_unpacking_matches_xgrammar_bitmasks():
    xgr = pytest.importorskip("xgrammar")
    vocab = 70
    bitmask = xgr.allocate_token_bitmask(2, vocab)
    xgr.reset_token_bitmask(bitmask)
    bitmask[0, 0] = 0b1011
    bitmask[1, 2] = 1 << 5  # token 69 only... plus the words left all-allowed
    bitmask[1, 0] = bitmask[1, 1] = 0
    logits = torch.randn(2, vocab)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    assert torch.equal(apply_token_mask(logits, bitmask, torch.tensor([0, 1])), want)
    assert unpack_bitmask(bitmask, vocab)[1].nonzero().flatten().tolist() == [69]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab", [(7, 37), (4, 3000), (1, 64)])
def test_backends_equal_the_twin(backend, dtype, rows, vocab):
    logits, bitmask, masked = token_mask_inputs(rows, vocab, dtype, DEVICE, seed=vocab)
    got = apply_token_mask_(logits.clone(), bitmask, masked, backend=backend)
    want = apply_token_mask(logits, bitmask, masked)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_on_a_strided_row_view_with_a_wider_bitmask(backend):
    logits, bitmask, masked = token_mask_inputs(3, 64, torch.float32, DEVICE)
    wide = torch.zeros(3, 80, device=DEVICE)
    wide[:, :64] = logits
    wider = torch.cat([bitmask, torch.zeros_like(bitmask)], dim=1)  # words past ceil(V / 32) are ignored
    apply_token_mask_(wide[:, :64], wider, masked, backend=backend)
    assert torch.equal(wide[:, :64], apply_token_mask(logits, bitmask, masked))
    assert (wide[:, 64:] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_masked_rows_equal_the_contiguous_ones(backend):
    logits, bitmask, masked = token_mask_inputs(4, 64, torch.float32, DEVICE, seed=3)
    strided = torch.stack([masked, torch.zeros_like(masked)], dim=1)[:, 0]  # every other element of a buffer
    got = apply_token_mask_(logits.clone(), bitmask, strided, backend=backend)
    assert torch.equal(got, apply_token_mask(logits, bitmask, masked))


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_masked_rows_changes_nothing(backend):
    logits = torch.randn(2, 40, device=DEVICE)
    empty = torch.empty(0, bitmask_words(40), dtype=torch.int32, device=DEVICE)
    got = apply_token_mask_(logits.clone(), empty, torch.empty(0, dtype=torch.int64, device=DEVICE), backend=backend)
    assert torch.equal(got, logits)


@pytest.mark.parametrize("change, match", [
    ({"rows": torch.tensor([0, 2])}, r"rows\[1\] = 2 is outside \[0, 2\)"),
    ({"rows": torch.tensor([1, 1])}, "rows must be distinct"),
    ({"bitmask": torch.zeros(2, 1, dtype=torch.int32)}, r"V=40 needs 2 \(ceil\(V / 32\)\)"),
    ({"bitmask": torch.zeros(2, 2, dtype=torch.int64)}, "bitmask dtype"),
    ({"bitmask": torch.zeros(3, 2, dtype=torch.int32)}, "bitmask must have shape"),
])
def test_bad_arguments_are_named(change, match):
    args = {"logits": torch.randn(2, 40), "bitmask": torch.zeros(2, 2, dtype=torch.int32),
                "rows": torch.tensor([0, 1])} | change
    with ops.debug_checks(), pytest.raises((ValueError, TypeError), match=match):
        apply_token_mask_(*args.values(), backend="torch")


def test_custom_op_passes_opcheck():
    logits, bitmask, rows = token_mask_inputs(3, 50, torch.float32, "cpu")
    torch.library.opcheck(torch.ops.atom_core.apply_token_mask_.default, (logits, bitmask, rows, "torch"))


# ---- nominal call for tests/ops/test_dispatch_cache.py (``ARGS.update(TOKEN_MASK_DISPATCH_ARGS)``) -------------------

def _token_mask_dispatch_args(c):
    rows, vocab = c.vary(3, 1), c.vary(50, 16)
    logits = c.tensor(rows, vocab, dtype=c.vary(torch.float32, torch.bfloat16, torch.float16))
    masked = c.vary(2, 1)
    return logits, c.tensor(masked, bitmask_words(vocab), dtype=torch.int32), c.tensor(masked, dtype=torch.int64)


TOKEN_MASK_DISPATCH_ARGS = {"apply_token_mask_": _token_mask_dispatch_args}
