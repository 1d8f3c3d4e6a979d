"""BlockManager and prefix hashes: hand-computed anchors, policy, errors, integrity checks."""
import struct
import tracemalloc

import numpy as np
import pytest
import torch
import xxhash

import atom_core.cache.block_manager as block_manager_module
from atom_core.cache.block_manager import HOST_BYTES_PER_BLOCK, BlockManager, PrefixCacheStats
from atom_core.cache.pool_sizing import InsufficientMemoryError
from atom_core.cache.prefix_hash import ROOT_PARENT_HASH, hash_block_tokens, hash_full_blocks

TEN = list(range(100, 110))  # a 10-token prompt: with block_size 4 -> blocks of 4, 4, 2


def _allocated_and_published(bm: BlockManager, seq_id, tokens):
    """Allocate and pretend one step computed every token."""
    cached = bm.allocate(seq_id, tokens)
    assert cached is not None
    bm.publish(seq_id, tokens, len(tokens))
    return cached


# ------------------------------------------------------------------ prefix_hash


def test_hash_is_xxh64_of_parent_and_int64_tokens():
    tokens = [1, 2, 3, 2**40]
    data = struct.pack("<Q", 12345) + struct.pack("<4q", *tokens)
    assert hash_block_tokens(12345, tokens) == xxhash.xxh64(data).intdigest()


def test_a_numpy_parent_hash_hashes_as_its_int_and_a_non_integer_one_is_refused():
    parent = np.array([2**63 + 5], dtype=np.uint64)[0]  # (a framework keeping its hashes in a uint64 array)
    assert hash_block_tokens(parent, [1, 2]) == hash_block_tokens(2**63 + 5, [1, 2])
    for bad in (5.0, True, "5"):
        with pytest.raises(TypeError, match="parent_hash must be an int"):
            hash_block_tokens(bad, [1, 2])


def test_hash_chains_on_the_parent():
    first = xxhash.xxh64(struct.pack("<Q", ROOT_PARENT_HASH) + struct.pack("<2q", 7, 8)).intdigest()
    second = xxhash.xxh64(struct.pack("<Q", first) + struct.pack("<2q", 9, 10)).intdigest()
    # 5 tokens with blocks of 2: two full blocks, the trailing token has no hash.
    assert hash_full_blocks([7, 8, 9, 10, 11], 2) == [first, second]
    assert hash_full_blocks([7], 2) == []


def test_hash_accepts_arrays_and_tensors():
    expected = hash_block_tokens(0, [5, 6, 7])
    assert hash_block_tokens(0, np.array([5, 6, 7], dtype=np.int32)) == expected
    assert hash_block_tokens(0, torch.tensor([5, 6, 7])) == expected


@pytest.mark.parametrize("parent", [-1, 2**64])
def test_hash_rejects_parent_out_of_range(parent):
    with pytest.raises(ValueError, match="parent_hash"):
        hash_block_tokens(parent, [1])


# ------------------------------------------------------------------ allocation anchors


def test_fresh_prompt_takes_ceil_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.allocate("a", TEN) == 0
    # ceil(10 / 4) = 3 blocks, handed out from the head of the free list.
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_free_blocks == 7
    bm.check_integrity()


def test_second_identical_prompt_hits_two_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", TEN)
    # Blocks 0, 1 are full and published; block 2 (tokens 8, 9) is partial.
    assert bm.num_cached_blocks == 2
    assert bm.allocate("b", TEN) == 8  # 2 blocks x 4 tokens
    assert bm.block_table("b") == [0, 1, 3]
    # 10 blocks - {0, 1, 2, 3} in use = 6 free; blocks 0 and 1 are shared.
    assert bm.num_free_blocks == 6
    bm.check_integrity()


def test_last_prompt_block_is_never_served():
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", TEN)
    # 8 tokens = exactly blocks 0 and 1, both cached; the second holds the last token -> 4.
    assert bm.allocate("b", TEN[:8]) == 4
    assert bm.block_table("b") == [0, 3]


