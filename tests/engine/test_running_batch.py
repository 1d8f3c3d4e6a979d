"""RunningBatch: dense slots, the request's view of its slot, parameters written at admission."""

import numpy as np
import pytest

from atom_core.engine.request import Request
from atom_core.engine.running_batch import RunningBatch
from atom_core.engine.sampling_params import SamplingParams


def make(rid, tokens, **params):
    return Request(rid, tokens, SamplingParams(**params), seed=100 + rid)


def test_add_writes_tokens_table_and_parameters():
    batch = RunningBatch(max_num_seqs=4, max_model_len=32, block_size=4)
    r = make(0, [5, 6, 7, 8, 9], temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, max_tokens=7, ignore_eos=True,
             logprobs=0)
    assert batch.add(r, [11, 12], num_computed_tokens=4) == 0 and r.slot == 0
    assert batch.token_ids[0, :5].tolist() == [5, 6, 7, 8, 9]
    assert batch.block_table[0, :3].tolist() == [11, 12, -1]
    assert (batch.num_tokens[0], batch.num_computed_tokens[0], batch.num_prompt_tokens[0]) == (5, 4, 5)
    assert batch.temperature[0] == np.float32(0.5) and batch.top_k[0] == 3 and batch.seed[0] == 100
    assert batch.check_from_len[0] == 0  # logprobs: every token is looked at
    assert not batch.stops_at_eos[0] and batch.wants_logprobs[0]
    counts = (batch.num_using_top_k, batch.num_using_top_p, batch.num_using_min_p, batch.num_stopping_at_eos)
    assert counts == (1, 1, 1, 0)
    # the request reads its progress from the slot
    batch.num_computed_tokens[0] = 5
    assert r.num_computed_tokens == 5 and r.num_tokens == 5


def test_rows_are_checked_from_their_length_limit_or_every_token():
    batch = RunningBatch(max_num_seqs=4, max_model_len=10, block_size=4)
    batch.add(make(0, [1] * 6, max_tokens=20), [0, 1], 0)
    batch.add(make(1, [1] * 2, max_tokens=3), [2], 0)
    batch.add(make(2, [1] * 2, stop="x"), [3], 0)
    batch.add(make(3, [1] * 2, stop_token_ids=[4]), [4], 0)
    # min(6 + 20, max_model_len 10) = 10; 2 + 3 = 5; stop strings / stop tokens: 0 (every token)
    assert batch.check_from_len[:4].tolist() == [10, 5, 0, 0]


def test_tokens_written_to_the_slot_reach_the_request_and_stay_after_remove():
    batch = RunningBatch(max_num_seqs=2, max_model_len=16, block_size=4)
    r = make(0, [1, 2, 3])
    batch.add(r, [0], 3)
    batch.token_ids[0, 3:5] = [40, 41]  # what Scheduler.update does after two steps
    batch.num_tokens[0] = 5
    assert r.token_ids == [1, 2, 3, 40, 41] and r.output_token_ids == [40, 41] and r.num_output_tokens == 2
    batch.token_ids[0, 5] = 42
    batch.num_tokens[0] = 6
    batch.remove(r)
    assert r.slot is None and r.token_ids == [1, 2, 3, 40, 41, 42] and r.num_computed_tokens == 3
    assert r.prompt_token_ids == [1, 2, 3]
    assert (batch.block_table[0] == -1).all() and batch.num_rows == 0


def test_remove_moves_the_last_slot_into_the_hole():
    batch = RunningBatch(max_num_seqs=3, max_model_len=16, block_size=4)
    a, b, c = make(0, [1, 1]), make(1, [2, 2, 2, 2, 2]), make(2, [3, 3, 3], top_k=5)
    batch.add(a, [7], 0)
    batch.add(b, [8, 9], 4)
    batch.add(c, [10], 2)
    batch.remove(a)
    assert batch.requests == [c, b] and (c.slot, b.slot) == (0, 1)
    assert batch.token_ids[0, :3].tolist() == [3, 3, 3] and c.token_ids == [3, 3, 3]
    assert batch.block_table[0, :2].tolist() == [10, -1] and (batch.block_table[2] == -1).all()
    assert (batch.num_tokens[0], batch.num_computed_tokens[0], batch.top_k[0]) == (3, 2, 5)
    assert batch.admission_order[:2].tolist() == [2, 1]
    batch.remove(b)  # the last slot: nothing moves
    assert batch.requests == [c] and batch.num_using_top_k == 1
    batch.add(a, [7], 0)  # re-admitted: the newest
    assert a.slot == 1 and batch.admission_order[1] == 3


def test_append_blocks():
    batch = RunningBatch(max_num_seqs=3, max_model_len=16, block_size=4)
    for rid in range(3):
        batch.add(make(rid, [1] * 4), [rid], 0)
    batch.append_blocks(1, [20, 21])
    batch.append_block_each(np.array([0, 2]), [30, 32])
    assert batch.block_table[:, :3].tolist() == [[0, 30, -1], [1, 20, 21], [2, 32, -1]]
    assert batch.num_pages.tolist() == [2, 3, 2]


def test_errors():
    batch = RunningBatch(max_num_seqs=1, max_model_len=8, block_size=4)
    r = make(0, [1] * 5)
    with pytest.raises(ValueError, match="1 blocks of 4 for 5 tokens"):
        batch.add(r, [0], 0)
    with pytest.raises(ValueError, match="more than max_model_len=8"):
        batch.add(make(1, [1] * 9), [0, 1, 2], 0)
    with pytest.raises(ValueError, match="3 blocks, more than the 2 pages"):
        batch.add(make(1, [1] * 8), [0, 1, 2], 0)
    batch.add(r, [0, 1], 0)
    with pytest.raises(ValueError, match="already holds slot 0"):
        batch.add(r, [0, 1], 0)
    with pytest.raises(ValueError, match="no free slot"):
        batch.add(make(2, [1]), [2], 0)
    with pytest.raises(ValueError, match="holds no slot"):
        batch.remove(make(3, [1]))
    with pytest.raises(ValueError, match="must all be >= 1"):
        RunningBatch(max_num_seqs=0, max_model_len=8, block_size=4)
