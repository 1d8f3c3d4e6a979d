"""build_step_layout and its decode fast path build_decode_layout: hand-computed anchors, property tests
against the naive twin, errors."""

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_core.cache.token_layout import StepLayout, build_decode_layout, build_step_layout
from tests.cache.layout_twins import BLOCK_SIZES, Batch, batches, twin_pages_used, twin_step_layout

PROPERTY_SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

EXPECTED_DTYPES = {
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "cu_seqlens_q": torch.int32,
    "cu_seqlens_k": torch.int32,
    "context_lens": torch.int32,
    "block_tables": torch.int32,
    "logits_indices": torch.int64,
    "is_prefill": torch.bool,
    "row_order": torch.int32,
}
TENSOR_FIELDS = tuple(EXPECTED_DTYPES)
INT_FIELDS = ("max_seqlen_q", "max_seqlen_k", "num_prefill_rows", "num_decode_rows")


def assert_layout_equals(layout: StepLayout, expected: dict) -> None:
    for name in TENSOR_FIELDS:
        tensor = getattr(layout, name)
        assert tensor.dtype == EXPECTED_DTYPES[name], name
        assert tensor.device.type == "cpu", name
        assert tensor.tolist() == expected[name], name
    for name in INT_FIELDS:
        value = getattr(layout, name)
        assert type(value) is int, name
        assert value == expected[name], name


def as_form(batch: Batch, lengths_form: str, table_form: str, extra_columns: int):
    """The batch's inputs as lists, numpy arrays or tensors; tables ragged or padded with -1."""
    query, cached = batch.query_lens, batch.cached_lens
    if lengths_form == "numpy":
        query, cached = np.array(query, dtype=np.int32), np.array(cached, dtype=np.int64)
    elif lengths_form == "torch":
        query, cached = torch.tensor(query, dtype=torch.int64), torch.tensor(cached, dtype=torch.int32)
    if table_form == "ragged":
        return query, cached, batch.block_tables
    width = max((len(row) for row in batch.block_tables), default=0) + extra_columns
    padded = [row + [-1] * (width - len(row)) for row in batch.block_tables]
    if table_form == "ragged_padded":  # e.g. a padded tensor's .tolist()
        return query, cached, padded
    array = np.array(padded, dtype=np.int32).reshape(len(padded), width)
    return query, cached, (array if table_form == "numpy" else torch.from_numpy(array))


# --- hand-computed anchors ----------------------------------------------------------------------


def test_decode_at_end_of_third_block():
    # block size 16, blocks [5, 6, 7]; position 47 is page 47 // 16 = 2 (block 7), offset 15:
    # slot = 7 * 16 + 15 = 127
    layout = build_step_layout([1], [47], [[5, 6, 7]], 16)
    assert layout.positions.tolist() == [47]
    assert layout.slot_mapping.tolist() == [127]
    assert layout.context_lens.tolist() == [48]
    assert layout.is_prefill.tolist() == [False]


def test_chunked_prefill_second_chunk():
    # cached 16, query 8, block size 16, blocks [3, 9]: positions 16..23 all on page 1 (block 9),
    # offsets 0..7 -> slots 9 * 16 + 0 .. 9 * 16 + 7 = 144..151
    layout = build_step_layout([8], [16], [[3, 9]], 16)
    assert layout.positions.tolist() == list(range(16, 24))
    assert layout.slot_mapping.tolist() == list(range(144, 152))
    assert layout.is_prefill.tolist() == [True]


def test_block_size_three_crosses_a_page():
    # block size 3, blocks [10, 11], cached 2, query 3: positions 2, 3, 4
    # 2 -> page 0 offset 2 -> 10*3+2 = 32; 3 -> page 1 offset 0 -> 11*3+0 = 33; 4 -> 11*3+1 = 34
    layout = build_step_layout([3], [2], [[10, 11]], 3)
    assert layout.slot_mapping.tolist() == [32, 33, 34]


