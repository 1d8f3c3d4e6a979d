"""``Engine(logprobs_mode=...)`` (vLLM's four values) and ``--logprobs-mode``: raw log-probs unchanged by
default; raw logits the model's own; processed scores (penalties, temperature, top-k / top-p / min-p)
equal to HF-style processed scores computed here in plain torch from the engine's raw logits of the same
seeded request; greedy rows unscaled and unfiltered; filtered tokens at -inf behind every kept one; the
sampled token's processed value finite; prompt log-probs raw in every mode (fp32, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from atom_core.engine.logprobs import LOGPROBS_MODES
from tests.engine.test_engine_parity import prompts_for

MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@pytest.fixture(scope="module")
def setup(tiny_qwen3):
    folder, hf_model = tiny_qwen3
    vocab = hf_model.config.vocab_size
    return folder, hf_model, vocab, prompts_for(vocab, [7, 13, 4], seed=5)


def run(folder, mode, prompts, params, **engine_args):
    """The outputs (one RequestOutput per prompt) of an fp32 CPU engine in ``mode`` (None: the default)."""
    args = dict(device="cpu", dtype=torch.float32, block_size=4, max_logprobs=96) | engine_args
    if mode is not None:
        args["logprobs_mode"] = mode
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, **args)
        return engine.generate(prompts, params, use_tqdm=False)


def full(values: dict[int, float], vocab: int) -> torch.Tensor:
    """A top-N dict that covers the vocabulary as a float64 [V] vector (by token id)."""
    assert sorted(values) == list(range(vocab))
    return torch.tensor([values[v] for v in range(vocab)], dtype=torch.float64)


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """HF's logits [len(tokens), V] (float64) of the model over ``tokens``."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].double()


def hf_style_processed(raw: torch.Tensor, context: list[int], *, repetition_penalty=1.0, temperature=1.0, top_k=0,
                       top_p=1.0, min_p=0.0) -> torch.Tensor:
    """HF generate's processed scores [V] of one position, in plain torch: RepetitionPenaltyLogitsProcessor
    over ``context`` (prompt + output so far), then TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper and MinPLogitsWarper (filtered tokens -inf)."""
    x = raw.clone()
    seen = torch.tensor(sorted(set(context)), dtype=torch.int64)
    picked = x[seen]
    x[seen] = torch.where(picked < 0, picked * repetition_penalty, picked / repetition_penalty)
    x = x / temperature
    if top_k > 0:
        x = x.masked_fill(x < x.topk(top_k).values[-1], -math.inf)
    if top_p < 1.0:
        ascending, order = x.sort()
        remove = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[-1] = False  # the most likely token stays
        x = x.masked_fill(remove.scatter(0, order, remove), -math.inf)
    if min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.max(), -math.inf)
    return x


SAMPLED = dict(seed=11, temperature=0.7, top_k=12, top_p=0.8, repetition_penalty=1.3, max_tokens=10, ignore_eos=True)


def test_processed_logprobs_equal_log_softmax_of_hf_style_processed_raw_logits(setup):
    folder, _, vocab, prompts = setup
    params = SamplingParams(logprobs=vocab, **SAMPLED)
    raw = run(folder, "raw_logits", prompts[:2], params)
    processed = run(folder, "processed_logprobs", prompts[:2], params)
    num_filtered = 0
    for prompt, r, p in zip(prompts, raw, processed):
        r, p = r.outputs[0], p.outputs[0]
        assert p.token_ids == r.token_ids and len(p.top_logprobs) == params.max_tokens
        for k, token in enumerate(p.token_ids):
            raw_logits = full(r.top_logprobs[k], vocab)
            assert r.logprobs[k] == pytest.approx(float(raw_logits[token]), abs=1e-6)
            want = torch.log_softmax(hf_style_processed(
                raw_logits, prompt + p.token_ids[:k], repetition_penalty=1.3, temperature=0.7, top_k=12, top_p=0.8),
                dim=-1)
            got = full(p.top_logprobs[k], vocab)
            assert torch.equal(got.isfinite(), want.isfinite())  # the same tokens kept
            torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], atol=2e-5, rtol=2e-5)
            assert p.logprobs[k] == pytest.approx(float(want[token]), abs=2e-5)
            num_filtered += int((~want.isfinite()).sum())
    assert num_filtered > 0  # the filters did drop tokens: the -inf sets were compared


