"""RunningBatch: dense rows, parameters written at admission, rows moved on removal."""

import numpy as np
import pytest

from atom_core.engine.request import Request
from atom_core.engine.running_batch import RunningBatch
from atom_core.engine.sampling_params import SamplingParams


def make(rid, tokens, **params):
    request = Request(rid, tokens, SamplingParams(**params), seed=100 + rid)
    request.length_limit = min(request.length_limit, 32)
    return request


def test_add_writes_progress_table_and_parameters():
    batch = RunningBatch(max_num_seqs=4, max_model_len=32, max_pages=8)
    r = make(0, [5, 6, 7, 8, 9], temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, max_tokens=7, ignore_eos=True,
             logprobs=0)
    assert batch.add(r, [11, 12], num_computed_tokens=4, num_published_blocks=1) == 0 and r.row == 0
    assert batch.block_table[0, :3].tolist() == [11, 12, -1]
    assert (batch.num_tokens[0], batch.num_computed_tokens[0], batch.num_prompt_tokens[0]) == (5, 4, 5)
    assert batch.last_token[0] == 9 and batch.pending_index[0] == -1 and batch.num_published_blocks[0] == 1
    assert batch.temperature[0] == np.float32(0.5) and batch.top_k[0] == 3 and batch.seed[0] == 100
    assert batch.length_limit[0] == 12 and batch.checks_every_token[0]  # logprobs: every token is looked at
    assert not batch.stops_at_eos[0] and batch.wants_logprobs[0]
    counts = (batch.num_using_top_k, batch.num_using_top_p, batch.num_using_min_p, batch.num_stopping_at_eos)
    assert counts == (1, 1, 1, 0)


def test_rows_are_checked_every_token_only_with_stop_strings_stop_ids_or_logprobs():
    batch = RunningBatch(max_num_seqs=4, max_model_len=10, max_pages=3)
    batch.add(make(0, [1] * 6, max_tokens=20), [0, 1], 0, 0)
    batch.add(make(1, [1] * 2, stop="x"), [2], 0, 0)
    batch.add(make(2, [1] * 2, stop_token_ids=[4]), [3], 0, 0)
    batch.add(make(3, [1] * 2, logprobs=1), [4], 0, 0)
    assert batch.checks_every_token[:4].tolist() == [False, True, True, True]


def test_remove_moves_the_last_row_into_the_hole():
    batch = RunningBatch(max_num_seqs=3, max_model_len=16, max_pages=4)
    a, b, c = make(0, [1, 1]), make(1, [2, 2, 2, 2, 2]), make(2, [3, 3, 3], top_k=5)
    batch.add(a, [7], 0, 0)
    batch.add(b, [8, 9], 4, 1)
    batch.add(c, [10], 2, 0)
    batch.pending_index[2] = 5
    batch.remove(a)
    assert batch.requests == [c, b] and (c.row, b.row, a.row) == (0, 1, None) and batch.num_removals == 1
    assert batch.block_table[0, :2].tolist() == [10, -1] and (batch.block_table[2] == -1).all()
    assert (batch.num_tokens[0], batch.num_computed_tokens[0], batch.top_k[0], batch.pending_index[0]) == (3, 2, 5, 5)
    assert batch.last_token[0] == 3 and batch.admission_order[:2].tolist() == [2, 1]
    batch.remove(b)  # the last row: nothing moves
    assert batch.requests == [c] and batch.num_using_top_k == 1
    batch.add(a, [7], 0, 0)  # re-admitted: the newest
    assert a.row == 1 and batch.admission_order[1] == 3


def test_append_blocks():
    batch = RunningBatch(max_num_seqs=3, max_model_len=16, max_pages=4)
    for rid in range(3):
        batch.add(make(rid, [1] * 4), [rid], 0, 0)
    batch.append_blocks(1, [20, 21])
    batch.append_block_each(np.array([0, 2]), [30, 32])
    assert batch.block_table[:, :3].tolist() == [[0, 30, -1], [1, 20, 21], [2, 32, -1]]
    assert batch.num_pages.tolist() == [2, 3, 2]


def test_errors():
    batch = RunningBatch(max_num_seqs=1, max_model_len=8, max_pages=2)
    r = make(0, [1] * 5)
    with pytest.raises(ValueError, match="more than max_model_len=8"):
        batch.add(make(1, [1] * 9), [0, 1, 2], 0, 0)
    with pytest.raises(ValueError, match="3 blocks, more than the 2 pages"):
        batch.add(make(1, [1] * 8), [0, 1, 2], 0, 0)
    with pytest.raises(ValueError, match="5 of 5 tokens computed"):
        batch.add(r, [0, 1], 5, 0)
    batch.add(r, [0, 1], 0, 0)
    with pytest.raises(ValueError, match="already holds row 0"):
        batch.add(r, [0, 1], 0, 0)
    with pytest.raises(ValueError, match="no free row"):
        batch.add(make(2, [1]), [2], 0, 0)
    with pytest.raises(ValueError, match="holds no row"):
        batch.remove(make(3, [1]))
    with pytest.raises(ValueError, match="must all be >= 1"):
        RunningBatch(max_num_seqs=0, max_model_len=8, max_pages=2)


def test_token_state_slots_follow_their_request_and_are_reused():
    batch = RunningBatch(max_num_seqs=3, max_model_len=32, max_pages=4)
    a, b, c = make(0, [1, 2], repetition_penalty=1.2), make(1, [3]), make(2, [4], allowed_token_ids=[4, 5])
    for request in (a, b, c):
        batch.add(request, [request.request_id], 0, 0)
    slot_a, slot_c = int(batch.token_state_slot[0]), int(batch.token_state_slot[2])
    assert batch.token_state_slot[1] == -1 and slot_a >= 0 and slot_c >= 0 and slot_a != slot_c
    assert [(r.request_id, s) for r, s in batch.new_slots] == [(0, slot_a), (2, slot_c)]
    assert (batch.num_using_penalties, batch.repetition_penalty[0]) == (2, np.float32(1.2))
    batch.new_slots = []  # what a step's logits processing takes
    batch.remove(a)  # c moves into row 0 with its slot
    assert c.row == 0 and batch.token_state_slot[0] == slot_c and batch.token_state_slot[2] == -1
    d = make(3, [6], presence_penalty=0.5)
    batch.add(d, [3], 0, 0)
    assert batch.token_state_slot[d.row] == slot_a  # the freed slot, set again for d by the next step
    batch.remove(d)
    assert batch.new_slots == [] and batch.num_using_penalties == 1  # d's pending set-up left with it
