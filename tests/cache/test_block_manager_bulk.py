"""The bulk forms (append_block_each, publish_blocks) equal the one-sequence calls they replace;
block_table(start=...)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_core.cache.block_manager import BlockManager

BS = 4
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def state(bm: BlockManager):
    """Everything observable about a manager, plus its index (white box: the bulk forms must leave
    exactly what the one-sequence calls leave)."""
    seqs = {seq_id: (list(s.block_ids), list(s.block_hashes)) for seq_id, s in bm._seqs.items()}
    return seqs, list(bm._free), dict(bm._hash_to_block), list(bm._block_key)


def twin_managers(prompts, num_blocks, enable_prefix_caching=True):
    """Two managers in the same state: each prompt allocated and fully published."""
    pair = []
    for _ in range(2):
        bm = BlockManager(num_blocks, BS, enable_prefix_caching)
        for seq_id, tokens in enumerate(prompts):
            assert bm.allocate(seq_id, tokens) is not None
            bm.publish(seq_id, tokens, len(tokens) // BS * BS)
        pair.append(bm)
    return pair


prompt_lists = st.lists(st.lists(st.integers(0, 5), min_size=BS, max_size=3 * BS), min_size=1, max_size=6)


@SETTINGS
@given(prompts=prompt_lists, spare=st.integers(0, 8), data=st.data())
def test_append_block_each_equals_append_slots_in_order(prompts, spare, data):
    needed = sum(-(-len(p) // BS) for p in prompts)  # blocks the prompts hold (no prefix sharing counted)
    one, bulk = twin_managers(prompts, needed + spare)
    order = data.draw(st.permutations(range(len(prompts))))
    grown = bulk.append_block_each(order)
    for seq_id in order:  # each needs one more block: its table's capacity plus one token
        if not one.append_slots(seq_id, len(one.block_table(seq_id)) * BS + 1):
            break
    assert state(bulk) == state(one)
    assert len(grown) == min(len(order), one.num_free_blocks + len(grown))  # served in order while blocks last
    assert grown == [bulk.block_table(seq_id)[-1] for seq_id in order[: len(grown)]]
    bulk.check_integrity()


@SETTINGS
@given(prompts=prompt_lists, caching=st.booleans(), data=st.data())
def test_publish_blocks_equals_publish(prompts, caching, data):
    one, bulk = twin_managers(prompts, 128, enable_prefix_caching=caching)
    # Every sequence computes 0-2 more full blocks; the bulk call lists them interleaved across
    # sequences (each sequence's in order), publish takes them sequence by sequence.
    new_blocks = {seq_id: data.draw(st.lists(st.lists(st.integers(0, 5), min_size=BS, max_size=BS), max_size=2))
                  for seq_id in range(len(prompts))}
    full = {seq_id: prompts[seq_id][: len(prompts[seq_id]) // BS * BS] for seq_id in new_blocks}
    entries = [(seq_id, len(full[seq_id]) // BS + j, block) for seq_id, blocks in new_blocks.items()
               for j, block in enumerate(blocks)]
    entries.sort(key=lambda e: (e[1], data.draw(st.integers(0, 3))))  # interleave, keep each sequence's order
    for bm in (one, bulk):
        for seq_id, blocks in new_blocks.items():
            assert bm.append_slots(seq_id, len(full[seq_id]) + BS * len(blocks))
    for seq_id, blocks in new_blocks.items():
        tokens = full[seq_id] + [t for block in blocks for t in block]
        one.publish(seq_id, tokens, len(tokens))
    bulk.publish_blocks([e[0] for e in entries], [e[1] for e in entries],
                        np.array([e[2] for e in entries], dtype=np.int32).reshape(len(entries), BS))
    # the index may name another block for a duplicate content (interleaving changes which is
    # first), but every sequence's hashes are the same
    assert {s: h for s, (_, h) in state(bulk)[0].items()} == {s: h for s, (_, h) in state(one)[0].items()}
    assert sorted(state(bulk)[2]) == sorted(state(one)[2])
    bulk.check_integrity()


@SETTINGS
@given(prompts=prompt_lists, data=st.data())
def test_publish_blocks_one_per_sequence_leaves_the_same_index(prompts, data):
    one, bulk = twin_managers(prompts, 64)
    order = data.draw(st.permutations(range(len(prompts))))
    new_blocks = {seq_id: data.draw(st.lists(st.integers(0, 5), min_size=BS, max_size=BS)) for seq_id in order}
    for bm in (one, bulk):
        for seq_id in order:
            assert bm.append_slots(seq_id, (len(prompts[seq_id]) // BS + 1) * BS)
    for seq_id in order:
        tokens = prompts[seq_id][: len(prompts[seq_id]) // BS * BS] + new_blocks[seq_id]
        one.publish(seq_id, tokens, len(tokens))
    indices = [len(prompts[seq_id]) // BS for seq_id in order]
    bulk.publish_blocks(order, indices, np.array([new_blocks[s] for s in order], dtype=np.int32))
    assert state(bulk) == state(one)


def test_publish_blocks_serves_later_prompts():
    bm = BlockManager(16, BS)
    bm.allocate("a", [1, 2, 3, 4, 5])  # block 0 = [1, 2, 3, 4] (published below), block 1 holds 5
    bm.publish("a", [1, 2, 3, 4, 5], 4)
    bm.publish_blocks(["a"], [1], np.array([[5, 6, 7, 8]]))
    # a prompt starting with both blocks: 2 blocks = 8 tokens from the cache
    assert bm.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_bulk_errors_change_nothing():
    bm = BlockManager(8, BS)
    bm.allocate("a", [1] * 6)
    bm.allocate("b", [2] * 6)
    before = state(bm)
    with pytest.raises(ValueError, match="'zzz' has no blocks"):
        bm.append_block_each(["a", "zzz"])
    with pytest.raises(ValueError, match="repeat"):
        bm.append_block_each(["a", "a"])
    with pytest.raises(ValueError, match="must be \\[2, 4\\]"):
        bm.publish_blocks(["a", "b"], [1, 1], np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(TypeError, match="integers"):
        bm.publish_blocks(["a"], [1], np.zeros((1, BS)))
    with pytest.raises(ValueError, match="block 1 of seq_id 'b' is out of order: its next block to publish is 0"):
        bm.publish_blocks(["a", "b"], [0, 1], np.zeros((2, BS), dtype=np.int64))  # b has 0 published
    with pytest.raises(ValueError, match="block 0 of seq_id 'a' is out of order: .* is 1"):
        bm.publish_blocks(["a", "a"], [0, 0], np.zeros((2, BS), dtype=np.int64))
    with pytest.raises(ValueError, match="block 2 of seq_id 'a'"):
        bm.publish_blocks(["a"], [2], np.zeros((1, BS), dtype=np.int64))  # a holds 2 blocks
    with pytest.raises(ValueError, match="'zzz' has no blocks"):
        bm.publish_blocks(["zzz"], [0], np.zeros((1, BS), dtype=np.int64))
    assert state(bm) == before
    assert bm.append_block_each([]) == []


def test_block_table_from_a_page():
    bm = BlockManager(8, BS)
    bm.allocate("a", list(range(10)))  # ceil(10 / 4) = 3 blocks: 0, 1, 2
    assert bm.block_table("a", start=1) == [1, 2]
    assert bm.block_table("a", start=3) == []
    table = bm.block_table("a", start=0)
    table.append(99)  # a copy
    assert bm.block_table("a") == [0, 1, 2]
    with pytest.raises(ValueError, match="start"):
        bm.block_table("a", start=-1)