def test_one_token_prompt_is_never_served():
    bm = BlockManager(num_blocks=4, block_size=1)
    _allocated_and_published(bm, "a", [5])
    assert bm.allocate("b", [5]) == 0
    # 2 tokens with block size 1: the first block may be served, the second not.
    assert bm.allocate("c", [5, 6]) == 1


def test_nothing_is_served_before_publish():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.allocate("a", TEN) == 0
    assert bm.allocate("b", TEN) == 0  # "a"'s step has not run yet
    bm.publish("a", TEN, 5)  # 5 computed tokens: only block 0 is whole
    assert bm.num_cached_blocks == 1
    assert bm.allocate("c", TEN) == 4


def test_publish_is_incremental_like_chunked_prefill():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("a", TEN)
    for computed, cached_blocks in [(3, 0), (4, 1), (7, 1), (8, 2), (10, 2)]:
        bm.publish("a", TEN, computed)
        assert bm.num_cached_blocks == cached_blocks, computed
    bm.check_integrity()


def test_hit_on_shared_running_block_increments_ref():
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", TEN)
    bm.allocate("b", TEN)
    assert bm._ref_counts[0] == bm._ref_counts[1] == 2
    bm.free("a")
    # Blocks 0 and 1 are still held by "b"; only "a"'s tail block 2 came back.
    assert bm.num_free_blocks == 7
    assert bm._ref_counts[0] == bm._ref_counts[1] == 1
    bm.check_integrity()


def test_freed_prefix_stays_reusable():
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", TEN)
    bm.free("a")
    assert bm.num_free_blocks == 10  # ref-0 blocks count as free, hashed or not
    assert bm.allocate("b", TEN) == 8
    assert bm.block_table("b")[:2] == [0, 1]
    assert bm.num_free_blocks == 7


def test_tail_evicted_first_and_empty_blocks_before_cached_ones():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = list(range(12))  # 3 full blocks
    _allocated_and_published(bm, "a", a)  # blocks 0, 1, 2, all hashed
    bm.free("a")  # free list: 3, 4, 5 (never used), then 2, 1, 0 (tail freed first)
    bm.allocate("b", [50] * 12)  # takes 3, 4, 5
    bm.allocate("c", [60])  # takes 2: "a"'s tail is evicted first
    assert bm.block_table("c") == [2]
    assert bm.num_cached_blocks == 2
    bm.free("b")  # unpublished, so 5, 4, 3 go to the head, before the cached 1, 0
    # "a" again: blocks 0, 1 hit (8 tokens), the new block is 3, not a cached one.
    assert bm.allocate("d", a) == 8
    assert bm.block_table("d") == [0, 1, 3]
    bm.check_integrity()


def test_duplicate_content_is_not_indexed_twice():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("a", TEN)
    bm.allocate("b", TEN)  # both before either step ran: no hit, separate blocks
    bm.publish("a", TEN, 10)
    bm.publish("b", TEN, 10)
    assert bm.num_cached_blocks == 2  # "a"'s blocks 0, 1; "b"'s copies stay unindexed
    bm.free("b")
    bm.free("a")
    bm.check_integrity()
    # "b"'s unindexed blocks are handed out before the cached ones.
    assert bm.allocate("c", [1] * 12) == 0
    assert not set(bm.block_table("c")) & {0, 1}
    assert bm.allocate("d", TEN) == 8


def test_append_slots_grows_by_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", [1, 2, 3, 4])
    assert bm.block_table("a") == [0]
    assert bm.append_slots("a", 4)  # already held
    assert bm.append_slots("a", 5) and bm.block_table("a") == [0, 1]
    assert bm.append_slots("a", 8) and bm.block_table("a") == [0, 1]
    assert not bm.append_slots("a", 13)  # needs 4 blocks, only 3 exist
    assert bm.block_table("a") == [0, 1] and bm.num_free_blocks == 1
    assert bm.append_slots("a", 12) and bm.num_free_blocks == 0