def test_processed_logits_are_the_scores_whose_log_softmax_is_processed_logprobs(setup):
    folder, _, vocab, prompts = setup
    params = SamplingParams(logprobs=vocab, **SAMPLED)
    logits = run(folder, "processed_logits", prompts[:2], params)
    logprobs = run(folder, "processed_logprobs", prompts[:2], params)
    for a, b in zip(logits, logprobs):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for k, token in enumerate(a.token_ids):
            scores = full(a.top_logprobs[k], vocab)
            assert a.logprobs[k] == scores[token]
            torch.testing.assert_close(torch.log_softmax(scores, -1), full(b.top_logprobs[k], vocab), atol=2e-5,
                                       rtol=2e-5)


def test_raw_logits_are_the_models_logits_and_raw_logprobs_their_log_softmax(setup):
    folder, hf_model, _, prompts = setup
    params = SamplingParams(seed=3, temperature=0.9, top_k=20, repetition_penalty=1.2, max_tokens=8, ignore_eos=True,
                            logprobs=4)
    logits_out = run(folder, "raw_logits", prompts, params)
    logprobs_out = run(folder, "raw_logprobs", prompts, params)
    for prompt, a, b in zip(prompts, logits_out, logprobs_out):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        want = hf_logits(hf_model, prompt + a.token_ids)[len(prompt) - 1:-1]  # position k predicts token k
        for k, token in enumerate(a.token_ids):
            top = want[k].topk(4)
            assert list(a.top_logprobs[k]) == list(b.top_logprobs[k]) == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(list(a.top_logprobs[k].values()), dtype=torch.float64),
                                       top.values, atol=1e-4, rtol=1e-4)
            assert a.logprobs[k] == pytest.approx(float(want[k, token]), abs=1e-4)
            assert b.logprobs[k] == pytest.approx(float(torch.log_softmax(want[k], -1)[token]), abs=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_holds_without_top_n_or_logits_processing(setup, mode):
    """logprobs=0 and nothing processing the logits: the step where raw_logprobs takes the sampler's fused
    log-probs; the other modes still return their own values (from HF's logits of the same tokens)."""
    folder, hf_model, _, prompts = setup
    params = SamplingParams(seed=8, temperature=0.6, top_k=5, max_tokens=6, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, run(folder, mode, prompts, params)):
        out = out.outputs[0]
        assert out.top_logprobs is None
        for k, logits in enumerate(hf_logits(hf_model, prompt + out.token_ids)[len(prompt) - 1:-1]):
            if mode.startswith("processed"):
                logits = hf_style_processed(logits, [], temperature=0.6, top_k=5)
            want = logits if mode.endswith("_logits") else torch.log_softmax(logits, -1)
            assert out.logprobs[k] == pytest.approx(float(want[out.token_ids[k]]), abs=1e-4)


def test_default_mode_is_raw_logprobs_with_unchanged_values_and_no_mode_changes_the_draw(setup):
    folder, hf_model, _, prompts = setup
    # logprobs=0 without processing takes the sampler's fused log-probs; the penalised request the eager path.
    for params in (SamplingParams(seed=9, temperature=0.8, max_tokens=8, ignore_eos=True, logprobs=0),
                   SamplingParams(logprobs=2, **SAMPLED)):
        default = run(folder, None, prompts, params)
        by_mode = {mode: run(folder, mode, prompts, params) for mode in MODES}
        for i, prompt in enumerate(prompts):
            out = default[i].outputs[0]
            assert out.logprobs == by_mode["raw_logprobs"][i].outputs[0].logprobs  # identical values
            assert out.top_logprobs == by_mode["raw_logprobs"][i].outputs[0].top_logprobs
            for mode in MODES:
                assert by_mode[mode][i].outputs[0].token_ids == out.token_ids
            want = torch.log_softmax(hf_logits(hf_model, prompt + out.token_ids)[len(prompt) - 1:-1], -1)
            torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64),
                                       want.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=1e-4,
                                       rtol=1e-4)
    with ops.use_backend("torch"):
        assert Engine.from_pretrained(folder, device="cpu", dtype=torch.float32).logprobs_mode == "raw_logprobs"


