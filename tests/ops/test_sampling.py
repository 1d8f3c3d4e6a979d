"""Sampling ops: filters against a naive per-row definition, statistical draws, per-row seeding,
log-probs, greedy speculative acceptance, the AITER argument mapping, validation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_core.ops.dispatch import BackendUnavailable, backend_available
from atom_core.ops.reference import sampling as reference
from atom_core.ops.sampling import rejection_sample_greedy, sample
from atom_core.ops.tolerances import ATTENTION, tolerance
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, ON_GPU, ROWS, needs_gpu, needs_triton, non_contiguous_rows

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
# Log-probs are log-sum-exps over a whole row, computed in fp32 from any logits dtype.
LOGPROB_TOL = tolerance(torch.float32, ATTENTION)


def draws_per_config(backend: str) -> int:
    # The CPU interpreter pays per op, so it draws fewer; the cosine bound holds for both (see below).
    return 20_000 if backend == "torch" or ON_GPU else 4_096


def rows_of(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def params(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234, offsets=None):
    """Per-row parameter tensors, every row alike unless given per row."""
    def full(v, dtype):
        return torch.as_tensor(v, dtype=dtype, device=DEVICE).expand(rows).clone()
    offsets = torch.arange(rows) if offsets is None else offsets
    return (full(temperature, torch.float32), full(top_k, torch.int32), full(top_p, torch.float32),
            full(min_p, torch.float32), full(seed, torch.int64), torch.as_tensor(offsets, device=DEVICE).long())


def naive_filtered_probs(row: list[float], temperature: float, top_k: int, top_p: float, min_p: float):
    """The filtered, renormalised distribution of one row, by the definitions, in float64 Python."""
    vocab = len(row)
    scaled = [x / temperature for x in row]
    top = max(scaled)
    weights = [math.exp(s - top) for s in scaled]
    weight_sum = math.fsum(weights)
    probs = [w / weight_sum for w in weights]
    kept = sorted(range(vocab), key=lambda v: -row[v])
    if 0 < top_k < vocab:  # the k largest and every token tied with the k-th
        kept = [v for v in kept if row[v] >= row[kept[top_k - 1]]]
    if top_p < 1.0:  # smallest prefix whose mass (renormalised over all top-k kept) reaches top_p
        mass = sum(probs[v] for v in kept)
        prefix, acc = [], 0.0
        for v in kept:
            prefix.append(v)
            acc += probs[v] / mass
            if acc >= top_p:
                break
        kept = prefix
    if min_p > 0.0:
        floor = min_p * max(probs)
        kept = [v for v in kept if probs[v] >= floor]
    total = sum(probs[v] for v in kept)
    kept = set(kept)
    return [probs[v] / total if v in kept else 0.0 for v in range(vocab)]


def kept_by_cutoff(logits, temperature, top_k, top_p, min_p):
    cutoff = reference.filter_cutoff(logits, temperature, top_k, top_p, min_p)
    return [set(torch.nonzero(r >= c).flatten().tolist()) for r, c in zip(logits.float(), cutoff)]


# --- filters -------------------------------------------------------------------------------------

def test_filter_anchors():
    # probs 0.5, 0.3, 0.15, 0.05 at T = 1.
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]] * 7)
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0])
    top_k = torch.tensor([3, 0, 2, 0, 0, 0, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.7, 0.6, 1.0, 1.0, 0.7, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.7, 0.0, 1.0])
    assert kept_by_cutoff(logits, temperature, top_k, top_p, min_p) == [
        {0, 1, 2},  # top-k 3
        {0, 1},     # top-p 0.7: mass before token 1 is 0.5 < 0.7, before token 2 is 0.8
        {0},        # top-k 2 renormalises to 0.625, 0.375; top-p 0.6: mass before token 1 is 0.625
                    # (without renormalising it would be 0.5 < 0.6 and keep token 1)
        {0, 1},     # min-p 0.5: p >= 0.25
        {0},        # min-p 0.7: p >= 0.35
        {0, 1, 2},  # T = 2: probs ~ sqrt(p) / 1.8657 = 0.379, 0.294, 0.208, 0.120; mass before token 2
                    # is 0.673 < 0.7, before token 3 is 0.880
        {0},        # min-p 1: only the top token
    ]
    assert reference.filter_cutoff(logits, temperature, None, None, None) is None


def test_filter_keeps_ties_at_the_cutoff():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert kept_by_cutoff(logits, torch.ones(1), torch.tensor([2]), None, None) == [{0, 2, 3}]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), vocab=st.sampled_from([1, 2, 7, 50]),
       temperature=st.sampled_from([0.5, 1.0, 1.7]), top_k=st.sampled_from([-1, 0, 1, 3, 49, 50, 80]),
       top_p=st.sampled_from([0.2, 0.55, 0.9, 1.0]), min_p=st.sampled_from([0.0, 0.03, 0.3]))
def test_filter_cutoff_matches_naive_definition(seed, vocab, temperature, top_k, top_p, min_p):
    logits = 2 * torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed))
    p = [torch.full((3,), v, dtype=d) for v, d in
         ((temperature, torch.float32), (top_k, torch.int32), (top_p, torch.float32), (min_p, torch.float32))]
    got = kept_by_cutoff(logits, *p)
    for row, kept in zip(logits.tolist(), got):
        want = naive_filtered_probs(row, temperature, top_k, top_p, min_p)
        assert kept == {v for v, q in enumerate(want) if q > 0}


# --- draws -----------------------------------------------------------------------------------------

FILTER_CONFIGS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.8, 10, 0.9, 0.05),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_draws_follow_the_filtered_distribution(backend):
    """Masked tokens are never drawn; frequencies over N draws (one seed, offsets 0..N-1) match the
    naive filtered distribution. With N >= 4096 and these rows (sum p^2 >= 0.1) the expected
    1 - cosine is about (1 - sum p^2) / (2 N sum p^2) < 0.002, far inside the 0.01 margin."""
    n = draws_per_config(backend)
    vocab = 37
    row = (1.5 * torch.randn(vocab, generator=torch.Generator().manual_seed(7))).tolist()
    logits = rows_of(row).expand(n * len(FILTER_CONFIGS), vocab)
    columns = list(zip(*[params(n, *config) for config in FILTER_CONFIGS]))
    tokens = sample(logits, *[torch.cat(c) for c in columns], backend=backend).view(len(FILTER_CONFIGS), n)
    for config, drawn in zip(FILTER_CONFIGS, tokens.cpu()):
        want = torch.tensor(naive_filtered_probs(row, *config), dtype=torch.float64)
        freq = torch.bincount(drawn, minlength=vocab).double() / n
        assert set(drawn.tolist()) <= set(torch.nonzero(want).flatten().tolist()), config
        assert torch.nn.functional.cosine_similarity(freq, want, dim=0) > 0.99, config


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 9000])
def test_greedy_is_argmax_lowest_index_on_ties(backend, dtype, vocab):
    logits = torch.randn(19, vocab, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    logits[0, [5, 17, vocab - 100]] = 50.0  # a three-way tie for the max (in different blocks at V = 9000)
    t, k, p, m, s, o = params(19, temperature=0.0, top_k=3, top_p=0.5)
    tokens = sample(logits, t, k, p, m, s, o, backend=backend)
    assert tokens[0].item() == 5
    assert torch.equal(tokens, logits.float().argmax(-1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_rows_mixed_with_sampled_rows(backend):
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    temperature = rows_of(0.0, 1.0, 0.0, 0.5, 0.0, 2.0, 0.0, 1.0)
    _, k, p, m, s, o = params(8, top_k=20)
    tokens = sample(logits, temperature, k, p, m, s, o, backend=backend)
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    allowed = logits.topk(20, dim=-1).indices
    assert bool((allowed == tokens[:, None]).any(-1).all())


def mixed_batch(rows=16, vocab=1000, dtype=torch.float32):
    g = torch.Generator().manual_seed(11)
    logits = (2 * torch.randn(rows, vocab, generator=g)).to(DEVICE, dtype)
    temperature = torch.rand(rows, generator=g).to(DEVICE) + 0.3
    temperature[::5] = 0.0
    top_k = torch.randint(-1, 60, (rows,), generator=g, dtype=torch.int32).to(DEVICE)
    top_p = torch.rand(rows, generator=g).to(DEVICE) * 0.5 + 0.5
    min_p = torch.rand(rows, generator=g).to(DEVICE) * 0.1
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=g).to(DEVICE)
    offsets = torch.randint(0, 2**40, (rows,), generator=g).to(DEVICE)
    return logits, temperature, top_k, top_p, min_p, seeds, offsets


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rows_draw_ignores_its_batch_mates_and_position(backend):
    args = mixed_batch()
    tokens, logprobs = sample(*args, return_logprobs=True, backend=backend)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    permuted = sample(*[a[perm] for a in args], backend=backend)
    assert torch.equal(permuted, tokens[perm])
    alone = torch.cat([sample(*[a[i:i + 1] for a in args], backend=backend) for i in (0, 3, 7)])
    assert torch.equal(alone, tokens[[0, 3, 7]])
    # Strided rows read the same values, so they draw the same tokens.
    strided = sample(non_contiguous_rows(args[0]), *args[1:], backend=backend)
    assert torch.equal(strided, tokens)


def _every_other(t):
    """The same values as the 1-D ``t``, each second element of a wider buffer."""
    return torch.stack([t, t], dim=1)[:, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_expanded_per_row_parameters_draw_as_their_contiguous_copies(backend):
    logits, temperature, top_k, top_p, min_p, seeds, offsets = mixed_batch()
    want = sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, backend=backend)
    views = [_every_other(t) for t in (temperature, top_k, top_p, min_p, seeds, offsets)]
    assert torch.equal(sample(logits, *views, backend=backend), want)
    one_seed = seeds[:1].expand(seeds.shape[0])  # stride 0: one seed for the batch
    assert torch.equal(sample(logits, temperature, top_k, top_p, min_p, one_seed, offsets, backend=backend),
                       sample(logits, temperature, top_k, top_p, min_p, one_seed.contiguous(), offsets,
                              backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_and_seeds_change_the_draw(backend):
    rows, vocab = 64, 1000
    logits = torch.zeros(rows, vocab, device=DEVICE)  # uniform: 64 draws hit ~62 distinct tokens
    t, k, p, m, s, _ = params(rows, seed=2**40 + 3)
    same_seed = sample(logits, t, k, p, m, s, torch.arange(rows, device=DEVICE), backend=backend)
    same_offset = sample(logits, t, k, p, m, s + torch.arange(rows, device=DEVICE) * 2**32,
                         torch.full((rows,), 9, device=DEVICE), backend=backend)  # seeds differ in the high word
    high_offsets = sample(logits, t, k, p, m, s, 9 + torch.arange(rows, device=DEVICE) * 2**32, backend=backend)
    for draws in (same_seed, same_offset, high_offsets):
        assert len(set(draws.tolist())) >= 55
    again = sample(logits, t, k, p, m, s, torch.arange(rows, device=DEVICE), backend=backend)
    assert torch.equal(again, same_seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [1, 1000, 32003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_log_softmax_of_raw_logits(backend, vocab, dtype):
    logits, temperature, top_k, top_p, min_p, seeds, offsets = mixed_batch(rows=5, vocab=vocab, dtype=dtype)
    tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, return_logprobs=True,
                              backend=backend)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert bool(((tokens >= 0) & (tokens < vocab)).all())
    want = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), want, **LOGPROB_TOL)


@needs_triton
def test_triton_split_rows_draw_the_same_tokens():
    from atom_core.ops.triton import sampling as triton_sampling

    logits, temperature, top_k, top_p, min_p, seeds, offsets = mixed_batch(rows=6, vocab=9000)
    results = []
    for splits in (1, 3):
        tokens = torch.empty(6, dtype=torch.int64, device=DEVICE)
        logprobs = torch.empty(6, device=DEVICE)
        triton_sampling.sample(logits, temperature, None, None, min_p, seeds, offsets, tokens, logprobs,
                               num_splits=splits)
        results.append((tokens, logprobs))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], **LOGPROB_TOL)


QWEN3_VOCAB = 151936


@needs_gpu
@pytest.mark.parametrize("rows", ROWS)
def test_gpu_qwen_vocab_matches_argmax_and_log_softmax(rows):
    logits, temperature, top_k, top_p, min_p, seeds, offsets = mixed_batch(rows=rows, vocab=QWEN3_VOCAB)
    tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, return_logprobs=True,
                              backend="triton")
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    want = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), want, **LOGPROB_TOL)
    # One row alone runs split over many programs; in a big batch it runs in one or two.
    big = [a.repeat(max(1, 256 // rows), *([1] * (a.dim() - 1))) for a in (logits, temperature, top_k, top_p,
                                                                          min_p, seeds, offsets)]
    assert torch.equal(sample(*big, backend="triton")[:rows], tokens)
    assert sample(*[a[:1] for a in big], backend="triton").item() == tokens[0].item()


@needs_gpu
def test_gpu_top_k_top_p_draws_at_qwen_vocab():
    n, config = 4096, (0.8, 50, 0.9, 0.0)
    row = (1.5 * torch.randn(QWEN3_VOCAB, generator=torch.Generator().manual_seed(8))).tolist()
    tokens = sample(rows_of(row).expand(n, QWEN3_VOCAB), *params(n, *config), backend="triton").cpu()
    want = torch.tensor(naive_filtered_probs(row, *config), dtype=torch.float64)
    freq = torch.bincount(tokens, minlength=QWEN3_VOCAB).double() / n
    assert set(tokens.tolist()) <= set(torch.nonzero(want).flatten().tolist())
    assert torch.nn.functional.cosine_similarity(freq, want, dim=0) > 0.99


@needs_gpu
def test_gpu_cuda_graph_replay_draws_like_eager():
    args = mixed_batch(rows=8, vocab=QWEN3_VOCAB)
    want = sample(*args, return_logprobs=True, backend="triton")
    sample(*args, return_logprobs=True, backend="triton")  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = sample(*args, return_logprobs=True, backend="triton")
    graph.replay()
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    args[6].add_(1)  # the next step's offsets, written into the captured input buffer
    graph.replay()
    assert torch.equal(got[0], sample(*args, backend="triton"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    tokens, logprobs = sample(torch.empty(0, 10, device=DEVICE), *params(0), return_logprobs=True, backend=backend)
    assert tokens.shape == (0,) and logprobs.shape == (0,)


def test_transposed_logits_fall_back_to_torch_unless_triton_named():
    logits = torch.randn(50, 4, device=DEVICE).t()
    tokens = sample(logits, *params(4, temperature=0.0))
    assert torch.equal(tokens, logits.argmax(-1))
    if backend_available("triton"):
        with pytest.raises(BackendUnavailable, match="last dim contiguous"):
            sample(logits, *params(4), backend="triton")


def test_compiles_in_one_graph():
    def fn(logits, temperature, seeds, offsets):
        return sample(logits, temperature, None, None, None, seeds, offsets, return_logprobs=True, backend="torch")

    logits = torch.randn(4, 100)
    t, _, _, _, s, o = (a.cpu() for a in params(4))
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(logits, t, s, o), fn(logits, t, s, o)):
        torch.testing.assert_close(got, want)


def test_custom_ops_pass_opcheck():
    t, _, p, _, s, o = (a.cpu() for a in params(4, temperature=0.5, top_p=0.9))
    outputs = (torch.empty(4, dtype=torch.int64), torch.empty(4))
    torch.library.opcheck(torch.ops.atom_core.sample.default,
                          (torch.randn(4, 100), t, None, p, None, s, o, *outputs, "torch"))
    outputs = (torch.empty(2, 3, dtype=torch.int64), torch.empty(2, dtype=torch.int32))
    torch.library.opcheck(torch.ops.atom_core.rejection_sample_greedy.default,
                          (torch.tensor([[1, 2], [3, 4]]), torch.randn(6, 10), *outputs, "torch"))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(logits=torch.randn(4)), "logits must have 2 dims"),
        (dict(logits=torch.randn(4, 10).int()), "logits dtype"),
        (dict(logits=torch.randn(4, 0)), "vocab size 0"),
        (dict(temperature=torch.ones(3)), "temperature must have shape"),
        (dict(temperature=torch.ones(4, dtype=torch.float64)), "temperature dtype"),
        (dict(top_k=torch.ones(4)), "top_k dtype"),
        (dict(top_p=torch.ones(5)), "top_p must have shape"),
        (dict(min_p=[0.0] * 4), "min_p must be a torch.Tensor"),
        (dict(seeds=torch.ones(4, dtype=torch.int32)), "seeds dtype"),
        (dict(offsets=torch.ones(4, 1, dtype=torch.int64)), "offsets must have 1 dims"),
        (dict(temperature=torch.tensor([1.0, -1.0, 1.0, 1.0])), r"temperature\[1\] = -1.0 must be >= 0"),
        (dict(temperature=torch.tensor([1.0, 1.0, float("nan"), 1.0])), r"temperature\[2\] = nan must be >= 0"),
        (dict(top_p=torch.tensor([0.0, 1.0, 1.0, 1.0])), r"top_p\[0\] = 0.0 must be in"),
        (dict(min_p=torch.tensor([0.0, 1.5, 0.0, 0.0])), r"min_p\[1\] = 1.5 must be in"),
    ],
)
def test_bad_sample_arguments_are_named(change, match):
    names = ("temperature", "top_k", "top_p", "min_p", "seeds", "offsets")
    args = dict(logits=torch.randn(4, 10), **dict(zip(names, (a.cpu() for a in params(4)))))
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        sample(**args)


# --- greedy speculative acceptance ----------------------------------------------------------------

def one_hot_logits(target_tokens: list[list[int]], vocab=10):
    """Target logits whose argmax at row r, position j is target_tokens[r][j]."""
    flat = [t for row in target_tokens for t in row]
    logits = torch.randn(len(flat), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(flat)), flat] = 10.0
    return logits.to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejection_anchors(backend):
    draft = torch.tensor([[1, 2, 3], [1, 5, 3], [7, 2, 3]], device=DEVICE)
    target = one_hot_logits([[1, 2, 3, 4], [1, 2, 9, 9], [6, 2, 3, 4]])
    out, num_accepted = rejection_sample_greedy(draft, target, backend=backend)
    assert out.tolist() == [[1, 2, 3, 4],     # all 3 drafts match: bonus token 4 appended
                            [1, 2, -1, -1],   # draft 5 != target 2: replaced, rest padded
                            [6, -1, -1, -1]]  # first draft rejected
    assert num_accepted.tolist() == [3, 1, 0] and num_accepted.dtype == torch.int32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows, k, vocab", [(1, 0, 7), (19, 4, 1000), (5, 2, 9000)])
def test_rejection_matches_naive_loop(backend, rows, k, vocab):
    g = torch.Generator().manual_seed(rows * 10 + k)
    target = torch.randn(rows * (k + 1), vocab, generator=g).to(DEVICE, torch.bfloat16)
    argmax = target.float().argmax(-1).view(rows, k + 1).tolist()
    # Drafts agree with the target for a random prefix length, then differ.
    draft = [[argmax[r][j] if j < r % (k + 1) else (argmax[r][j] + 1) % vocab for j in range(k)] for r in range(rows)]
    out, num_accepted = rejection_sample_greedy(torch.tensor(draft, dtype=torch.int64, device=DEVICE).view(rows, k),
                                                target, backend=backend)
    for r in range(rows):
        n = 0
        while n < k and draft[r][n] == argmax[r][n]:
            n += 1
        assert num_accepted[r].item() == n
        assert out[r].tolist() == argmax[r][:n + 1] + [-1] * (k - n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_column_major_drafts_are_accepted_as_their_contiguous_copy(backend):
    target = torch.randn(3 * 3, 50, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    draft = target.argmax(-1).view(3, 3)[:, :2]
    column_major = draft.t().contiguous().t()
    assert column_major.stride() == (1, 3)
    out, num_accepted = rejection_sample_greedy(column_major, target, backend=backend)
    assert num_accepted.tolist() == [2, 2, 2] and torch.equal(out, target.argmax(-1).view(3, 3))


@needs_triton
def test_triton_rejection_split_rows():
    from atom_core.ops.triton import sampling as triton_sampling

    target = torch.randn(3 * 3, 9000, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    draft = target.argmax(-1).view(3, 3)[:, :2].contiguous()
    out, num_accepted = torch.empty(3, 3, dtype=torch.int64, device=DEVICE), torch.empty(3, dtype=torch.int32,
                                                                                         device=DEVICE)
    triton_sampling.rejection_sample_greedy(draft, target, out, num_accepted, num_splits=3)
    assert torch.equal(out, target.argmax(-1).view(3, 3)) and num_accepted.tolist() == [2, 2, 2]


@pytest.mark.parametrize(
    "draft, target, match",
    [
        (torch.ones(2, 3, dtype=torch.int32), torch.randn(8, 5), "draft_token_ids dtype"),
        (torch.ones(2, 3, dtype=torch.int64), torch.randn(7, 5), "target_logits must have shape"),
        (torch.ones(6, dtype=torch.int64), torch.randn(8, 5), "draft_token_ids must have 2 dims"),
        (torch.ones(2, 3, dtype=torch.int64), torch.randn(8, 5).long(), "target_logits dtype"),
        (torch.ones(2, 3, dtype=torch.int64), torch.randn(8, 5).index_put_((torch.tensor(6), torch.tensor(2)),
                                                                          torch.tensor(float("nan"))),
         r"target_logits\[6, 2\] is NaN"),
    ],
)
def test_bad_rejection_arguments_are_named(draft, target, match):
    with pytest.raises((ValueError, TypeError), match=match):
        rejection_sample_greedy(draft, target)


# --- AITER adapter ----------------------------------------------------------------------------------

def _aiter_mixed_sample(out, input, exponentials, temperatures, eps):
    """AITER's documented semantics: argmax softmax(input / T) / (exponentials + eps); argmax where T == 0."""
    x = input.double()
    t = torch.where(temperatures > 0, temperatures, 1.0).double()[:, None]
    drawn = (torch.softmax(x / t, dim=-1) / (exponentials.double() + eps)).argmax(-1)
    out.copy_(torch.where(temperatures == 0, x.argmax(-1), drawn))


