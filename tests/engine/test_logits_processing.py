"""Penalties, biases, bans, top-N and prompt log-probs and ``n`` through the engine, against HF
transformers' logits processors on the same model (fp32, CPU, greedy), with async scheduling on and
off and with preemptions (the token state rebuilt on re-admission)."""

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor, SuppressTokensLogitsProcessor)

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from tests.engine.conftest import hf_greedy
from tests.engine.test_engine_parity import prompts_for

REGIMES = {
    "async": dict(block_size=4),
    "sync": dict(block_size=4, async_scheduling=False),
    "preemption": dict(block_size=2, num_kv_blocks=24, max_model_len=48),
}
MAX_TOKENS = 12


def hf_processed_greedy(hf_model, prompt, process, stop_ids=(), max_tokens=MAX_TOKENS):
    """Greedy tokens of HF's model with ``process(prompt, output, logits [1, V]) -> logits`` applied each step."""
    output = []
    while len(output) < max_tokens:
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + output])).logits[:, -1].float()
        token = int(process(prompt, output, logits).argmax())
        output.append(token)
        if token in stop_ids:
            break
    return output


def engine_run(folder, regime, prompts, params):
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, **REGIMES[regime])
        outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return engine, outs


@pytest.fixture(scope="module")
def setup(tiny_qwen3):
    folder, hf_model = tiny_qwen3
    prompts = prompts_for(hf_model.config.vocab_size, [7, 13, 20, 3], seed=21)
    greedy = [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    return folder, hf_model, prompts, greedy


def penalties_case(hf_model, greedy):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.4)

    def process(prompt, output, logits):
        logits = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits)
        for v in set(output):  # vLLM's presence / frequency: output tokens only
            logits[0, v] -= 0.4 * output.count(v) + 0.5
        return logits

    return params, process, ()


def bias_case(hf_model, greedy):
    vocab = hf_model.config.vocab_size
    allowed = [v for v in range(vocab) if v % 3 != 1] + [g for g in greedy[0][:3]]
    bias = {greedy[1][2]: -4.0, 10: 6.0, 11: 3.5}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=bias,
                            allowed_token_ids=allowed)
    suppress = SuppressTokensLogitsProcessor([v for v in range(vocab) if v not in allowed])
    sequence_bias = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])

    def process(prompt, output, logits):
        ids = torch.tensor([prompt + output])
        return sequence_bias(ids, suppress(ids, logits))

    return params, process, ()


def bad_words_case(hf_model, greedy):
    words = [[greedy[0][2], greedy[0][3]], [greedy[1][5]], greedy[2][4:7], [greedy[3][0], greedy[3][1]]]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=words)

    def process(prompt, output, logits):
        # vLLM's rule, written out: a word's last token is banned where the output (not the prompt) ends with
        # the word's other tokens. (transformers' NoBadWordsLogitsProcessor is not the reference: 5.17's bans
        # nothing where the ids it is given are exactly the word's other tokens, as after a one-token output.)
        for word in words:
            before = word[:-1]
            if len(before) <= len(output) and output[len(output) - len(before):] == before:
                logits[0, word[-1]] = float("-inf")
        return logits

    return params, process, ()


def min_tokens_case(hf_model, greedy):
    stop_ids = [greedy[0][1], greedy[1][2], greedy[2][3], greedy[3][1]]
    eos = hf_model.config.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=5, stop_token_ids=stop_ids)

    def process(prompt, output, logits):
        return MinNewTokensLengthLogitsProcessor(len(prompt), 5, [eos] + stop_ids)(torch.tensor([prompt + output]),
                                                                                   logits)

    return params, process, tuple(stop_ids) + (eos,)


CASES = {"penalties": penalties_case, "bias_and_allow_list": bias_case, "bad_words": bad_words_case,
         "min_tokens": min_tokens_case}


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_logits_processing_equals_hf_processors(setup, case, regime):
    folder, hf_model, prompts, greedy = setup
    params, process, stop_ids = CASES[case](hf_model, greedy)
    want = [hf_processed_greedy(hf_model, p, process, stop_ids) for p in prompts]
    assert want != greedy  # the processing changes the output
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # The plain request first: the newest are preempted first, and those are the processed ones.
    engine, outs = engine_run(folder, regime, prompts[:1] + prompts, [plain] + [params] * 4)
    outs = outs[1:] + outs[:1]
    assert [o.token_ids for o in outs[:4]] == want
    assert outs[4].token_ids == greedy[0]  # a batch mate without processing is untouched
    if regime == "preemption":
        assert engine.num_preemptions > 0
    if case == "min_tokens":
        assert all(len(o.token_ids) > 5 or o.finish_reason == "length" for o in outs[:4])
        assert any(o.finish_reason == "stop" for o in outs[:4])


def test_plain_requests_build_no_processing_and_no_token_state(setup):
    folder, _, prompts, _ = setup
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
        engine.add_request(prompts[0], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4))
        step = engine.scheduler.schedule()
        assert step.sampling.processing is None and step.num_top_logprobs == 0 and step.prompt_logprobs is None
        engine.scheduler.finish(step.requests[0], "abort")
        engine.generate(prompts[:2], SamplingParams(max_tokens=4, logprobs=0), use_tqdm=False)
    assert engine.runner.token_state is None


def hf_logprobs(hf_model, tokens):
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0].float(), -1)


