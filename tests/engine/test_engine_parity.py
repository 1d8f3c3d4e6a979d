"""Greedy tokens through the engine equal HF ``generate`` (fp32, CPU) in every scheduling regime."""

import random

import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from tests.engine.conftest import assert_batch_mirrors_block_manager, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts_for(vocab, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab - 1) for _ in range(n)] for n in lengths]


def checked_generate(engine, prompts, params):
    """generate() step by step, checking the block manager's invariants after every step."""
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.block_manager.check_integrity()
        assert_batch_mirrors_block_manager(engine.scheduler)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    return [done[i] for i in ids]


@pytest.fixture(params=["tiny_qwen3", "tiny_llama"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


REGIMES = {
    "plain": dict(block_size=16),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=5),
    "tiny_pool_preemption": dict(block_size=2, num_kv_blocks=24, max_model_len=48),
    "block_size_1": dict(block_size=1, max_num_batched_tokens=9),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_equals_hf_generate(checkpoint, regime):
    folder, hf_model = checkpoint
    vocab = hf_model.config.vocab_size
    prompts = prompts_for(vocab, [7, 1, 13, 20, 3])
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, **REGIMES[regime])
        outs = checked_generate(engine, prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens), prompt
        assert out.finish_reason == "length"
    if regime == "tiny_pool_preemption":
        assert engine.num_preemptions > 0


def test_preemption_really_happens_and_output_unchanged(tiny_qwen3):
    folder, hf_model = tiny_qwen3
    prompts = prompts_for(hf_model.config.vocab_size, [10, 10, 10, 10], seed=3)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    with ops.use_backend("torch"):
        # 16 blocks of 2 = 32 slots; four requests of 24 tokens each cannot all stay resident.
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=2, num_kv_blocks=16,
                                        max_model_len=32,
                                        enable_prefix_caching=False)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
            engine.block_manager.check_integrity()
    assert engine.num_preemptions > 0
    for rid, prompt in zip(ids, prompts):
        assert done[rid].token_ids == hf_greedy(hf_model, prompt, 14)


def test_prefix_hits_give_same_tokens(tiny_qwen3):
    folder, hf_model = tiny_qwen3
    shared = prompts_for(hf_model.config.vocab_size, [16], seed=5)[0]
    prompts = [shared + [3, 4], shared + [5], shared]
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4)
        first = checked_generate(engine, prompts[:1], GREEDY)  # fills the prefix cache
        rest = checked_generate(engine, prompts[1:], GREEDY)
    assert engine.block_manager.stats.hits > 0
    for prompt, out in zip(prompts, first + rest):
        assert out.token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens)


def test_batch_invariance_and_seeded_sampling(tiny_llama):
    folder, hf_model = tiny_llama
    prompts = prompts_for(hf_model.config.vocab_size, [5, 9, 2, 11], seed=7)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=1234, ignore_eos=True)
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4)
        alone = engine.generate([prompts[0]], [sampled], use_tqdm=False)[0].token_ids
        alone_greedy = engine.generate([prompts[1]], GREEDY, use_tqdm=False)[0].token_ids
        mixed = engine.generate(prompts, [sampled, GREEDY, GREEDY, sampled], use_tqdm=False)
        again = engine.generate([prompts[0]], [sampled], use_tqdm=False)[0].token_ids
    assert mixed[0].token_ids == alone == again
    assert mixed[1].token_ids == alone_greedy
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=99, ignore_eos=True)
    with ops.use_backend("torch"):
        assert engine.generate([prompts[0]], [other_seed], use_tqdm=False)[0].token_ids != alone


@pytest.fixture
def greedy_reference(tiny_qwen3):
    """(engine on tiny_qwen3, a prompt, HF's 12 greedy tokens after it, none of them the config's EOS)."""
    folder, hf_model = tiny_qwen3
    prompt = prompts_for(hf_model.config.vocab_size, [6], seed=11)[0]
    reference = hf_greedy(hf_model, prompt, 12)
    eos = hf_model.config.eos_token_id
    assert eos not in reference, "the checks below assume the config's EOS is not among HF's greedy tokens"
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
    return engine, prompt, reference


def test_stop_token_ends_the_output_at_its_first_occurrence(greedy_reference):
    engine, prompt, reference = greedy_reference
    stop_at = reference[4]
    with ops.use_backend("torch"):
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
                              use_tqdm=False)[0]
    assert out.token_ids == reference[: reference.index(stop_at) + 1] and out.finish_reason == "stop"


def test_max_tokens_gives_exactly_that_many_greedy_tokens(greedy_reference):
    engine, prompt, reference = greedy_reference
    with ops.use_backend("torch"):
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.token_ids == reference[:3] and out.finish_reason == "length"