def test_allocate_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    _allocated_and_published(bm, "a", TEN)  # 3 blocks, 0 and 1 cached
    bm.free("a")
    bm.allocate("x", [7])  # takes "a"'s unhashed tail block 2; free list is now 3, 1, 0
    before = (bm.num_free_blocks, bm.stats, bm.num_cached_blocks)
    # 17 tokens sharing 2 cached blocks: ceil(17/4) = 5 blocks > 4.
    assert bm.allocate("b", TEN[:8] + [0] * 9) is None
    assert "b" not in bm
    assert (bm.num_free_blocks, bm.stats, bm.num_cached_blocks) == before
    bm.check_integrity()
    # 13 tokens: 2 hits + 2 new, but the free list (3, 1, 0) minus the hits 0, 1 leaves 1.
    assert bm.allocate("b", TEN[:8] + [0] * 5) is None
    assert bm.num_free_blocks == 3
    # 12 tokens: 2 hits + 1 new fits.
    assert bm.allocate("b", TEN[:8] + [0] * 4) == 8
    assert bm.num_free_blocks == 0
    bm.check_integrity()


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    _allocated_and_published(bm, "a", TEN)
    assert bm.num_cached_blocks == 0
    assert bm.allocate("b", TEN) == 0
    assert bm.stats == PrefixCacheStats()


def test_stats_count_blocks_and_tokens():
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", TEN)  # 9 // 4 = 2 eligible blocks, 0 hits
    bm.allocate("b", TEN)  # 2 eligible, 2 hits
    bm.allocate("c", TEN[:8])  # 7 // 4 = 1 eligible, 1 hit
    assert bm.stats == PrefixCacheStats(queries=5, hits=3, query_tokens=20, hit_tokens=12)
    assert bm.stats.hit_rate == pytest.approx(3 / 5)
    bm.reset_stats()
    assert bm.stats == PrefixCacheStats() and bm.stats.hit_rate == 0.0


def test_token_containers_are_interchangeable():
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", np.array(TEN, dtype=np.int32))
    assert bm.allocate("b", torch.tensor(TEN)) == 8
    assert bm.allocate("c", tuple(TEN)) == 8


# ------------------------------------------------------------------ collision guard


def test_collision_guard_compares_tokens(monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block_tokens", lambda parent, tokens: 7)
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", [1, 2, 3, 4, 0])
    # Same hash 7, other tokens: not a hit.
    assert bm.allocate("b", [9, 9, 9, 9, 0]) == 0
    assert bm.allocate("c", [1, 2, 3, 4, 0]) == 4
    bm.check_integrity()


def test_collision_guard_compares_parents(monkeypatch):
    # A hash that ignores the parent: equal blocks after different prefixes collide.
    monkeypatch.setattr(block_manager_module, "hash_block_tokens", lambda parent, tokens: sum(tokens))
    bm = BlockManager(num_blocks=10, block_size=2)
    _allocated_and_published(bm, "a", [1, 2, 5, 6, 0])  # hashes 3, 11 (parent 3)
    _allocated_and_published(bm, "e", [9, 8, 0])  # hash 17
    # Block 0 (9, 8) hits; block 1 (5, 6) hashes to 11 but was cached after (1, 2), not (9, 8).
    assert bm.allocate("b", [9, 8, 5, 6, 0]) == 2
    bm.check_integrity()


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "num_blocks, block_size, error, name",
    [
        (0, 4, ValueError, "num_blocks"),
        (-3, 4, ValueError, "num_blocks"),
        (4, 0, ValueError, "block_size"),
        (4, -1, ValueError, "block_size"),
        (4.0, 4, TypeError, "num_blocks"),
        (4, True, TypeError, "block_size"),
    ],
)
def test_constructor_rejects(num_blocks, block_size, error, name):
    with pytest.raises(error, match=name):
        BlockManager(num_blocks, block_size)


