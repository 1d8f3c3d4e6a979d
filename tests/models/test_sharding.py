"""Shard arithmetic: every rank's piece, over 1/2/4/8 ranks, tiles the full dimension exactly once."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_core.models.layers.sharding import (
    check_tp,
    padded_vocab_size,
    qkv_shard,
    shard_range,
    vocab_shard,
)

TP_SIZES = st.sampled_from([1, 2, 4, 8])
SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(tp_size=TP_SIZES, per_rank=st.integers(1, 50))
def test_shard_range_tiles_the_dimension(tp_size, per_rank):
    total = tp_size * per_rank
    covered = []
    for rank in range(tp_size):
        start, size = shard_range(total, rank, tp_size)
        assert size == per_rank
        covered.extend(range(start, start + size))
    assert covered == list(range(total))  # in order, each index once


def test_shard_range_anchor():
    # 12 rows over 4 ranks: rank 2 holds rows 6, 7, 8 -> start 2 * 3 = 6, size 12 / 4 = 3
    assert shard_range(12, 2, 4) == (6, 3)


@pytest.mark.parametrize("total,tp_size", [(10, 4), (3, 2), (7, 8)])
def test_shard_range_refuses_uneven_split(total, tp_size):
    with pytest.raises(ValueError, match="not divisible"):
        shard_range(total, 0, tp_size)


@pytest.mark.parametrize("rank,size", [(-1, 2), (2, 2), (0, 0), (0, 1.5), (True, 2)])
def test_check_tp_refuses_bad_rank_or_size(rank, size):
    with pytest.raises(ValueError, match="tp_"):
        check_tp(rank, size)


@st.composite
def attention_shapes(draw):
    tp_size = draw(TP_SIZES)
    group = draw(st.sampled_from([1, 2, 4, 8]))  # query heads per KV head
    if draw(st.booleans()):
        num_kv_heads = tp_size * draw(st.integers(1, 3))  # at least one KV head per rank
    else:
        num_kv_heads = draw(st.sampled_from([k for k in (1, 2, 4, 8) if k <= tp_size and tp_size % k == 0]))
    num_heads = num_kv_heads * group
    if num_heads % tp_size:
        num_heads *= tp_size
    return num_heads, num_kv_heads, draw(st.sampled_from([4, 64, 128])), tp_size


@SETTINGS
@given(shape=attention_shapes())
def test_qkv_shard_query_heads_tile_and_kv_heads_match_gqa(shape):
    num_heads, num_kv_heads, head_dim, tp_size = shape
    group = num_heads // num_kv_heads
    q_heads, kv_heads = [], []
    for rank in range(tp_size):
        s = qkv_shard(num_heads, num_kv_heads, head_dim, rank, tp_size)
        mine_q = list(range(s.q_start, s.q_start + s.num_heads))
        mine_kv = list(range(s.kv_start, s.kv_start + s.num_kv_heads))
        q_heads.extend(mine_q)
        kv_heads.extend(mine_kv)
        assert s.q_size == s.num_heads * head_dim and s.kv_size == s.num_kv_heads * head_dim
        # The rank must hold exactly the KV heads its query heads read under GQA (h // group).
        assert sorted({h // group for h in mine_q}) == mine_kv
    assert q_heads == list(range(num_heads))
    if num_kv_heads >= tp_size:
        assert kv_heads == list(range(num_kv_heads))
    else:
        # Each KV head replicated on tp_size / num_kv_heads ranks, one head per rank.
        assert sorted(kv_heads) == sorted(list(range(num_kv_heads)) * (tp_size // num_kv_heads))


def test_qkv_shard_anchor_replicated_kv():
    # 8 query heads, 2 KV heads, 4 ranks: 2 query heads per rank; rank 3 holds query heads 6, 7,
    # which read KV head 6 // 4 = 1; each KV head lives on 4 / 2 = 2 ranks.
    s = qkv_shard(8, 2, 16, 3, 4)
    assert (s.num_heads, s.q_start, s.num_kv_heads, s.kv_start, s.kv_replicas) == (2, 6, 1, 1, 2)


@pytest.mark.parametrize("heads,kv,tp", [(6, 6, 4), (8, 3, 2), (12, 3, 4), (8, 8, 3)])
def test_qkv_shard_refuses_uneven(heads, kv, tp):
    with pytest.raises(ValueError):
        qkv_shard(heads, kv, 8, 0, tp)


@SETTINGS
@given(tp_size=TP_SIZES, vocab=st.integers(1, 300))
def test_vocab_shards_tile_the_padded_vocab(tp_size, vocab):
    padded = padded_vocab_size(vocab, tp_size)
    assert padded % tp_size == 0 and vocab <= padded < vocab + tp_size
    ids, real = [], []
    for rank in range(tp_size):
        start, rows, real_rows = vocab_shard(vocab, rank, tp_size)
        ids.extend(range(start, start + rows))
        real.extend(range(start, start + real_rows))
    assert ids == list(range(padded))
    assert real == list(range(vocab))  # every real token on exactly one rank


def test_vocab_shard_anchor():
    # 10 tokens over 4 ranks -> padded to 12, 3 rows each; rank 3 holds ids 9..11 of which only 9 exists.
    assert vocab_shard(10, 3, 4) == (9, 3, 1)
