"""Penalty and bias ops: the twins against HF transformers' logits processors and vLLM's documented
presence/frequency penalties, the token state against its definition, Triton against the twin,
validation, the custom ops, and the dispatch-cache nominal calls."""

import random

import pytest
import torch

from atom_core import ops
from atom_core.ops.dispatch import BackendUnavailable, backend_available
from atom_core.ops.penalties import (BANNED_BIT, COUNT_MASK, PROMPT_BIT, apply_penalties_, apply_token_bias_,
                                     count_tokens_, init_token_state_, token_state_row)
from atom_core.ops.tolerances import ELEMENTWISE, tolerance
from tests.ops.conftest import DEVICE, needs_triton

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
FP32, BF16 = torch.float32, torch.bfloat16


def ids(*values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def random_case(rows, vocab, slots_total, seed, allowed_every=3):
    """Logits with zeros and ties, per-row prompt/output sequences, their token state and penalties.
    Rows 1, 4, ... have no slot (-1); every ``allowed_every``-th row with a slot has an allow-list."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, ::7] = 0.0  # zero logits: neither divided nor multiplied
    logits[:, 1::11] = logits[:, 2::11][:, :logits[:, 1::11].shape[1]]  # ties
    state = torch.zeros(slots_total, vocab, dtype=torch.int32)
    slots, sequences = [], []
    free = list(range(slots_total))
    rng.shuffle(free)
    for r in range(rows):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(vocab // 2) for _ in range(rng.randint(0, 20))]  # repeats
        allowed = rng.sample(range(vocab), k=vocab // 2) if r % allowed_every == 2 else None
        sequences.append((prompt, output, allowed))
        if r % 3 == 1:
            slots.append(-1)
            continue
        slot = free.pop()
        slots.append(slot)
        init_token_state_(state, slot, torch.tensor(prompt), torch.tensor(output, dtype=torch.int64),
                          None if allowed is None else torch.tensor(allowed))
    presence = torch.tensor([rng.uniform(-2, 2) for _ in range(rows)])
    frequency = torch.tensor([rng.uniform(-2, 2) for _ in range(rows)])
    repetition = torch.tensor([rng.choice([0.5, 0.9, 1.0, 1.3, 2.0]) for _ in range(rows)])
    return logits, state, torch.tensor(slots), presence, frequency, repetition, sequences


def test_token_state_row_packs_counts_prompt_and_bans():
    row = token_state_row(8, torch.tensor([1, 2, 2]), torch.tensor([2, 5, 5, 5]), torch.tensor([1, 2, 5]))
    assert row.dtype == torch.int32
    assert (row & COUNT_MASK).tolist() == [0, 0, 1, 0, 0, 3, 0, 0]
    assert ((row & PROMPT_BIT) != 0).tolist() == [False, True, True, False, False, False, False, False]
    assert ((row & BANNED_BIT) != 0).tolist() == [True, False, False, True, True, False, True, True]
    no_allow_list = token_state_row(8, torch.tensor([7]), torch.tensor([], dtype=torch.int64))
    assert no_allow_list.tolist() == [0] * 7 + [PROMPT_BIT]


def test_counting_sampled_tokens_equals_the_state_of_the_longer_sequence():
    state = torch.zeros(3, 10, dtype=torch.int32)
    init_token_state_(state, 2, torch.tensor([1, 4]), torch.tensor([4, 6]), torch.tensor([4, 6, 8]))
    init_token_state_(state, 0, torch.tensor([3]), torch.tensor([], dtype=torch.int64))
    for tokens in ([6, 3], [8, 3], [6, 9]):  # (slot 2, slot 0) per step
        count_tokens_(state, torch.tensor([2, 0]), torch.tensor(tokens))
    assert torch.equal(state[2], token_state_row(10, torch.tensor([1, 4]), torch.tensor([4, 6, 6, 8, 6]),
                                                 torch.tensor([4, 6, 8])))
    assert torch.equal(state[0], token_state_row(10, torch.tensor([3]), torch.tensor([3, 3, 9])))
    assert (state[1] == 0).all()


def test_twin_equals_hf_repetition_penalty_and_vllm_presence_frequency():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits, state, slots, presence, frequency, repetition, sequences = random_case(9, 50, 12, seed=1)
    got = ops.reference.penalties.apply_penalties(logits, state, slots, presence, frequency, repetition)
    for r, (prompt, output, allowed) in enumerate(sequences):
        want = logits[r:r + 1].clone()
        if slots[r] < 0:
            assert torch.equal(got[r], logits[r])
            continue
        # HF: over every token of the input ids (prompt and output).
        want = RepetitionPenaltyLogitsProcessor(float(repetition[r]))(torch.tensor([prompt + output]), want)[0]
        for v in range(50):  # vLLM / OpenAI: over the output only
            c = output.count(v)
            want[v] -= float(frequency[r]) * c + float(presence[r]) * (c > 0)
        if allowed is not None:
            want[[v for v in range(50) if v not in allowed]] = float("-inf")
        torch.testing.assert_close(got[r], want, rtol=1e-6, atol=1e-6)
    assert (got[2] == float("-inf")).sum() == 25  # the allow-list row bans the other half


def test_twin_bias_equals_hf_sequence_bias_and_sums_entries_on_one_logit():
    from transformers import SequenceBiasLogitsProcessor

    logits = torch.randn(3, 20)
    bias = {(4,): 2.5, (7,): -1.0, (19,): 100.0}
    want = SequenceBiasLogitsProcessor(sequence_bias=[[list(k), v] for k, v in bias.items()])(
        torch.tensor([[1, 2, 3]]), logits[1:2].clone())[0]
    got = ops.reference.penalties.apply_token_bias(logits, torch.tensor([1, 1, 1]), torch.tensor([4, 7, 19]),
                                                   torch.tensor([2.5, -1.0, 100.0]))
    torch.testing.assert_close(got[1], want)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    summed = ops.reference.penalties.apply_token_bias(logits, torch.tensor([0, 0, 2]), torch.tensor([3, 3, 5]),
                                                      torch.tensor([1.0, float("-inf"), 0.25]))
    assert summed[0, 3] == float("-inf") and summed[2, 5] == logits[2, 5] + 0.25


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("vocab", [37, 3000])
def test_penalties_backends_equal_the_twin(backend, dtype, vocab):
    logits, state, slots, presence, frequency, repetition, _ = random_case(7, vocab, 9, seed=vocab)
    args = [t.to(DEVICE) for t in (state, slots, presence, frequency, repetition)]
    x = logits.to(DEVICE, dtype)
    got = apply_penalties_(x.clone(), *args, backend=backend)
    want = ops.reference.penalties.apply_penalties(x, *args)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got.float().nan_to_num(), want.float().nan_to_num(), **tolerance(dtype, ELEMENTWISE))
    assert torch.equal(got[1], x[1])  # a row without a slot is untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_penalties_in_place_on_a_strided_row_view(backend):
    logits, state, slots, presence, frequency, repetition, _ = random_case(4, 64, 5, seed=3)
    wide = torch.zeros(4, 80, device=DEVICE)
    wide[:, :64] = logits.to(DEVICE)
    args = [t.to(DEVICE) for t in (state, slots, presence, frequency, repetition)]
    apply_penalties_(wide[:, :64], *args, backend=backend)
    torch.testing.assert_close(wide[:, :64], ops.reference.penalties.apply_penalties(logits.to(DEVICE), *args))
    assert (wide[:, 64:] == 0).all()


def _every_other(t):
    """The same values as the 1-D ``t``, each second element of a wider buffer."""
    return torch.stack([t, t], dim=1)[:, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_penalties_with_strided_and_expanded_per_row_tensors_equal_the_contiguous_ones(backend):
    logits, state, slots, presence, frequency, repetition, _ = random_case(4, 64, 5, seed=4)
    logits, state = logits.to(DEVICE), state.to(DEVICE)
    per_row = [t.to(DEVICE) for t in (slots, presence, frequency, repetition)]
    want = ops.reference.penalties.apply_penalties(logits, state, *per_row)
    got = apply_penalties_(logits.clone(), state, *[_every_other(t) for t in per_row], backend=backend)
    torch.testing.assert_close(got, want)
    one = [t[:1].clone().expand(4) for t in per_row[1:]]  # one row's penalties for the batch, stride 0
    want = ops.reference.penalties.apply_penalties(logits, state, per_row[0], *[t.contiguous() for t in one])
    torch.testing.assert_close(apply_penalties_(logits.clone(), state, per_row[0], *one, backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_bias_with_strided_or_expanded_entries_equals_the_contiguous_ones(backend):
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows, tokens = torch.tensor([0, 0, 1], device=DEVICE), torch.tensor([1, 2, 3], device=DEVICE)
    ban = torch.tensor([float("-inf")], device=DEVICE).expand(3)  # one value for every entry, stride 0
    want = ops.reference.penalties.apply_token_bias(logits, rows, tokens, ban.contiguous())
    got = apply_token_bias_(logits.clone(), _every_other(rows), _every_other(tokens), ban, backend=backend)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_bias_backends_equal_the_twin(backend):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g).to(DEVICE)
    entries = 700  # several per logit: they add up
    rows = torch.randint(0, 5, (entries,), generator=g).to(DEVICE)
    tokens = torch.randint(0, 40, (entries,), generator=g).to(DEVICE)
    bias = torch.randn(entries, generator=g).to(DEVICE)
    bias[::97] = float("-inf")
    got = apply_token_bias_(logits.clone(), rows, tokens, bias, backend=backend)
    want = ops.reference.penalties.apply_token_bias(logits, rows, tokens, bias)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-5)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert torch.equal(apply_token_bias_(logits.clone(), empty, empty, empty.float(), backend=backend), logits)


@pytest.mark.skipif(not backend_available("triton"), reason="needs triton")
def test_token_bias_on_bf16_logits_falls_back_to_the_twin_unless_triton_is_named():
    logits = torch.randn(2, 10, device=DEVICE).bfloat16()
    with ops.trace_backends() as calls:
        apply_token_bias_(logits, ids(0), ids(3), torch.ones(1, device=DEVICE))
    assert calls == [("apply_token_bias_", "torch")]
    with pytest.raises(BackendUnavailable, match="float32 logits"):
        apply_token_bias_(logits, ids(0), ids(3), torch.ones(1, device=DEVICE), backend="triton")


@pytest.mark.parametrize("change, match", [
    (dict(slots=torch.tensor([0, 5])), r"slots\[1\] = 5 is outside \[-1, 3\)"),
    (dict(slots=torch.tensor([0, 1], dtype=torch.int32)), "slots dtype"),
    (dict(token_state=torch.zeros(3, 9, dtype=torch.int32)), "token_state must have shape"),
    (dict(repetition=torch.ones(3)), "repetition_penalty must have shape"),
])
def test_bad_penalty_arguments_are_named(change, match):
    args = dict(logits=torch.randn(2, 10), token_state=torch.zeros(3, 10, dtype=torch.int32),
                slots=torch.tensor([0, -1]), presence=torch.zeros(2), frequency=torch.zeros(2),
                repetition=torch.ones(2)) | change
    with ops.debug_checks(), pytest.raises((ValueError, TypeError), match=match):
        apply_penalties_(*args.values(), backend="torch")


@pytest.mark.parametrize("change, match", [
    (dict(rows=torch.tensor([0, 2])), r"rows\[1\] = 2 is outside \[0, 2\)"),
    (dict(tokens=torch.tensor([0, 10])), r"token_ids\[1\] = 10 is outside \[0, 10\)"),
    (dict(bias=torch.ones(3)), "bias must have shape"),
])
def test_bad_bias_arguments_are_named(change, match):
    args = dict(logits=torch.randn(2, 10), rows=torch.tensor([0, 1]), tokens=torch.tensor([3, 4]),
                bias=torch.ones(2)) | change
    with ops.debug_checks(), pytest.raises((ValueError, TypeError), match=match):
        apply_token_bias_(*args.values(), backend="torch")


def test_custom_ops_pass_opcheck():
    logits, state, slots, presence, frequency, repetition, _ = random_case(3, 20, 4, seed=2)
    torch.library.opcheck(torch.ops.atom_core.apply_penalties_.default,
                          (logits, state, slots, presence, frequency, repetition, "torch"))
    torch.library.opcheck(torch.ops.atom_core.apply_token_bias_.default,
                          (logits, torch.tensor([0, 2]), torch.tensor([1, 5]), torch.tensor([0.5, -1.0]), "torch"))


# ---- nominal calls for tests/ops/test_dispatch_cache.py (``ARGS.update(PENALTIES_DISPATCH_ARGS)``) -------------------

def _penalties_dispatch_args(c):
    rows, vocab = c.vary(3, 1), c.vary(50, 16)
    logits = c.tensor(rows, vocab, dtype=c.vary(torch.float32, torch.bfloat16, torch.float16))
    state = c.tensor(4, vocab, dtype=torch.int32)
    return (logits, state, c.tensor(rows, dtype=torch.int64), c.tensor(rows), c.tensor(rows), c.tensor(rows))


def _token_bias_dispatch_args(c):
    rows, entries = c.vary(3, 1), c.vary(5, 1)
    logits = c.tensor(rows, c.vary(50, 16), dtype=c.vary(torch.float32, torch.bfloat16, torch.float16))
    return logits, c.tensor(entries, dtype=torch.int64), c.tensor(entries, dtype=torch.int64), c.tensor(entries)


PENALTIES_DISPATCH_ARGS = {"apply_penalties_": _penalties_dispatch_args, "apply_token_bias_": _token_bias_dispatch_args}