@pytest.mark.parametrize("penalised", [False, True])
def test_top_logprobs_are_the_raw_models_and_equal_hf(setup, penalised):
    folder, hf_model, prompts, _ = setup
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                            repetition_penalty=1.5 if penalised else 1.0)
    _, outs = engine_run(folder, "async", prompts[:2], params)
    for prompt, out in zip(prompts, outs):
        lp = hf_logprobs(hf_model, prompt + out.token_ids)[len(prompt) - 1:-1]
        top = lp.topk(3)
        assert len(out.top_logprobs) == 6
        for k, (token, chosen, alternatives) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
            assert list(alternatives) == top.indices[k].tolist()  # most likely first
            torch.testing.assert_close(torch.tensor(list(alternatives.values())), top.values[k], atol=1e-4, rtol=1e-4)
            assert abs(chosen - float(lp[k, token])) < 1e-4


@pytest.mark.parametrize("regime", ["async", "chunked_prefill_after_a_cache_fill"])
def test_prompt_logprobs_equal_hf_and_skip_the_prefix_cache(setup, regime):
    folder, hf_model, prompts, _ = setup
    prompt = prompts[2]  # 20 tokens
    with ops.use_backend("torch"):
        args = dict(block_size=4) if regime == "async" else dict(block_size=4, max_num_batched_tokens=6)
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, **args)
        if regime != "async":
            engine.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # its blocks are now cached
        hits = engine.block_manager.stats.hits
        out = engine.generate([prompt], SamplingParams(temperature=0.5, seed=0, max_tokens=3, n=2, prompt_logprobs=2),
                              use_tqdm=False)[0]
    lp = hf_logprobs(hf_model, prompt)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    want = lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), want, atol=1e-4, rtol=1e-4)
    top = lp[:-1].topk(2)
    assert [list(d) for d in out.prompt_top_logprobs[1:]] == top.indices.tolist()
    second = out.outputs[1]
    assert second.index == 1 and second.prompt_logprobs == out.prompt_logprobs  # computed once, shared
    assert second.num_cached_tokens > 0 and out.num_cached_tokens == 0  # the first skipped the cache
    assert engine.block_manager.stats.hits > hits


def test_n_sequences_are_grouped_share_the_prompt_and_draw_with_seed_plus_index(setup):
    folder, _, prompts, _ = setup
    sampled = dict(temperature=0.9, max_tokens=8, ignore_eos=True)
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4)
        outs = engine.generate(prompts[1:3], SamplingParams(n=3, seed=70, **sampled), use_tqdm=False)
        singles = [[engine.generate([p], SamplingParams(seed=70 + i, **sampled), use_tqdm=False)[0].token_ids
                    for i in range(3)] for p in prompts[1:3]]
    assert len(outs) == 2
    for out, want in zip(outs, singles):
        assert [o.index for o in out.outputs] == [0, 1, 2] and out.outputs[0] is out
        assert len({o.request_id for o in out.outputs}) == 1
        assert [o.token_ids for o in out.outputs] == want
        assert out.num_cached_tokens == 0 and all(o.num_cached_tokens >= 8 for o in out.outputs[1:])


def test_abort_takes_every_sequence_of_a_prompt(setup):
    folder, _, prompts, _ = setup
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4)
        rid = engine.add_request(prompts[1], SamplingParams(n=3, max_tokens=20, ignore_eos=True))
        seen = set()
        for _ in range(3):
            seen |= {(o.request_id, o.index) for o in engine.step()}
        engine.abort(rid)
    assert seen == {(rid, 0), (rid, 1), (rid, 2)}
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("params, message", [
    (SamplingParams(logit_bias={96: 1.0}), "logit_bias: token id 96 is outside the vocabulary"),
    (SamplingParams(allowed_token_ids=[1, 200]), "allowed_token_ids: token id 200"),
    (SamplingParams(bad_words=[[5, 500]]), "bad_words: token id 500"),
    (SamplingParams(stop_token_ids=[3, 96]), r"stop_token_ids: token id 96 is outside the vocabulary \[0, 96\)"),
    (SamplingParams(stop_token_ids=[10**6], min_tokens=2), "stop_token_ids: token id 1000000"),
    (SamplingParams(bad_words=["word"]), "string words need a tokenizer"),
    (SamplingParams(stop="word"), "stop strings need a tokenizer"),
    (SamplingParams(logprobs=21), "at most max_logprobs=20"),
    (SamplingParams(prompt_logprobs=30), "prompt_logprobs=30: at most max_logprobs=20"),
    (SamplingParams(logprobs=-1), r"logprobs=-1 \(the whole vocabulary, 96\): at most max_logprobs=20"),
])
def test_parameters_the_model_cannot_serve_are_refused_by_name(setup, params, message):
    folder, _, prompts, _ = setup
    engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompts[0], params)
    assert not engine.has_unfinished_requests()


def test_n_sequences_of_one_token_each_all_finish(setup):
    folder, _, prompts, _ = setup
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4)
        out = engine.generate([prompts[2]], SamplingParams(n=4, max_tokens=1, seed=1), use_tqdm=False)[0]
    # the first finished with its first token: the others were released then, and took its blocks
    assert [len(o.token_ids) for o in out.outputs] == [1] * 4 and [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert not engine.has_unfinished_requests() and engine.block_manager.stats.hits > 0


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_eos_with_or_without_ignore_eos(ignore_eos):
    """vLLM's rule: EOS is banned while the output is shorter than min_tokens, ignore_eos or not."""
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(device="cpu", dtype=torch.float32)  # the demo model: EOS is token 0
        eos = next(iter(engine.eos_token_ids))
        params = SamplingParams(temperature=0, max_tokens=8, min_tokens=5, ignore_eos=ignore_eos,
                                logit_bias={eos: 30.0})  # EOS the most likely token everywhere
        out = engine.generate([[17, 18, 19]], params, use_tqdm=False)[0]
    assert eos not in out.token_ids[:5]
    assert out.token_ids[5:] == [eos] * (3 if ignore_eos else 1)