def test_greedy_rows_ignore_temperature_and_filters_next_to_sampled_rows(setup):
    folder, _, vocab, prompts = setup
    # One batch: greedy (T = 0, its top_k ignored), greedy (T below 1e-5, its top_p ignored), sampled.
    params = [SamplingParams(temperature=0, top_k=2, max_tokens=6, ignore_eos=True, logprobs=vocab),
              SamplingParams(temperature=1e-6, top_p=0.3, max_tokens=6, ignore_eos=True, logprobs=vocab),
              SamplingParams(seed=4, temperature=0.5, top_k=3, max_tokens=6, ignore_eos=True, logprobs=vocab)]
    raw = run(folder, "raw_logits", prompts, params)
    processed_logits = run(folder, "processed_logits", prompts, params)
    processed_logprobs = run(folder, "processed_logprobs", prompts, params)
    for i in range(3):
        r, pl, pp = raw[i].outputs[0], processed_logits[i].outputs[0], processed_logprobs[i].outputs[0]
        assert r.token_ids == pl.token_ids == pp.token_ids
        for k, token in enumerate(r.token_ids):
            raw_logits = full(r.top_logprobs[k], vocab)
            got_logits, got_logprobs = full(pl.top_logprobs[k], vocab), full(pp.top_logprobs[k], vocab)
            if i < 2:  # greedy: the raw logits as they are (no division, nothing filtered), and their argmax
                assert token == int(raw_logits.argmax())
                torch.testing.assert_close(got_logits, raw_logits, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(got_logprobs, torch.log_softmax(raw_logits, -1), atol=2e-5, rtol=2e-5)
            else:  # sampled: divided by 0.5, all but the 3 largest at -inf
                kept = raw_logits >= raw_logits.topk(3).values[-1]
                assert int(kept.sum()) == 3 and bool(kept[token])
                torch.testing.assert_close(got_logits[kept], raw_logits[kept] / 0.5, atol=1e-5, rtol=1e-5)
                assert bool((got_logits[~kept] == -math.inf).all()) and bool((got_logprobs[~kept] == -math.inf).all())


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.3)])
def test_filtered_tokens_are_minus_inf_and_never_before_a_kept_token_in_top_n(setup, filters):
    folder, _, vocab, prompts = setup
    num_top = 8
    raw = run(folder, "raw_logits", prompts, SamplingParams(seed=2, temperature=1.0, max_tokens=6, ignore_eos=True,
                                                            logprobs=vocab, **filters))
    out = run(folder, "processed_logprobs", prompts, SamplingParams(seed=2, temperature=1.0, max_tokens=6,
                                                                    ignore_eos=True, logprobs=num_top, **filters))
    seen_filtered_in_top = False
    for r, o in zip(raw, out):
        r, o = r.outputs[0], o.outputs[0]
        assert r.token_ids == o.token_ids
        for k, token in enumerate(o.token_ids):
            kept = hf_style_processed(full(r.top_logprobs[k], vocab), [], **filters).isfinite()
            top = o.top_logprobs[k]
            finite = [v for v, value in top.items() if math.isfinite(value)]
            # the kept tokens first (all of them, or the N best), then only filtered ones, at -inf
            assert finite == list(top)[:len(finite)]
            assert set(finite) == {v for v in list(top) if bool(kept[v])}
            assert len(finite) == min(num_top, int(kept.sum()))
            assert all(value == -math.inf for value in list(top.values())[len(finite):])
            assert math.isfinite(o.logprobs[k]) and bool(kept[token])
            seen_filtered_in_top |= len(finite) < num_top
    assert seen_filtered_in_top or filters == dict(top_p=0.6)  # top-k 3 and min-p 0.3 keep fewer than 8


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_the_sampled_tokens_processed_value_is_always_finite(setup, mode):
    folder, _, _, prompts = setup
    params = SamplingParams(n=6, seed=100, temperature=1.3, top_k=5, top_p=0.3, min_p=0.2, repetition_penalty=1.5,
                            presence_penalty=0.5, logit_bias={7: 4.0, 8: -100.0}, max_tokens=12, ignore_eos=True,
                            logprobs=1)
    outs = run(folder, mode, prompts, params)
    values = [lp for out in outs for seq in out.outputs for lp in seq.logprobs]
    assert len(values) == len(prompts) * 6 * 12
    assert all(math.isfinite(v) for v in values)
    if mode == "processed_logprobs":
        assert all(v <= 0 for v in values)