def _aiter_greedy_sample(out, input):
    out.copy_(input.argmax(-1))


def test_aiter_adapter_argument_mapping(monkeypatch):
    fake = fake_aiter.install(monkeypatch, {"mixed_sample_outer_exponential": _aiter_mixed_sample,
                                            "greedy_sample": _aiter_greedy_sample})
    from atom_core.ops.aiter import sampling as aiter_sampling

    args = [a.cpu() for a in mixed_batch(rows=8, vocab=100)]
    tokens, logprobs = torch.empty(8, dtype=torch.int64), torch.empty(8)
    aiter_sampling.sample(*args, tokens, logprobs)
    # Same noise function as the twin, so the same draws.
    want_tokens, want_logprobs = reference.sample(*args, return_logprobs=True)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs)
    name, call = fake.calls[0]
    assert name == "mixed_sample_outer_exponential"
    assert call["out"].dtype == torch.int32 and call["exponentials"].shape == (8, 100)
    assert call["exponentials"].dtype == torch.float32 and call["temperatures"].dtype == torch.float32
    assert call["eps"] == 0.0
    filtered = call["input"]  # -inf outside each row's cut-off
    assert torch.equal(torch.isfinite(filtered), args[0] >= reference.filter_cutoff(*args[:5])[:, None])

    draft = torch.tensor([[1, 2], [3, 4]])
    target = one_hot_logits([[1, 2, 5], [3, 0, 0]]).cpu()
    out, num_accepted = torch.empty(2, 3, dtype=torch.int64), torch.empty(2, dtype=torch.int32)
    aiter_sampling.rejection_sample_greedy(draft, target, out, num_accepted)
    assert out.tolist() == [[1, 2, 5], [3, 0, -1]] and num_accepted.tolist() == [2, 1]
    assert fake.calls[1][0] == "greedy_sample" and fake.calls[1][1]["out"].dtype == torch.int32
