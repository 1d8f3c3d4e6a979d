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
    record = sched.record(step, np.full(len(step), sampled))
    sched.block_manager.check_integrity()
    return record


def computed(sched, request):
    return int(sched.batch.num_computed_tokens[request.row])


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
    assert computed(sched, b) == 13 and b.num_output_tokens == 1


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
    assert b.status is Status.WAITING and b.row is None and b.num_tokens == 5
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
    for budget in (64.5, True, "64"):  # a token budget is a count
        with pytest.raises(TypeError, match="max_num_batched_tokens must be an int"):
            scheduler(4, 4, max_num_seqs=1, max_num_batched_tokens=budget)


# --- the vectorized decode path equals the per-row path; scheduling one step ahead changes nothing


def drive(sched, prompts, max_tokens, force_general: bool, admit_every: int, ahead: bool = False):
    """Run a workload to the end through ``sched`` alone, as the engine would: new prompts arrive
    every ``admit_every`` steps; each new token is a function of its request and index (so it does
    not depend on row order or on the schedule); a request stops after ``max_tokens[rid]`` tokens
    (a stop the scheduler cannot foresee, like EOS), finishes taken in request-id order. With
    ``ahead``, each step is scheduled before the previous one's tokens are recorded (the engine's
    async scheduling). Returns per step ({rid: query_len}, [preempted rids]), the outputs, and how
    many steps were over every running row."""
    if force_general:
        sched._decode_rows = lambda budget: None
    pending = list(range(len(prompts)))
    requests, trace, num_every_row, in_flight = {}, [], 0, None

    def schedule():
        step = sched.schedule()
        if step is not None:  # the rows are the requests' rows when the step is made
            assert _rows(step) == [r.row for r in step.requests]
        return step

    for step_index in range(10_000):
        if pending and step_index % admit_every == 0:
            rid = pending.pop(0)
            requests[rid] = Request(rid, prompts[rid], SamplingParams(max_tokens=1000), seed=rid)
            sched.add(requests[rid])
        if not sched.has_unfinished():
            if not pending:
                break
            continue
        step, in_flight = in_flight or schedule(), None
        num_every_row += isinstance(step.rows, slice)
        trace.append(({r.request_id: q for r, q in zip(step.requests, step.query_lens.tolist())},
                      [r.request_id for r in step.preempted]))
        if ahead:
            in_flight = schedule()
        sampled = np.zeros(len(step), dtype=np.int64)
        sampled[step.produces] = [(step.requests[i].request_id * 7 + int(n)) % 5
                                  for i, n in zip(step.produces.tolist(), step.new_token_index.tolist())]
        record = sched.record(step, sampled)
        done = sorted((r for r in record.requests if r.num_output_tokens >= max_tokens[r.request_id]),
                      key=lambda r: r.request_id)
        for request in done:
            sched.finish(request, "length")
        sched.block_manager.check_integrity()
        assert_batch_mirrors_block_manager(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return trace, {rid: r.output_token_ids for rid, r in requests.items()}, num_every_row


def _rows(step):
    return list(range(len(step)))[step.rows] if isinstance(step.rows, slice) else step.rows.tolist()


def _workload(seed):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 5, 8).tolist()  # a common prefix: prefix-cache hits
    prompts = [(shared if rng.random() < 0.5 else []) + rng.integers(0, 5, rng.integers(1, 12)).tolist()
               for _ in range(8)]
    max_tokens = rng.integers(1, 20, len(prompts)).tolist()
    # A pool tight enough to preempt (every request fits alone: <= 20 + 19 tokens = 10 blocks of 4).
    limits = dict(num_blocks=int(rng.integers(12, 40)), block_size=4, max_num_seqs=int(rng.integers(2, 6)),
                  max_num_batched_tokens=int(rng.integers(8, 64)))
    return prompts, max_tokens, limits, int(rng.integers(1, 4))


def _scheduler(limits):
    bm = BlockManager(limits["num_blocks"], limits["block_size"])
    return Scheduler(bm, max_num_seqs=limits["max_num_seqs"], max_num_batched_tokens=limits["max_num_batched_tokens"],
                     max_model_len=48), bm


@pytest.mark.parametrize("seed", range(6))
def test_decode_fast_path_schedules_like_the_general_path(seed):
    prompts, max_tokens, limits, admit_every = _workload(seed)
    results = []
    for force_general in (False, True):
        sched, bm = _scheduler(limits)
        results.append(drive(sched, prompts, max_tokens, force_general, admit_every) + (bm.stats,))
    (fast_trace, fast_outputs, num_every_row, fast_stats), (trace, outputs, _, stats) = results
    assert num_every_row > 0  # the fast path ran
    assert fast_trace == trace and fast_outputs == outputs and fast_stats == stats


@pytest.mark.parametrize("seed", range(6))
def test_scheduling_one_step_ahead_gives_the_same_outputs(seed):
    prompts, max_tokens, limits, admit_every = _workload(seed)
    outputs = []
    for ahead in (False, True):
        sched, _ = _scheduler(limits)
        outputs.append(drive(sched, prompts, max_tokens, False, admit_every, ahead=ahead)[1])
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == n for tokens, n in zip(outputs[0].values(), max_tokens))


def test_a_request_at_its_length_limit_is_not_scheduled_again():
    sched = scheduler(32, 4, max_num_seqs=4, max_num_batched_tokens=64)
    a = Request(0, [1, 2, 3], SamplingParams(max_tokens=2), seed=0)
    b = Request(1, [4, 5, 6], SamplingParams(max_tokens=9), seed=1)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # both prompts; each gets its first token (pending)
    second = sched.schedule()  # scheduled ahead: a's 2nd token is its last one
    assert [r.request_id for r in second.requests] == [0, 1]
    third = sched.schedule()  # a is at its limit (2 output tokens sampled or pending): only b runs
    assert [r.request_id for r in third.requests] == [1]
    assert third.pending_sources.tolist() == [1]  # b's input is its token from the step before
    run_step(sched, first, sampled=9)
    run_step(sched, second, sampled=8)
    assert a.finished and a.finish_reason == "length" and a.output_token_ids == [9, 8]
    run_step(sched, third)
    assert b.output_token_ids == [9, 8, 7]


def test_decode_steps_are_dense_and_grow_tables_in_bulk():
    sched = scheduler(64, 4, max_num_seqs=4, max_num_batched_tokens=64)
    for rid in range(3):
        sched.add(make(rid, 3 + rid, first_token=10 * rid))  # prompts of 3, 4, 5 tokens
    run_step(sched, sched.schedule())  # the prompts: 4, 5, 6 tokens now
    step = sched.schedule()  # tokens at positions 3, 4, 5: rows 1 and 2 start their second block
    assert step.rows == slice(0, 3) and step.query_lens.tolist() == [1, 1, 1]
    assert sched.batch.num_pages[:3].tolist() == [1, 2, 2]
    assert [sched.block_manager.block_table(r.request_id) for r in step.requests] == \
        [sched.batch.block_table[s, :n].tolist() for s, n in zip(range(3), sched.batch.num_pages[:3].tolist())]
