"""Scheduler behaviour on hand-built requests over a real BlockManager (no model)."""

import pytest

from atom_core.cache import BlockManager
from atom_core.engine.request import Request, Status
from atom_core.engine.sampling_params import SamplingParams
from atom_core.engine.scheduler import Scheduler


def make(rid, n_prompt, first_token=0):
    return Request(rid, list(range(first_token, first_token + n_prompt)), SamplingParams(max_tokens=100), seed=rid)


def run_step(sched, step, sampled=7):
    """What the engine does after the runner: advance progress, append a token to finished prompts."""
    for req, q in zip(step.requests, step.query_lens):
        req.num_computed_tokens += q
        sched.block_manager.publish(req.request_id, req.token_ids, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(sampled)
    sched.block_manager.check_integrity()


def test_prefill_then_decode_rows():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make(0, 5), make(1, 3, first_token=100)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == [0, 1] and step.query_lens == [5, 3]
    run_step(sched, step)
    step = sched.schedule()
    assert step.query_lens == [1, 1]  # both decode now
    assert all(r.status is Status.RUNNING for r in step.requests)


def test_chunked_prefill_under_token_budget_mixes_with_decode():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=6)
    a = make(0, 2)
    sched.add(a)
    run_step(sched, sched.schedule())  # a: prompt of 2 done
    b = make(1, 13, first_token=50)
    sched.add(b)
    # Budget 6: a decodes 1 token, b gets a 5-token chunk; then 5 more; then the last 3 (+ a's decode).
    seen = []
    for _ in range(3):
        step = sched.schedule()
        seen.append(list(zip([r.request_id for r in step.requests], step.query_lens)))
        run_step(sched, step)
    assert seen == [[(0, 1), (1, 5)], [(0, 1), (1, 5)], [(0, 1), (1, 3)]]
    assert b.num_computed_tokens == 13 and b.num_output_tokens == 1


def test_sequence_cap():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(make(i, 3, first_token=10 * i))
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == [0, 1]
    assert len(sched.waiting) == 1


def test_prefix_hit_skips_cached_tokens():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=100)
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
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
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
    assert step.requests == [b] and step.query_lens == [5]  # recompute prompt + its generated token
    bm.check_integrity()


def test_finish_frees_blocks_and_abort_waiting():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
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
        Scheduler(BlockManager(4, 4), max_num_seqs=0, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(BlockManager(4, 4), max_num_seqs=1, max_num_batched_tokens=0)