def test_double_allocate_raises_and_keeps_state():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("a", TEN)
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate("a", TEN)
    assert bm.block_table("a") == [0, 1, 2] and bm.num_free_blocks == 7


@pytest.mark.parametrize(
    "call",
    [
        lambda bm: bm.free("nope"),
        lambda bm: bm.block_table("nope"),
        lambda bm: bm.append_slots("nope", 4),
        lambda bm: bm.publish("nope", [1], 1),
    ],
    ids=["free", "block_table", "append_slots", "publish"],
)
def test_unknown_seq_id(call):
    bm = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="'nope'"):
        call(bm)


def test_free_twice_raises():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", [1])
    bm.free("a")
    with pytest.raises(ValueError, match="'a'"):
        bm.free("a")


def test_bad_prompts():
    bm = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="empty"):
        bm.allocate("a", [])
    with pytest.raises(ValueError, match="1-D"):
        bm.allocate("a", [[1, 2]])
    with pytest.raises(TypeError, match="integers"):
        bm.allocate("a", [1.5, 2.0])
    assert "a" not in bm and bm.num_free_blocks == 4


def test_publish_bounds():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", [1, 2, 3])  # one block: 4 slots
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.publish("a", [1, 2, 3], 4)  # more than the tokens given
    with pytest.raises(ValueError, match="slots"):
        bm.publish("a", [1, 2, 3, 4, 5], 5)  # more than the table holds


# ------------------------------------------------------------------ check_integrity can fail


def _corrupt_ref(bm):
    bm._ref_counts[0] += 1


def _corrupt_free_list(bm):
    del bm._free[next(iter(bm._free))]


def _corrupt_index(bm):
    bm._hash_to_block[12345] = 5


def _corrupt_stored_tokens(bm):
    block_id = bm.block_table("a")[0]
    parent, _, digest = bm._block_key[block_id]
    bm._block_key[block_id] = (parent, (0, 0, 0, 0), digest)


def _corrupt_table(bm):
    bm._seqs["a"].block_ids.append(bm._seqs["a"].block_ids[0])
    bm._ref_counts[bm._seqs["a"].block_ids[0]] += 1


@pytest.mark.parametrize(
    "corrupt", [_corrupt_ref, _corrupt_free_list, _corrupt_index, _corrupt_stored_tokens, _corrupt_table]
)
def test_check_integrity_detects(corrupt):
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", TEN)
    bm.check_integrity()
    corrupt(bm)
    with pytest.raises(AssertionError):
        bm.check_integrity()


# ------------------------------------------------------------------ host memory of the bookkeeping


