"""Async scheduling (step N+1 launched before step N's tokens are read) changes no output."""

import random

import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from tests.engine.conftest import assert_batch_mirrors_block_manager

REGIMES = {
    "plain": dict(block_size=16),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=5),
    "tiny_pool_preemption": dict(block_size=2, num_kv_blocks=24, max_model_len=48),
}


def run(folder, async_scheduling, prompts, params, abort_after=None, **engine_args):
    """Every output of every step, in order, plus the final outputs; invariants checked each step."""
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32,
                                        async_scheduling=async_scheduling, **engine_args)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        final, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id not in final, "an output after the request finished"
                if out.finished:
                    final[out.request_id] = (out.token_ids, out.finish_reason)
            steps += 1
            if steps == abort_after:
                engine.abort(ids[0])
                final[ids[0]] = "aborted"
            engine.block_manager.check_integrity()
            assert_batch_mirrors_block_manager(engine.scheduler)
        engine.step()  # drains a step launched ahead for requests that have all finished
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [final[i] for i in ids], engine


@pytest.mark.parametrize("regime", list(REGIMES))
def test_outputs_identical_with_async_scheduling_on_and_off(tiny_qwen3, regime):
    folder, hf_model = tiny_qwen3
    rng = random.Random(1)
    vocab = hf_model.config.vocab_size
    prompts = [[rng.randrange(1, vocab - 1) for _ in range(n)] for n in (7, 1, 13, 20, 3, 9)]
    reference = [o[0] for o in run(folder, False, prompts, [SamplingParams(temperature=0, max_tokens=12,
                                                                           ignore_eos=True)] * 6, **REGIMES[regime])[0]]
    # Stops the scheduler cannot foresee: an EOS id and stop token ids taken from the greedy outputs.
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[reference[1][3]], ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=11, logprobs=0, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    results = {}
    for async_scheduling in (False, True):
        outs, engine = run(folder, async_scheduling, prompts, params, **REGIMES[regime])
        results[async_scheduling] = outs
    assert results[True] == results[False]
    assert results[False][1][1] == "stop" and len(results[False][1][0]) < 12
    if regime == "tiny_pool_preemption":
        assert engine.num_preemptions > 0


def test_abort_while_a_step_is_in_flight(tiny_qwen3):
    folder, hf_model = tiny_qwen3
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3
    results = {a: run(folder, a, prompts, params, abort_after=3, block_size=4)[0] for a in (False, True)}
    assert results[True] == results[False] and results[True][0] == "aborted"


def test_first_step_returns_the_first_tokens(tiny_qwen3):
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
        rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        outs = [engine.step() for _ in range(3)]
    assert [[o.request_id for o in step] for step in outs] == [[rid]] * 3
    assert outs[-1][0].finished and len(outs[-1][0].token_ids) == 3
