"""Scheduler behaviour on hand-built requests over a real BlockManager (no model)."""

import numpy as np
import pytest

from atom_core.cache import BlockManager
from atom_core.engine.request import Request, Status
from atom_core.engine.sampling_params import SamplingParams
from atom_core.engine.scheduler import Scheduler
from tests.engine.conftest import assert_batch_mirrors_block_manager


def make(rid, n_prompt, first_token=0):
    return Request(rid, list(range(first_token, first_token + n_prompt)), SamplingParams(max_tokens=100), seed=rid)


def scheduler(num_blocks, block_size, *, enable_prefix_caching=True, max_model_len=64, **limits):
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching), max_model_len=max_model_len,
                     **limits)


def run_step(sched, step, sampled=7):
    """What the engine does after the runner: every row gets ``sampled`` (kept by rows that finished their prompt)."""
    produced = sched.update(step, np.full(len(step), sampled))
    sched.block_manager.check_integrity()
    return produced


def test_prefill_then_decode_rows():
    sched = scheduler(16, 4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make(0, 5), make(1, 3, first_token=100)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == [0, 1] and step.query_lens.tolist() == [5, 3]
    run_step(sched, step)
    step = sched.schedule()
    assert step.query_lens.tolist() == [1, 1]  # both decode now
    assert all(r.status is Status.RUNNING for r in step.requests)


def test_chunked_prefill_under_token_budget_mixes_with_decode():
    sched = scheduler(32, 4, max_num_seqs=8, max_num_batched_tokens=6)
    a = make(0, 2)
    sched.add(a)
    run_step(sched, sched.schedule())  # a: prompt of 2 done
    b = make(1, 13, first_token=50)
    sched.add(b)
    # Budget 6: a decodes 1 token, b gets a 5-token chunk; then 5 more; then the last 3 (+ a's decode).
    seen = []
    for _ in range(3):
        step = sched.schedule()
        seen.append(list(zip([r.request_id for r in step.requests], step.query_lens.tolist())))
        run_step(sched, step)
    assert seen == [[(0, 1), (1, 5)], [(0, 1), (1, 5)], [(0, 1), (1, 3)]]
    assert b.num_computed_tokens == 13 and b.num_output_tokens == 1


def test_sequence_cap():
    sched = scheduler(64, 4, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(make(i, 3, first_token=10 * i))
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == [0, 1]
    assert len(sched.waiting) == 1


def test_prefix_hit_skips_cached_tokens():
    sched = scheduler(32, 4, max_num_seqs=4, max_num_batched_tokens=100)
    a = make(0, 10)
    sched.add(a)
    run_step(sched, sched.schedule())  # publishes a's 2 full blocks (tokens 0..7)
    b = make(1, 9)  # same first 8 tokens, then token 8
    sched.add(b)
    step = sched.schedule()
    row = step.requests.index(b)
    # 8 tokens (2 blocks of 4) come from the cache: b computes only its last token.
    assert b.num_cached_tokens == 8 and step.query_lens[row] == 1


def test_preemption_frees_newest_and_recomputes_later():
    # 4 blocks of 2 tokens: two requests of 4 prompt tokens take 2 blocks each, so the pool is full.
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100, max_model_len=64)
    a, b = make(0, 4), make(1, 4, first_token=10)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # both have 5 tokens now; decoding token 5 needs a 3rd block each
    run_step(sched, step := sched.schedule())
    # a fits after b (newest) is preempted; b waits with its tokens so far kept.
    assert step.preempted == [b] and [r.request_id for r in step.requests] == [0]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.num_tokens == 5
    assert sched.waiting[0] is b
    sched.finish(a, "length")
    step = sched.schedule()
    assert step.requests == [b] and step.query_lens.tolist() == [5]  # recompute prompt + its generated token
    bm.check_integrity()


def test_finish_frees_blocks_and_abort_waiting():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100, max_model_len=64)
    a, b = make(0, 5), make(1, 5, first_token=40)
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.add(b)
    sched.finish(b, "abort")  # still waiting
    sched.finish(a, "abort")  # running
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == 8 and a.finish_reason == b.finish_reason == "abort"
    bm.check_integrity()