def test_block_size_one_every_token_its_own_block():
    # block size 1, blocks [9, 4, 7], cached 1, query 2: positions 1, 2 -> blocks 4, 7 -> slots 4, 7
    layout = build_step_layout([2], [1], [[9, 4, 7]], 1)
    assert layout.slot_mapping.tolist() == [4, 7]


def test_slot_beyond_int32():
    # block id 2**31 // 16 + 5 = 134217728 + 5 = 134217733, block size 64:
    # 134217728 * 64 = 2**27 * 2**6 = 2**33 = 8589934592; + 5 * 64 = 320 -> 8589934912 (> 2**31)
    # query 3 from scratch -> slots 8589934912, ...913, ...914
    layout = build_step_layout([3], [0], [[2**31 // 16 + 5]], 64)
    assert layout.slot_mapping.tolist() == [8589934912, 8589934913, 8589934914]


def test_mixed_batch_offsets():
    # rows: prefill 3 from scratch on [1]; decode at position 47 on [5, 6, 7]; chunk cached 16 + 8 on [3, 9]
    # cu_seqlens_q = [0, 3, 3+1=4, 4+8=12]; context_lens = [3, 48, 24]; cu_seqlens_k = [0, 3, 51, 75]
    # logits_indices = cu_seqlens_q[1:] - 1 = [2, 3, 11]
    layout = build_step_layout([3, 1, 8], [0, 47, 16], [[1], [5, 6, 7], [3, 9]], 16)
    assert layout.cu_seqlens_q.tolist() == [0, 3, 4, 12]
    assert layout.cu_seqlens_k.tolist() == [0, 3, 51, 75]
    assert layout.context_lens.tolist() == [3, 48, 24]
    assert layout.logits_indices.tolist() == [2, 3, 11]
    assert layout.is_prefill.tolist() == [True, False, True]
    assert (layout.max_seqlen_q, layout.max_seqlen_k) == (8, 48)
    assert (layout.num_prefill_rows, layout.num_decode_rows) == (2, 1)
    # slots: row 0 -> 1*16 + 0..2 = 16..18; row 1 -> 127; row 2 -> 144..151
    assert layout.slot_mapping.tolist() == [16, 17, 18, 127] + list(range(144, 152))
    assert layout.block_tables.tolist() == [[1, -1, -1], [5, 6, 7], [3, 9, -1]]
    assert (layout.num_rows, layout.num_tokens) == (3, 12)


def test_mixed_batch_padded():
    # the batch above padded to 5 rows and 4 pages: two pad rows of one token each,
    # cu_seqlens_q = [0, 3, 4, 12, 13, 14], cu_seqlens_k stays at 75, logits of pads at 12 and 13
    layout = build_step_layout([3, 1, 8], [0, 47, 16], [[1], [5, 6, 7], [3, 9]], 16, pad_rows_to=5, pad_pages_to=4)
    assert layout.cu_seqlens_q.tolist() == [0, 3, 4, 12, 13, 14]
    assert layout.cu_seqlens_k.tolist() == [0, 3, 51, 75, 75, 75]
    assert layout.positions.tolist()[-2:] == [0, 0]
    assert layout.slot_mapping.tolist()[-2:] == [-1, -1]
    assert layout.logits_indices.tolist() == [2, 3, 11, 12, 13]
    assert layout.is_prefill.tolist() == [True, False, True, False, False]
    assert (layout.num_prefill_rows, layout.num_decode_rows) == (2, 3)
    assert layout.block_tables.tolist() == [[1, -1, -1, -1], [5, 6, 7, -1], [3, 9, -1, -1], [-1] * 4, [-1] * 4]


def test_prefill_of_one_token_is_prefill_and_decode_needs_a_cache():
    # query 1 with nothing cached is a (tiny) prefill; query 1 on a cached context is decode
    layout = build_step_layout([1, 1], [0, 1], [[0], [1]], 16)
    assert layout.is_prefill.tolist() == [True, False]


def test_empty_batch():
    layout = build_step_layout([], [], [], 16)
    assert layout.num_tokens == 0 and layout.num_rows == 0
    assert layout.cu_seqlens_q.tolist() == [0] and layout.cu_seqlens_k.tolist() == [0]
    assert (layout.max_seqlen_q, layout.max_seqlen_k) == (0, 0)
    assert tuple(layout.block_tables.shape) == (0, 0)
    for name, dtype in EXPECTED_DTYPES.items():
        assert getattr(layout, name).dtype == dtype, name


def test_empty_batch_padded_to_a_bucket():
    layout = build_step_layout([], [], np.zeros((0, 0), dtype=np.int32), 16, pad_rows_to=2, pad_pages_to=3)
    assert layout.positions.tolist() == [0, 0]
    assert layout.slot_mapping.tolist() == [-1, -1]
    assert layout.cu_seqlens_q.tolist() == [0, 1, 2]
    assert layout.block_tables.tolist() == [[-1] * 3] * 2


def test_to_moves_tensors_and_keeps_ints():
    layout = build_step_layout([3, 1], [0, 5], [[2], [4]], 16)
    moved = layout.to("meta")
    for name in TENSOR_FIELDS:
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(moved, name).dtype == EXPECTED_DTYPES[name], name
    for name in INT_FIELDS:
        assert getattr(moved, name) == getattr(layout, name)
    assert layout.positions.device.type == "cpu"  # the original is untouched
    assert layout.to("cpu").slot_mapping.tolist() == layout.slot_mapping.tolist()


# --- properties ---------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    batch=batches(),
    lengths_form=st.sampled_from(["list", "numpy", "torch"]),
    table_form=st.sampled_from(["ragged", "ragged_padded", "numpy", "torch"]),
    extra_columns=st.integers(0, 3),
    extra_rows=st.none() | st.integers(0, 4),
    extra_pages=st.none() | st.integers(0, 3),
)
def test_matches_twin(batch, lengths_form, table_form, extra_columns, extra_rows, extra_pages):
    width = max((len(row) for row in batch.block_tables), default=0)
    pad_rows_to = None if extra_rows is None else len(batch.query_lens) + extra_rows
    pad_pages_to = None if extra_pages is None else width + extra_pages
    query, cached, tables = as_form(batch, lengths_form, table_form, extra_columns)
    layout = build_step_layout(
        query, cached, tables, batch.block_size, pad_rows_to=pad_rows_to, pad_pages_to=pad_pages_to
    )
    expected = twin_step_layout(
        batch.query_lens, batch.cached_lens, batch.block_tables, batch.block_size, pad_rows_to, pad_pages_to
    )
    assert_layout_equals(layout, expected)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_matches_twin_at_each_block_size(block_size, data):
    # the mixed test draws block sizes unevenly; this pins each one
    batch = data.draw(batches(block_size=block_size, min_rows=1))
    layout = build_step_layout(batch.query_lens, batch.cached_lens, batch.block_tables, block_size)
    expected = twin_step_layout(batch.query_lens, batch.cached_lens, batch.block_tables, block_size)
    assert_layout_equals(layout, expected)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), extra_rows=st.none() | st.integers(0, 3))