def test_1e8_blocks_refused_by_name_in_gib_before_allocating_when_host_memory_is_smaller(monkeypatch):
    monkeypatch.setattr(block_manager_module, "host_memory_available_bytes", lambda: 8 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(InsufficientMemoryError) as err:
            BlockManager(num_blocks=10**8, block_size=16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    msg = str(err.value)
    assert "BlockManager(num_blocks=100000000)" in msg
    assert f"{10**8 * HOST_BYTES_PER_BLOCK / 2**30:.2f} GiB" in msg and "8.00 GiB of host memory" in msg
    assert peak < 1 << 20  # refused before the per-block lists (~15 GB) were built


def test_blocks_that_fit_the_host_memory_are_built(monkeypatch):
    monkeypatch.setattr(block_manager_module, "host_memory_available_bytes", lambda: 1000 * HOST_BYTES_PER_BLOCK)
    assert BlockManager(num_blocks=1000, block_size=4).num_free_blocks == 1000
    with pytest.raises(InsufficientMemoryError):
        BlockManager(num_blocks=1001, block_size=4)


def test_host_bytes_per_block_estimate_is_within_a_third_of_the_measured_bookkeeping():
    num_blocks = 100_000
    tracemalloc.start()
    try:
        bm = BlockManager(num_blocks=num_blocks, block_size=16)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert bm.num_free_blocks == num_blocks
    assert 0.67 * used <= num_blocks * HOST_BYTES_PER_BLOCK <= 1.33 * used


def test_allocate_without_the_cache_takes_fresh_blocks_and_still_publishes_them():
    bm = BlockManager(16, 4)
    tokens = list(range(9))
    bm.allocate("a", tokens)
    bm.publish("a", tokens, len(tokens))
    assert bm.allocate("b", tokens) == 8  # a hit: two full blocks
    assert bm.allocate("c", tokens, use_cache=False) == 0
    assert not set(bm.block_table("c")) & set(bm.block_table("a"))
    bm.publish("c", tokens, len(tokens))
    bm.free("a")
    bm.free("b")
    bm.free("c")
    bm.check_integrity()


def test_collision_guard_compares_the_whole_prefix_not_only_the_parents_hash(monkeypatch):
    # A hash equal for any order of a block's tokens: blocks (2, 1) and (1, 2) collide as first blocks.
    monkeypatch.setattr(block_manager_module, "hash_block_tokens",
                        lambda parent, tokens: hash((parent, tuple(sorted(int(t) for t in tokens)))) & (2**64 - 1))
    bm = BlockManager(num_blocks=16, block_size=2)
    _allocated_and_published(bm, "a", [2, 1, 0])  # (2, 1) holds the first blocks' shared hash
    # (1, 2) is not served (tokens differ) nor indexed (its hash is taken); (5, 6), computed after it, is.
    _allocated_and_published(bm, "b", [1, 2, 5, 6, 0])
    # (2, 1) hits; (5, 6) after (2, 1) was never computed: only the first block may be served.
    assert bm.allocate("c", [2, 1, 5, 6, 0]) == 2
    bm.check_integrity()


def test_a_block_computed_after_a_duplicate_of_its_prefix_is_served():
    bm = BlockManager(num_blocks=16, block_size=2)
    _allocated_and_published(bm, "a", [1, 2, 0])
    # "b" computes its own copy of (1, 2) (every block fresh), then (3, 4) after it: that copy is not indexed
    # (the hash is "a"'s block's), (3, 4) is; its prefix is the same content, so it is served after "a"'s copy.
    assert bm.allocate("b", [1, 2, 3, 4, 0], use_cache=False) == 0
    bm.publish("b", [1, 2, 3, 4, 0], 4)
    assert bm.allocate("c", [1, 2, 3, 4, 0]) == 4
    bm.check_integrity()


def test_a_refilled_parent_block_does_not_pass_for_the_content_it_held(monkeypatch):
    # First blocks (1, 2) and (2, 4) collide. (1, 2)'s block is handed out again, for (2, 4), while its child
    # (5, 6) stays cached: that child was computed after (1, 2), not (2, 4). (The free list hands out children
    # before their parents; the order is forced here.)
    monkeypatch.setattr(block_manager_module, "hash_block_tokens",
                        lambda parent, tokens: hash((parent, sum(int(t) for t in tokens) % 3)) & (2**64 - 1))
    bm = BlockManager(num_blocks=3, block_size=2)
    _allocated_and_published(bm, "a", [1, 2, 5, 6, 0])
    parent_block = bm.block_table("a")[0]
    bm.free("a")
    bm._free.move_to_end(parent_block, last=False)
    _allocated_and_published(bm, "b", [2, 4, 0])
    assert bm.block_table("b")[0] == parent_block and bm.num_cached_blocks == 2  # (2, 4) and the child
    bm.free("b")
    assert bm.allocate("c", [2, 4, 5, 6, 0]) == 2  # (2, 4) only
    bm.check_integrity()


# ------------------------------------------------------------------ reset_prefix_cache


def test_reset_prefix_cache_forgets_every_hash_so_a_cached_prompt_misses():
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", TEN)
    bm.free("a")
    assert bm.num_cached_blocks == 2
    assert bm.reset_prefix_cache() is True
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 10
    bm.check_integrity()
    assert bm.allocate("b", TEN) == 0  # it would have hit 8 tokens before the reset
    bm.check_integrity()


def test_reset_prefix_cache_keeps_the_stats_counters_and_the_free_count():
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", TEN)
    bm.allocate("b", TEN)
    bm.free("a"), bm.free("b")
    stats, num_free = bm.stats, bm.num_free_blocks
    assert bm.reset_prefix_cache()
    assert bm.stats == stats == PrefixCacheStats(queries=4, hits=2, query_tokens=16, hit_tokens=8)
    assert bm.num_free_blocks == num_free == 10
    bm.allocate("c", TEN)  # after the reset: counted as queried, not hit
    assert bm.stats == PrefixCacheStats(queries=6, hits=2, query_tokens=24, hit_tokens=8)


def test_reset_prefix_cache_is_refused_while_a_sequence_holds_blocks_and_changes_nothing():
    bm = BlockManager(num_blocks=10, block_size=4)
    _allocated_and_published(bm, "a", TEN)
    _allocated_and_published(bm, "b", list(range(8)))
    bm.free("b")
    cached, free, table = bm.num_cached_blocks, bm.num_free_blocks, bm.block_table("a")
    assert bm.reset_prefix_cache() is False
    assert (bm.num_cached_blocks, bm.num_free_blocks, bm.block_table("a")) == (cached, free, table)
    bm.check_integrity()
    assert bm.allocate("c", list(range(8)) + [9]) == 8  # still served
    bm.free("a"), bm.free("c")
    assert bm.reset_prefix_cache() is True


def test_reset_keeping_held_blocks_forgets_every_hash_and_the_holders_publish_nothing_after():
    bm = BlockManager(num_blocks=12, block_size=4)
    _allocated_and_published(bm, "a", TEN)         # held through the reset
    bm.allocate("b", list(range(8)))                # held, nothing published yet
    _allocated_and_published(bm, "old", [7] * 8)
    bm.free("old")
    table_a = bm.block_table("a")
    assert bm.reset_prefix_cache(keep_held=True) is True
    assert bm.num_cached_blocks == 0 and bm.block_table("a") == table_a
    bm.check_integrity()
    bm.publish("b", list(range(8)), 8)              # computed partly on the old weights: not published
    bm.publish_blocks(["a"], [2], np.array([[1, 2, 3, 4]]))  # (the bulk form likewise; no order check)
    assert bm.num_cached_blocks == 0
    assert bm.allocate("c", list(range(8))) == 0 and bm.allocate("d", TEN) == 0  # nothing served from before
    _allocated_and_published(bm, "e", [5] * 8)      # a sequence allocated after the reset publishes as usual
    bm.publish_blocks(["b", "c"], [0, 0], np.array([[0, 1, 2, 3], [0, 1, 2, 3]]))  # held b skipped, c published
    assert bm.num_cached_blocks == 3
    for seq_id in ("a", "b"):
        bm.free(seq_id)
    bm.check_integrity()
    assert bm.num_cached_blocks == 3                # the held sequences' blocks come back uncached
    assert bm.allocate("f", [5] * 8 + [9]) == 8 and bm.allocate("g", [0, 1, 2, 3, 9]) == 4


def test_reset_prefix_cache_of_an_empty_or_uncached_manager_succeeds():
    assert BlockManager(num_blocks=3, block_size=2).reset_prefix_cache()
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=False)
    _allocated_and_published(bm, "a", [1, 2, 3])
    assert not bm.reset_prefix_cache()
    bm.free("a")
    assert bm.reset_prefix_cache()