def test_bad_limits():
    with pytest.raises(ValueError, match="max_num_seqs"):
        scheduler(4, 4, max_num_seqs=0, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        scheduler(4, 4, max_num_seqs=1, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler(4, 4, max_num_seqs=1, max_num_batched_tokens=8, max_model_len=0)


# --- the vectorized decode path equals the per-row path -------------------------------------------


def drive(sched, prompts, max_tokens, force_general: bool, admit_every: int):
    """Run a workload to the end through ``sched`` alone, as the engine would: new prompts arrive
    every ``admit_every`` steps; each row's token is a function of its request and position (so it
    does not depend on row order); a request stops after ``max_tokens[rid]`` tokens, finishes taken
    in request-id order. Returns per step ({rid: query_len}, [preempted rids]) and the outputs."""
    if force_general:
        sched._all_running_decode = lambda budget: False
    pending = list(range(len(prompts)))
    requests, trace, num_dense = {}, [], 0
    for step_index in range(10_000):
        if pending and step_index % admit_every == 0:
            rid = pending.pop(0)
            requests[rid] = Request(rid, prompts[rid], SamplingParams(max_tokens=max_tokens[rid]), seed=rid)
            sched.add(requests[rid])
        if not sched.has_unfinished():
            if not pending:
                break
            continue
        step = sched.schedule()
        num_dense += step.dense
        assert step.slots.tolist() == [r.slot for r in step.requests]
        trace.append(({r.request_id: q for r, q in zip(step.requests, step.query_lens.tolist())},
                      [r.request_id for r in step.preempted]))
        sampled = np.array([(r.request_id * 7 + r.num_tokens) % 5 for r in step.requests])
        produced = sched.update(step, sampled)
        done = sorted((step.requests[i] for i in produced.tolist()
                       if step.requests[i].num_output_tokens >= max_tokens[step.requests[i].request_id]),
                      key=lambda r: r.request_id)
        for request in done:
            sched.finish(request, "length")
        sched.block_manager.check_integrity()
        assert_batch_mirrors_block_manager(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return trace, {rid: r.output_token_ids for rid, r in requests.items()}, num_dense


@pytest.mark.parametrize("seed", range(6))
def test_decode_fast_path_schedules_like_the_general_path(seed):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 5, 8).tolist()  # a common prefix: prefix-cache hits
    prompts = [(shared if rng.random() < 0.5 else []) + rng.integers(0, 5, rng.integers(1, 12)).tolist()
               for _ in range(8)]
    max_tokens = rng.integers(1, 20, len(prompts)).tolist()
    # A pool tight enough to preempt (every request fits alone: <= 20 + 19 tokens = 10 blocks of 4).
    limits = dict(num_blocks=int(rng.integers(12, 40)), block_size=4, max_num_seqs=int(rng.integers(2, 6)),
                  max_num_batched_tokens=int(rng.integers(8, 64)))
    admit_every = int(rng.integers(1, 4))
    results = []
    for force_general in (False, True):
        bm = BlockManager(limits["num_blocks"], limits["block_size"])
        sched = Scheduler(bm, max_num_seqs=limits["max_num_seqs"],
                          max_num_batched_tokens=limits["max_num_batched_tokens"], max_model_len=48)
        results.append(drive(sched, prompts, max_tokens, force_general, admit_every)
                       + (bm.stats,))
    (fast_trace, fast_outputs, num_dense, fast_stats), (trace, outputs, _, stats) = results
    assert num_dense > 0  # the fast path ran
    assert fast_trace == trace and fast_outputs == outputs and fast_stats == stats


def test_decode_steps_are_dense_and_grow_tables_in_bulk():
    sched = scheduler(64, 4, max_num_seqs=4, max_num_batched_tokens=64)
    for rid in range(3):
        sched.add(make(rid, 3 + rid, first_token=10 * rid))  # prompts of 3, 4, 5 tokens
    run_step(sched, sched.schedule())  # the prompts: 4, 5, 6 tokens now
    step = sched.schedule()  # tokens at positions 3, 4, 5: rows 1 and 2 start their second block
    assert step.dense and step.slots.tolist() == [0, 1, 2] and step.query_lens.tolist() == [1, 1, 1]
    assert sched.batch.num_pages[:3].tolist() == [1, 2, 2]
    assert [sched.block_manager.block_table(r.request_id) for r in step.requests] == \
        [sched.batch.block_table[s, :n].tolist() for s, n in zip(range(3), sched.batch.num_pages[:3].tolist())]