def test_eos_stops_generation_unless_ignored(greedy_reference):
    engine, prompt, reference = greedy_reference
    engine.eos_token_ids = frozenset({reference[2]})  # make the model's 3rd greedy token the EOS id
    with ops.use_backend("torch"):
        stopped = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        ignored = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                  use_tqdm=False)[0]
    assert stopped.token_ids == reference[: reference.index(reference[2]) + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == reference and ignored.finish_reason == "length"


def test_logprobs_match_hf(tiny_llama):
    folder, hf_model = tiny_llama
    prompt = prompts_for(hf_model.config.vocab_size, [8], seed=13)[0]
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True),
                              use_tqdm=False)[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()
    want = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=1e-4)


def test_abort_mid_generation_frees_everything(tiny_qwen3):
    folder, hf_model = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4)
        a = engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
        b = engine.add_request([7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.abort(a)
        engine.block_manager.check_integrity()
        engine.abort(b)
        engine.abort(12345)  # unknown ids are ignored
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_integrity()


def test_max_tokens_beyond_the_room_stop_at_max_model_len_with_length_as_vllm(tiny_qwen3):
    """vLLM stops a sequence when it reaches max_model_len (finish_reason "length") whatever max_tokens asked;
    min_tokens beyond the room cannot be met and is capped with it."""
    folder, _ = tiny_qwen3
    engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4, num_kv_blocks=64,
                                    max_model_len=40)
    prompt = [1 + i % 90 for i in range(31)]
    with ops.use_backend("torch"):
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1000, min_tokens=20, ignore_eos=True),
                              use_tqdm=False)[0]
        fits = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                               use_tqdm=False)[0]
    assert len(out.token_ids) == 40 - 31 and out.finish_reason == "length"
    assert out.token_ids == fits.token_ids
    assert not engine.has_unfinished_requests()


def test_requests_that_can_never_fit_are_rejected(tiny_qwen3):
    folder, _ = tiny_qwen3
    engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4, num_kv_blocks=64,
                                    max_model_len=200)
    with pytest.raises(ValueError, match="prompt of 200 tokens leaves no room for output under max_model_len=200"):
        engine.add_request([1 + i % 90 for i in range(200)], SamplingParams(max_tokens=1))
    # A pool that cannot hold one request of max_model_len is refused when the engine is built.
    with pytest.raises(ValueError, match="smallest budget that works"):
        Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4, num_kv_blocks=49,
                               max_model_len=200)
    with pytest.raises(ValueError, match="string prompts need a tokenizer"):
        engine.add_request("hello")
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([1, 5000])
    assert not engine.has_unfinished_requests()


def _run_two_one_block_prompts(async_scheduling: bool, older_max_tokens: int):
    """Two one-block prompts on a pool of 8 four-token blocks, the older one asking ``older_max_tokens``, the
    younger 20, run to the end (the block manager checked after each step); (engine, ids, requests, outputs)."""
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(device="cpu", dtype=torch.float32, block_size=4, num_kv_blocks=8,
                                        max_model_len=32, max_num_seqs=2, async_scheduling=async_scheduling)
        params = [SamplingParams(temperature=0, max_tokens=older_max_tokens, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
        ids = [engine.add_request(p, q) for p, q in zip([[11, 12, 13, 14], [21, 22, 23, 24]], params)]
        requests = [engine._requests[i][0] for i in ids]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
            engine.block_manager.check_integrity()
    return engine, ids, requests, done


@pytest.mark.parametrize("async_scheduling, older_max_tokens", [(False, 14), (True, 14)])
def test_a_recompute_after_preemption_is_neither_the_prompts_cache_hits_nor_missed_in_the_count(async_scheduling,
                                                                                                 older_max_tokens):
    """Two one-block prompts: nothing of them can come from the prefix cache. The older request grows
    and preempts the younger, whose recompute takes its own computed blocks from the cache: those
    hits are not the prompt's (vLLM keeps num_cached_tokens from the first admission and the prompt
    statistics apart), and every preemption is counted."""
    engine, ids, requests, done = _run_two_one_block_prompts(async_scheduling, older_max_tokens)
    preemptions = sum(r.num_preemptions for r in requests)
    assert preemptions > 0, "the pool is meant to preempt"
    assert engine.num_preemptions == preemptions
    assert [done[i].num_cached_tokens for i in ids] == [0, 0]
    assert engine.block_manager.stats.hits == 0


def test_async_scheduling_takes_the_blocks_of_a_request_whose_last_token_is_pending_before_preempting():
    """The older request's last token is in flight when the younger needs a block of the full pool: the
    older one computes nothing more, so its blocks go first and nothing is preempted (sync scheduling
    records that token before scheduling and never preempts here either). Outputs as sync's."""
    outputs = {}
    for async_scheduling in (False, True):
        engine, ids, requests, done = _run_two_one_block_prompts(async_scheduling, 13)
        assert [r.num_preemptions for r in requests] == [0, 0] and engine.num_preemptions == 0
        assert engine.block_manager.num_free_blocks == 8
        outputs[async_scheduling] = [(done[i].token_ids, done[i].finish_reason) for i in ids]
    assert outputs[True] == outputs[False]