def test_processed_scores_carry_the_biases_and_the_min_tokens_ban(setup):
    folder, _, vocab, prompts = setup
    eos = 95
    params = SamplingParams(seed=6, temperature=2.0, min_tokens=3, logit_bias={5: 3.0}, max_tokens=5, ignore_eos=True,
                            logprobs=vocab)
    raw = run(folder, "raw_logits", prompts[:1], params)[0].outputs[0]
    processed = run(folder, "processed_logits", prompts[:1], params)[0].outputs[0]
    assert raw.token_ids == processed.token_ids
    for k in range(5):
        r, p = full(raw.top_logprobs[k], vocab), full(processed.top_logprobs[k], vocab)
        assert math.isfinite(r[eos])
        assert (p[eos] == -math.inf) == (k < 3)  # EOS banned while the output is shorter than min_tokens
        assert float(p[5]) == pytest.approx((float(r[5]) + 3.0) / 2.0, abs=1e-5)
        others = torch.ones(vocab, dtype=torch.bool)
        others[[5, eos]] = False
        torch.testing.assert_close(p[others], r[others] / 2.0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_prompt_logprobs_are_of_the_raw_logits_in_every_mode(setup, mode):
    folder, hf_model, _, prompts = setup
    prompt = prompts[1]
    params = SamplingParams(seed=1, temperature=0.5, top_k=2, repetition_penalty=1.5, max_tokens=2, prompt_logprobs=3)
    out = run(folder, mode, [prompt], params)[0]
    logits = hf_logits(hf_model, prompt)[:-1]  # position p predicts prompt token p + 1
    want = logits if mode.endswith("_logits") else torch.log_softmax(logits, -1)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    targets = torch.tensor(prompt[1:])
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:], dtype=torch.float64),
                               want.gather(1, targets[:, None])[:, 0], atol=1e-4, rtol=1e-4)
    top = want.topk(3)
    assert [list(d) for d in out.prompt_top_logprobs[1:]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([list(d.values()) for d in out.prompt_top_logprobs[1:]],
                                            dtype=torch.float64), top.values, atol=1e-4, rtol=1e-4)


def test_an_unknown_logprobs_mode_is_refused_naming_the_four(setup):
    folder = setup[0]
    allowed = "raw_logprobs, raw_logits, processed_logprobs, processed_logits"
    assert LOGPROBS_MODES == MODES
    for bad in ("processed", "RAW_LOGPROBS", None):
        with pytest.raises(ValueError, match=allowed):
            Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, logprobs_mode=bad)
    from atom_core.engine import DataParallelEngine

    with pytest.raises(ValueError, match=allowed):  # in the front, before any replica starts
        DataParallelEngine(folder, data_parallel_size=2, device="cpu", logprobs_mode="logits")


# ---- on a GPU: the processed path after a CUDA graph's logits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode, num_top", [("processed_logprobs", 5), ("raw_logits", 5), ("raw_logprobs", 0)])
def test_cuda_graphs_on_and_off_give_the_same_values_and_ranks(setup, mode, num_top):
    """(raw_logprobs without top-N: the log-probs fused into the draw, the ranks counted beside it)"""
    folder, _, vocab, prompts = setup
    params = SamplingParams(logprobs=num_top, **SAMPLED)
    outs = {}
    for eager in (True, False):
        engine = Engine.from_pretrained(folder, device="cuda", dtype=torch.float32, max_num_seqs=16, num_kv_blocks=256,
                                        enforce_eager=eager, logprobs_mode=mode)
        assert (engine.runner.graphs is None) == eager
        outs[eager] = [o.outputs[0] for o in engine.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
        assert a.logprob_ranks == b.logprob_ranks and all(r >= 1 for r in b.logprob_ranks)
        assert (a.top_logprobs is None) == (num_top == 0)
        assert [list(d) for d in a.top_logprobs or ()] == [list(d) for d in b.top_logprobs or ()]
        if mode.startswith("processed"):
            assert all(math.isfinite(v) for v in b.logprobs)


def test_logprobs_minus_one_gives_every_token_under_max_logprobs_minus_one(setup):
    """vLLM's -1: ``Engine(max_logprobs=-1)`` has no limit (it reads as the vocabulary size) and
    ``logprobs=-1`` / ``prompt_logprobs=-1`` return the whole vocabulary's log-probs, HF's log_softmax."""
    folder, hf_model, vocab, prompts = setup
    params = SamplingParams(seed=2, temperature=0.8, max_tokens=3, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4, max_logprobs=-1)
        assert engine.max_logprobs == vocab
        out = engine.generate(prompts[:1], params, use_tqdm=False)[0]
    prompt, seq = prompts[0], out.outputs[0]
    want = torch.log_softmax(hf_logits(hf_model, prompt + seq.token_ids), -1)
    for k in range(len(seq.token_ids)):
        torch.testing.assert_close(full(seq.top_logprobs[k], vocab), want[len(prompt) - 1 + k], atol=1e-4, rtol=1e-4)
    for k in range(1, len(prompt)):
        torch.testing.assert_close(full(out.prompt_top_logprobs[k], vocab), want[k - 1], atol=1e-4, rtol=1e-4)