def test_contract_properties(batch, extra_rows):
    num_real = len(batch.query_lens)
    pad_rows_to = None if extra_rows is None else num_real + extra_rows
    layout = build_step_layout(
        batch.query_lens, batch.cached_lens, batch.block_tables, batch.block_size, pad_rows_to=pad_rows_to
    )
    bs = batch.block_size
    positions = layout.positions.numpy()
    slots = layout.slot_mapping.numpy()
    cu_q = layout.cu_seqlens_q.numpy().astype(np.int64)
    cu_k = layout.cu_seqlens_k.numpy().astype(np.int64)
    context = layout.context_lens.numpy().astype(np.int64)

    assert len(positions) == len(slots) == cu_q[-1] == layout.num_tokens
    assert len(cu_q) == len(cu_k) == layout.num_rows + 1 == len(layout.is_prefill) + 1
    assert (np.diff(cu_k) == context).all()
    assert (layout.logits_indices.numpy() == cu_q[1:] - 1).all()
    assert layout.num_prefill_rows + layout.num_decode_rows == layout.num_rows

    live = slots != -1
    assert live.sum() == cu_q[num_real]  # every real token writes, no pad token does
    assert len(np.unique(slots[live])) == live.sum()  # no two live tokens share a slot
    for r in range(num_real):
        row_slots = slots[cu_q[r] : cu_q[r + 1]]
        row_positions = positions[cu_q[r] : cu_q[r + 1]]
        # each slot in a block of the row's own table, at the offset its position dictates
        assert set((row_slots // bs).tolist()) <= set(batch.block_tables[r])
        assert ((row_slots % bs) == (row_positions % bs)).all()
        # query tokens are the last query_lens[r] of the context, in order
        assert row_positions.tolist() == list(range(context[r] - (cu_q[r + 1] - cu_q[r]), context[r]))
        assert twin_pages_used(context[r], bs) <= (layout.block_tables[r] >= 0).sum()


@PROPERTY_SETTINGS
@given(batch=batches(), extra_rows=st.integers(0, 4), extra_pages=st.integers(0, 3))
def test_padding_leaves_real_rows_unchanged(batch, extra_rows, extra_pages):
    num_real = len(batch.query_lens)
    args = (batch.query_lens, batch.cached_lens, batch.block_tables, batch.block_size)
    plain = build_step_layout(*args)
    width = plain.block_tables.shape[1]
    padded = build_step_layout(*args, pad_rows_to=num_real + extra_rows, pad_pages_to=width + extra_pages)
    num_tokens = plain.num_tokens

    assert padded.num_rows == num_real + extra_rows
    assert padded.num_tokens == num_tokens + extra_rows
    assert padded.block_tables.shape == (num_real + extra_rows, width + extra_pages)
    for name in ("positions", "slot_mapping"):
        assert getattr(padded, name)[:num_tokens].tolist() == getattr(plain, name).tolist()
        assert getattr(padded, name)[num_tokens:].tolist() == ([0] if name == "positions" else [-1]) * extra_rows
    for name in ("cu_seqlens_q", "cu_seqlens_k", "context_lens", "logits_indices", "is_prefill"):
        length = num_real + (1 if name.startswith("cu_") else 0)
        assert getattr(padded, name)[:length].tolist() == getattr(plain, name).tolist()
    assert padded.block_tables[:num_real, :width].tolist() == plain.block_tables.tolist()
    assert (padded.block_tables[:, width:] == -1).all() and (padded.block_tables[num_real:] == -1).all()
    assert (padded.context_lens[num_real:] == 0).all()
    assert not padded.is_prefill[num_real:].any()
    assert padded.cu_seqlens_q[num_real:].tolist() == list(range(num_tokens, num_tokens + extra_rows + 1))
    assert (padded.cu_seqlens_k[num_real:] == plain.cu_seqlens_k[-1]).all()
    assert padded.logits_indices[num_real:].tolist() == list(range(num_tokens, num_tokens + extra_rows))
    assert padded.num_prefill_rows == plain.num_prefill_rows
    assert padded.num_decode_rows == plain.num_decode_rows + extra_rows


@settings(max_examples=25, deadline=None)
@given(block_size=st.sampled_from(BLOCK_SIZES), context=st.integers(1, 300), data=st.data())
def test_one_token_more_than_the_table_holds_is_rejected(block_size, context, data):
    # a table of exactly ceil(context / bs) - 1 blocks is one block short
    pages = twin_pages_used(context, block_size)
    query = data.draw(st.integers(1, context))
    with pytest.raises(ValueError, match="row 0"):
        build_step_layout([query], [context - query], [list(range(pages - 1))], block_size)
    build_step_layout([query], [context - query], [list(range(pages))], block_size)  # enough: fine


# --- errors -------------------------------------------------------------------------------------


def test_short_block_table_names_row_and_numbers():
    # row 1: cached 32 + query 1 = 33 tokens need ceil(33 / 16) = 3 blocks, it has 2
    with pytest.raises(ValueError, match=r"row 1 has 2 blocks .* 33 tokens needs ceil\(33 / 16\) = 3"):
        build_step_layout([4, 1], [0, 32], [[0], [1, 2]], 16)


@pytest.mark.parametrize("query, cached", [([0], [0]), ([-2], [4]), ([1, 0], [3, 3])])
def test_query_len_below_one_is_rejected(query, cached):
    with pytest.raises(ValueError, match="query_lens"):
        build_step_layout(query, cached, [[0]] * len(query), 16)


def test_negative_cached_len_is_rejected():
    with pytest.raises(ValueError, match=r"cached_lens\[0\] = -1"):
        build_step_layout([2], [-1], [[0]], 16)


@pytest.mark.parametrize(
    "query, cached, tables",
    [([1, 1], [1], [[0], [1]]), ([1], [1, 1], [[0]]), ([1, 1], [1, 1], [[0]]), ([1], [1], np.zeros((2, 1), np.int32))],
)
def test_mismatched_row_counts_are_rejected(query, cached, tables):
    with pytest.raises(ValueError, match="rows"):
        build_step_layout(query, cached, tables, 16)


@pytest.mark.parametrize("block_size, error", [(0, ValueError), (-16, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_block_size_is_rejected(block_size, error):
    with pytest.raises(error, match="block_size"):
        build_step_layout([1], [0], [[0]], block_size)


def test_pad_rows_below_batch_is_rejected():
    with pytest.raises(ValueError, match="pad_rows_to=1"):
        build_step_layout([1, 1], [0, 0], [[0], [1]], 16, pad_rows_to=1)


def test_pad_pages_below_table_width_is_rejected():
    with pytest.raises(ValueError, match="pad_pages_to=1"):
        build_step_layout([20], [0], [[0, 1]], 16, pad_pages_to=1)


def test_float_lengths_are_rejected():
    with pytest.raises(TypeError, match="query_lens"):
        build_step_layout(np.array([1.0]), [0], [[0]], 16)


def test_two_dimensional_lengths_are_rejected():
    with pytest.raises(ValueError, match="cached_lens"):
        build_step_layout([1], [[0]], [[0]], 16)


@pytest.mark.parametrize(
    "tables, match",
    [
        ([[0, -1, 2]], "column 2 holds 2"),  # a block after padding began
        ([[0, -3]], "column 1 holds -3"),  # padding is -1, nothing else
        ([[2**31]], "does not fit int32"),
        (np.zeros((1, 1, 1), np.int32), "2-D"),
    ],
)
def test_malformed_block_tables_are_rejected(tables, match):
    with pytest.raises(ValueError, match=match):
        build_step_layout([1], [0], tables, 16)


# --- build_decode_layout: the pure-decode fast path ----------------------------------------------


@st.composite
def decode_batches(draw):
    """A batch where every row computes one token, mostly on a cached context (decode), sometimes
    from scratch (a one-token prompt), as a padded table without trailing all-padding columns."""
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    num_rows = draw(st.integers(0, 6))
    cached = [draw(st.integers(0, 3) | st.integers(0, 5000)) for _ in range(num_rows)]
    pages = [twin_pages_used(c + 1, block_size) + draw(st.integers(0, 2)) for c in cached]
    total = sum(pages)
    base = draw(st.sampled_from([0, 2**31 // block_size + 1 if block_size > 1 else 2**31 - 2 * total - 2]))
    ids = random.Random(draw(st.integers(0, 2**32 - 1))).sample(range(base, base + 2 * total + 2), total)
    tables, start = [], 0
    for n in pages:
        tables.append(ids[start : start + n])
        start += n
    return Batch([1] * num_rows, cached, tables, block_size)


def padded_table(batch: Batch, dtype=np.int32) -> np.ndarray:
    width = max((len(row) for row in batch.block_tables), default=0)
    rows = [row + [-1] * (width - len(row)) for row in batch.block_tables]
    return np.array(rows, dtype=dtype).reshape(len(rows), width)


@PROPERTY_SETTINGS
@given(batch=decode_batches(), extra_rows=st.none() | st.integers(0, 4), extra_pages=st.none() | st.integers(0, 3),
       as_tensor=st.booleans())
def test_decode_layout_matches_the_general_layout_and_the_twin(batch, extra_rows, extra_pages, as_tensor):
    table = padded_table(batch)
    pad_rows_to = None if extra_rows is None else len(batch.cached_lens) + extra_rows
    pad_pages_to = None if extra_pages is None else table.shape[1] + extra_pages
    cached = np.array(batch.cached_lens, dtype=np.int64)
    layout = build_decode_layout(torch.from_numpy(cached) if as_tensor else cached,
                                 torch.from_numpy(table) if as_tensor else table, batch.block_size,
                                 pad_rows_to=pad_rows_to, pad_pages_to=pad_pages_to)
    general = build_step_layout(batch.query_lens, batch.cached_lens, batch.block_tables, batch.block_size,
                                pad_rows_to=pad_rows_to, pad_pages_to=pad_pages_to)
    expected = twin_step_layout(batch.query_lens, batch.cached_lens, batch.block_tables, batch.block_size,
                                pad_rows_to, pad_pages_to)
    assert_layout_equals(layout, expected)
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(layout, name), getattr(general, name)), name


def test_decode_layout_anchor():
    # block size 16. row 0: cached 47 on [5, 6, 7] -> page 47 // 16 = 2 (block 7), offset 15, slot 7*16+15 = 127.
    # row 1: cached 16 on [3, 9] -> page 1 (block 9), offset 0, slot 9*16 = 144. row 2: a 1-token prompt on [4]
    # -> slot 4*16 = 64, a prefill row. context = [48, 17, 1]; cu_seqlens_k = [0, 48, 65, 66].
    layout = build_decode_layout(np.array([47, 16, 0]), np.array([[5, 6, 7], [3, 9, -1], [4, -1, -1]]), 16)
    assert layout.positions.tolist() == [47, 16, 0]
    assert layout.slot_mapping.tolist() == [127, 144, 64]
    assert layout.context_lens.tolist() == [48, 17, 1]
    assert layout.cu_seqlens_k.tolist() == [0, 48, 65, 66]
    assert layout.cu_seqlens_q.tolist() == [0, 1, 2, 3] and layout.logits_indices.tolist() == [0, 1, 2]
    assert layout.is_prefill.tolist() == [False, False, True]
    assert (layout.max_seqlen_q, layout.max_seqlen_k, layout.num_prefill_rows) == (1, 48, 1)
    assert layout.row_order.tolist() == [0, 1, 2]  # contexts 48 > 17 > 1


def test_row_order_puts_the_longest_context_first_and_keeps_ties_in_row_order():
    # contexts [5, 9, 5, 1, 9] and two padding rows (context 0): 9, 9 (rows 1, 4), 5, 5 (rows 0, 2), 1, 0, 0
    layout = build_step_layout([1, 2, 1, 1, 3], [4, 7, 4, 0, 6], [[0, 1], [2, 3, 4], [5, 6], [7], [8, 9, 10]], 4,
                               pad_rows_to=7)
    assert layout.context_lens.tolist() == [5, 9, 5, 1, 9, 0, 0]
    assert layout.row_order.tolist() == [1, 4, 0, 2, 3, 5, 6]


def test_decode_layout_keeps_the_given_width_and_does_not_alias_the_table():
    table = np.array([[2, -1, -1]], dtype=np.int32)  # a trailing all-padding column is kept
    layout = build_decode_layout([3], table, 4)
    assert layout.block_tables.tolist() == [[2, -1, -1]]
    table[0, 0] = 99
    assert layout.block_tables.tolist() == [[2, -1, -1]]


def test_decode_layout_empty_and_padded_only():
    layout = build_decode_layout(np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int32), 16, pad_rows_to=2,
                                 pad_pages_to=3)
    assert layout.positions.tolist() == [0, 0] and layout.slot_mapping.tolist() == [-1, -1]
    assert layout.block_tables.tolist() == [[-1] * 3] * 2
    assert (layout.max_seqlen_q, layout.max_seqlen_k, layout.num_decode_rows) == (1, 0, 2)
    empty = build_decode_layout([], np.zeros((0, 0), dtype=np.int32), 16)
    assert (empty.num_rows, empty.max_seqlen_q, empty.max_seqlen_k) == (0, 0, 0)


@pytest.mark.parametrize(
    "cached, table, match",
    [
        ([-1], [[0]], "cached_lens\\[0\\] = -1 is negative"),
        ([1, 16], [[0, -1], [1, -1]], "row 1 has no block on page 1"),
        ([0, 32], [[0, -1], [1, 2]], "row 1 has 2 columns but position 32 is on page 2"),
        ([3], [[0], [1]], "block_tables has 2 rows but cached_lens has 1"),
    ],
)
def test_decode_layout_rejects_tables_without_the_written_block(cached, table, match):
    with pytest.raises(ValueError, match=match):
        build_decode_layout(cached, np.array(table), 16)


def test_decode_layout_rejects_bad_arguments():
    with pytest.raises(ValueError, match="2-D"):
        build_decode_layout([1], [[0]], 16)  # a list of lists is the general path's input
    with pytest.raises(TypeError, match="integers"):
        build_decode_layout([1], np.zeros((1, 1)), 16)
    with pytest.raises(ValueError, match="pad_rows_to=0"):
        build_decode_layout([1], np.zeros((1, 1), dtype=np.int32), 16, pad_rows_to=0)
    with pytest.raises(ValueError, match="pad_pages_to=0"):
        build_decode_layout([1], np.zeros((1, 1), dtype=np.int32), 16, pad_pages_to=0)
    with pytest.raises(TypeError, match="block_size"):
        build_decode_layout([1], np.zeros((1, 1), dtype=np.int32), 1.5)


@PROPERTY_SETTINGS
@given(batch=batches(), extra_rows=st.integers(1, 4), extra_tokens=st.integers(0, 40))
def test_padding_tokens_go_to_the_first_padding_row(batch, extra_rows, extra_tokens):
    num_real = len(batch.query_lens)
    args = (batch.query_lens, batch.cached_lens, batch.block_tables, batch.block_size)
    plain = build_step_layout(*args)
    num_tokens = plain.num_tokens
    padded = build_step_layout(*args, pad_rows_to=num_real + extra_rows, pad_tokens_to=num_tokens + extra_tokens)

    assert padded.num_rows == num_real + extra_rows and padded.num_tokens == num_tokens + extra_tokens
    for name in ("positions", "slot_mapping"):
        assert getattr(padded, name)[:num_tokens].tolist() == getattr(plain, name).tolist()
    assert (padded.slot_mapping[num_tokens:] == -1).all() and (padded.positions[num_tokens:] == 0).all()
    for name in ("cu_seqlens_q", "cu_seqlens_k", "context_lens", "logits_indices", "is_prefill"):
        length = num_real + (1 if name.startswith("cu_") else 0)
        assert getattr(padded, name)[:length].tolist() == getattr(plain, name).tolist()
    query_lens = padded.cu_seqlens_q.diff().tolist()
    assert query_lens[num_real:] == [extra_tokens] + [0] * (extra_rows - 1)
    assert (padded.context_lens[num_real:] == 0).all() and not padded.is_prefill[num_real:].any()
    assert (padded.cu_seqlens_k[num_real:] == plain.cu_seqlens_k[-1]).all()


def test_padding_tokens_need_a_padding_row():
    with pytest.raises(ValueError, match="needs a padding row"):
        build_step_layout([3], [0], [[1]], 16, pad_tokens_to=8)
    with pytest.raises(ValueError, match="smaller than the step's 3 tokens"):
        build_step_layout([3], [0], [[1]], 16, pad_rows_to=2, pad_tokens_to=2)
