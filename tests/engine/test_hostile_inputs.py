"""The public API under random, partly hostile use: random SamplingParams (valid and invalid),
prompts of every kind, interleaved add_request / step / abort, pools small enough to preempt and
to refuse. After every operation the block manager is consistent; when all is finished or aborted
no block is held; every finished greedy request equals the same request run alone.
Plus a soak on the built-in demo model."""

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from tests.engine.conftest import assert_batch_mirrors_block_manager

VOCAB = 96  # tiny_qwen3's
MAX_MODEL_LEN = 64

params_kwargs = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.sampled_from([0.0, 0.0, 0.7, 1.0]), st.floats(allow_nan=True, allow_infinity=True),
                             st.booleans()),
    "top_k": st.one_of(st.sampled_from([-1, 1, 5]), st.integers(-5, 2**40)),
    "top_p": st.one_of(st.sampled_from([1.0, 0.9]), st.floats(allow_nan=True)),
    "min_p": st.one_of(st.sampled_from([0.0, 0.1]), st.floats(allow_nan=True)),
    "max_tokens": st.one_of(st.integers(1, 12), st.integers(-3, 0), st.just(10**6)),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1), st.integers(-5, -1), st.just(2**64)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(-1, VOCAB), max_size=2)),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(-1, 2)),
})
prompts = st.one_of(
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=30),
    st.lists(st.integers(-3, VOCAB + 3), min_size=0, max_size=5),  # out of range, empty
    st.lists(st.booleans(), min_size=1, max_size=3),
    st.lists(st.floats(0, 5), min_size=1, max_size=3),
    st.builds(lambda xs: np.array(xs, dtype=np.int64), st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20)),
    st.just("text without a tokenizer"),
)
operations = st.lists(st.one_of(
    st.tuples(st.just("add"), prompts, params_kwargs),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 12)),
), min_size=1, max_size=25)


def checked(engine):
    engine.block_manager.check_integrity()
    assert_batch_mirrors_block_manager(engine.scheduler)


@pytest.fixture(scope="module")
def solo(tiny_qwen3):
    """Greedy output of a request run alone in a fresh engine, memoised by (prompt, params)."""
    folder, _ = tiny_qwen3
    cache = {}

    def run(prompt, params):
        key = (tuple(prompt), params.max_tokens, tuple(params.stop_token_ids or ()), params.ignore_eos)
        if key not in cache:
            with ops.use_backend("torch"):
                # (the max_model_len of the engines compared: max_tokens beyond it is capped to the room it leaves)
                engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4,
                                                max_model_len=MAX_MODEL_LEN)
                cache[key] = engine.generate([prompt], params, use_tqdm=False)[0].token_ids
        return cache[key]

    return run


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(ops_list=operations, num_blocks=st.integers(12, 40), async_scheduling=st.booleans(),
       block_size=st.sampled_from([2, 4]))
def test_random_use_leaks_nothing_and_greedy_outputs_match_solo_runs(tiny_qwen3, solo, ops_list, num_blocks,
                                                                     async_scheduling, block_size):
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=block_size,
                                        num_kv_blocks=max(num_blocks, 64 // block_size), max_model_len=MAX_MODEL_LEN,
                                        max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=async_scheduling)
        added, finished, aborted = {}, {}, set()

        def collect(outputs):
            for out in outputs:
                assert out.request_id not in finished
                if out.finished:
                    finished[out.request_id] = out

        for op in ops_list:
            if op[0] == "add":
                _, prompt, kwargs = op
                try:
                    params = SamplingParams(**kwargs)
                    rid = engine.add_request(prompt, params)
                except (TypeError, ValueError):
                    checked(engine)
                    continue
                added[rid] = (list(np.asarray(prompt).tolist()), params)
            elif op[0] == "step":
                for _ in range(op[1]):
                    collect(engine.step())
            else:
                rid = op[1]
                if rid in added and rid not in finished:
                    aborted.add(rid)
                engine.abort(rid)
            checked(engine)
        while engine.has_unfinished_requests():
            collect(engine.step())
            checked(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert set(finished) | aborted == set(added)
    for rid, out in finished.items():
        prompt, params = added[rid]
        if params.temperature == 0 and rid not in aborted:
            assert out.token_ids == solo(prompt, params), (prompt, params)


def test_soak_on_the_demo_model_with_random_aborts_and_a_tiny_pool():
    rng = random.Random(0)
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(device="cpu", dtype=torch.float32, block_size=4, num_kv_blocks=160,
                                        max_model_len=128, max_num_seqs=24, max_num_batched_tokens=96)
        live, num_finished, num_aborted = set(), 0, 0
        for i in range(320):
            prompt = [rng.randrange(1, 2000) for _ in range(rng.randint(1, 60))]
            params = SamplingParams(temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9]),
                                    max_tokens=rng.randint(1, 40), seed=i)
            live.add(engine.add_request(prompt, params))
            if rng.random() < 0.5:
                for out in engine.step():
                    if out.finished:
                        live.discard(out.request_id)
                        num_finished += 1
            if live and rng.random() < 0.15:
                victim = rng.choice(sorted(live))
                engine.abort(victim)
                live.discard(victim)
                num_aborted += 1
            engine.block_manager.check_integrity()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
                    num_finished += 1
            engine.block_manager.check_integrity()
    assert not live and num_finished + num_aborted == 320 and num_aborted > 0
    assert engine.num_preemptions > 0  # the pool was tight enough to preempt
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


class _RaisesOnCall:
    """A model forward that raises ``error`` on its ``fail_at``-th call."""

    def __init__(self, model, fail_at, error):
        self.model, self.fail_at, self.error, self.calls = model, fail_at, error, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return type(self.model).forward(self.model, *args, **kwargs)


@pytest.mark.parametrize("error", [RuntimeError("injected failure"), KeyboardInterrupt()])
def test_generate_that_raises_aborts_its_prompts_and_the_next_generate_runs(tiny_qwen3, error):
    folder, _ = tiny_qwen3
    params = SamplingParams(temperature=0, max_tokens=5)
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, max_num_seqs=2)
        want = engine.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
        engine.model.forward = _RaisesOnCall(engine.model, 2, error)
        with pytest.raises(type(error)):
            engine.generate([[1, 2, 3]] * 6, params, use_tqdm=False)  # two run, four wait when the step raises
        del engine.model.forward
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert engine.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids == want


def test_vllm_prompt_dicts_run_as_their_text_or_token_ids_and_other_keys_are_refused(tiny_qwen3):
    folder, _ = tiny_qwen3
    params = SamplingParams(temperature=0, max_tokens=4)
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
        want = engine.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
        assert engine.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].token_ids == want
        assert [o.token_ids for o in engine.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params,
                                                     use_tqdm=False)] == [want, want]
        for prompt in ({"prompt_token_ids": [5, 6, 7], "multi_modal_data": None}, {}, {"prompt": "x", "extra": 1}):
            with pytest.raises(TypeError, match="prompt dict holds only"):
                engine.generate(prompt, params, use_tqdm=False)
        assert not engine.has_unfinished_requests()
        text_engine = Engine.from_pretrained(device="cpu", dtype=torch.float32)  # the demo model has a tokenizer
        want_text = text_engine.generate("Return the number of", params, use_tqdm=False)[0].token_ids
        assert text_engine.generate({"prompt": "Return the number of"}, params,
                                    use_tqdm=False)[0].token_ids == want_text
