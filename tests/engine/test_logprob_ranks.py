"""``RequestOutput.logprob_ranks`` / ``prompt_logprob_ranks`` (vLLM's ``Logprob.rank``): each token's rank is
the number of vocabulary tokens whose value in the engine's ``logprobs_mode`` is at least its own. Checked
against a plain-torch count over HF's logits of the same tokens (raw modes, sampled and prompt tokens, on
the fused and the eager log-prob path) and over HF-style processed scores of them (processed modes); greedy
tokens rank 1; a sampled token outside the top N ranks above N; ties count as vLLM's ``>=`` (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from atom_core.engine import SamplingParams
from atom_core.engine.logprobs import token_ranks
from tests.engine.test_engine_parity import prompts_for
from tests.engine.test_logprobs_mode import (
    MODES,
    SAMPLED,
    hf_logits,
    hf_style_processed,
    run,
)


@pytest.fixture(scope="module")
def setup(tiny_qwen3):
    folder, hf_model = tiny_qwen3
    vocab = hf_model.config.vocab_size
    return folder, hf_model, vocab, prompts_for(vocab, [7, 13, 4], seed=5)


def vllm_rank(values: torch.Tensor, token: int) -> int:
    """vLLM's rank of ``token`` in one row of values [V]: ``batched_count_greater_than`` (``>=``)."""
    return int((values >= values[token]).sum())


def test_token_ranks_count_every_value_at_least_the_tokens_own():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, float("-inf")],
                           [0.5, float("-inf"), float("-inf"), -1.0, 0.25]])
    # row 0: 3.0 is tied at the top (both rank 2, the last of their places), 2.0 third, 1.0 fourth, -inf last
    want = {0: [4, 2, 2, 3, 5], 1: [1, 5, 5, 3, 2]}
    for token in range(5):
        got = token_ranks(scores, torch.tensor([token, token]))
        assert got.dtype == torch.int64 and got.tolist() == [want[0][token], want[1][token]]
    bf16 = scores.to(torch.bfloat16)  # compared in its own dtype: the same counts
    assert token_ranks(bf16, torch.tensor([3, 4])).tolist() == [3, 2]


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
@pytest.mark.parametrize("num_top", [0, 3])  # 0 in raw_logprobs: the draw's fused log-probs
def test_sampled_and_prompt_ranks_equal_a_count_over_hf_logits_in_raw_modes(setup, mode, num_top):
    folder, hf_model, _, prompts = setup
    params = SamplingParams(seed=4, temperature=1.2, max_tokens=10, ignore_eos=True, logprobs=num_top,
                            prompt_logprobs=num_top)
    for prompt, out in zip(prompts, run(folder, mode, prompts, params)):
        out = out.outputs[0]
        logits = hf_logits(hf_model, prompt + out.token_ids)[:-1]  # position p predicts token p + 1
        values = logits if mode.endswith("_logits") else torch.log_softmax(logits, -1)
        tokens = prompt[1:] + out.token_ids
        want = [vllm_rank(values[p], token) for p, token in enumerate(tokens)]
        assert out.prompt_logprob_ranks == [None] + want[:len(prompt) - 1]
        assert out.logprob_ranks == want[len(prompt) - 1:]
        assert len(out.logprob_ranks) == len(out.logprobs) == 10
    assert any(rank > 1 for rank in want)  # the draws at T = 1.2 left the top


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_sampled_ranks_equal_a_count_over_hf_style_processed_scores(setup, mode):
    folder, hf_model, _, prompts = setup
    filters = {"temperature": 0.7, "top_k": 12, "top_p": 0.8, "repetition_penalty": 1.3}
    params = SamplingParams(logprobs=2, prompt_logprobs=0, **SAMPLED)
    raw_ranks = [o.outputs[0].prompt_logprob_ranks for o in run(folder, "raw_logits", prompts, params)]
    seen_below_top = False
    for prompt, out, raw in zip(prompts, run(folder, mode, prompts, params), raw_ranks):
        out = out.outputs[0]
        assert out.prompt_logprob_ranks == raw  # prompt positions get no processing
        logits = hf_logits(hf_model, prompt + out.token_ids)[len(prompt) - 1:-1]
        for k, token in enumerate(out.token_ids):
            scores = hf_style_processed(logits[k], prompt + out.token_ids[:k], **filters)
            assert out.logprob_ranks[k] == vllm_rank(scores, token) == vllm_rank(torch.log_softmax(scores, -1), token)
            seen_below_top |= out.logprob_ranks[k] > 1
    assert seen_below_top


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_top", [0, 2])
def test_a_greedy_tokens_rank_is_1(setup, mode, num_top):
    folder, _, _, prompts = setup
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=num_top)
    for out in run(folder, mode, prompts, params):
        assert out.logprob_ranks == [1] * 8


def test_a_sampled_token_outside_the_top_n_ranks_above_n(setup):
    folder, _, vocab, prompts = setup
    params = SamplingParams(seed=0, temperature=3.0, max_tokens=24, ignore_eos=True, logprobs=1)
    full_params = SamplingParams(seed=0, temperature=3.0, max_tokens=24, ignore_eos=True, logprobs=vocab)
    outside = 0
    for out, whole in zip(run(folder, None, prompts, params), run(folder, None, prompts, full_params)):
        out, whole = out.outputs[0], whole.outputs[0]
        assert out.token_ids == whole.token_ids and out.logprob_ranks == whole.logprob_ranks
        for token, rank, top, every in zip(out.token_ids, out.logprob_ranks, out.top_logprobs, whole.top_logprobs):
            assert (rank == 1) == (token in top)
            assert rank == list(every).index(token) + 1  # its place among the whole vocabulary (no ties here)
            outside += token not in top
    assert outside >= 10  # most draws at T = 3 leave the top 1


def test_tied_values_rank_as_vllms_count(setup):
    """Two tokens biased to the same float32 score (1e9 absorbs their logits): the greedy draw takes the
    lower id, and its rank counts both (2, vLLM's ``>=``); the raw modes see no tie."""
    folder, hf_model, _, prompts = setup
    a, b = 10, 20
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, logit_bias={a: 1e9, b: 1e9})
    for mode in ("processed_logits", "processed_logprobs"):
        for out in run(folder, mode, prompts, params):
            assert out.token_ids == [a] * 3 and out.logprob_ranks == [2] * 3
            assert all(set(top) == {a, b} and len(set(top.values())) == 1 for top in out.top_logprobs)
    prompt = prompts[0]
    raw = run(folder, "raw_logits", [prompt], params)[0]
    logits = hf_logits(hf_model, prompt + raw.token_ids)[len(prompt) - 1:-1]
    assert raw.logprob_ranks == [vllm_rank(row, a) for row in logits]


def test_n_sequences_share_the_prompts_ranks(setup):
    folder, _, _, prompts = setup
    one = run(folder, None, prompts[1:2], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    group = run(folder, None, prompts[1:2], SamplingParams(n=3, seed=2, max_tokens=4, logprobs=0, prompt_logprobs=1))
    assert len(group[0].outputs) == 3
    for seq in group[0].outputs:
        assert seq.prompt_logprob_ranks == one.prompt_logprob_ranks
        assert seq.prompt_logprob_ranks[0] is None and len(seq.prompt_logprob_ranks) == len(prompts[1])
        assert len(seq.logprob_ranks) == 4


def test_ranks_are_none_without_logprobs(setup):
    folder, _, _, prompts = setup
    out = run(folder, None, prompts[:1], SamplingParams(max_tokens=2))[0]
    assert out.logprob_ranks is None and out.prompt_logprob_ranks is None
