"""Padded block tables <-> FlashInfer CSR page tables: anchors, twins, round trips, errors."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_core.cache.page_table import block_table_to_csr, csr_to_block_table, padded_block_table
from tests.cache.layout_twins import batches, twin_block_table_to_csr, twin_csr_to_block_table, twin_pages_used

PROPERTY_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def padded_array(block_tables, extra_columns=0) -> np.ndarray:
    width = max((len(row) for row in block_tables), default=0) + extra_columns
    rows = [row + [-1] * (width - len(row)) for row in block_tables]
    return np.array(rows, dtype=np.int32).reshape(len(block_tables), width)


# --- anchors --------------------------------------------------------------------------------------


def test_csr_anchor():
    # block size 16; rows: 47 tokens on [5, 6, 7] -> ceil(47/16) = 3 pages, last 47 - 32 = 15;
    # 17 tokens on [3, 9, 4] -> 2 pages (block 4 unused), last 17 - 16 = 1;
    # 32 tokens on [8, 2] -> 2 full pages, last 16; an empty row -> 0 pages, last 0
    indptr, indices, last = block_table_to_csr([[5, 6, 7], [3, 9, 4], [8, 2], []], [47, 17, 32, 0], 16)
    assert indptr.tolist() == [0, 3, 5, 7, 7]
    assert indices.tolist() == [5, 6, 7, 3, 9, 8, 2]
    assert last.tolist() == [15, 1, 16, 0]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


def test_csr_to_block_table_anchor():
    # rows of 3, 0 and 2 pages; padded to the longest row (3), then to 5 on request
    table = csr_to_block_table([0, 3, 3, 5], [5, 6, 7, 3, 9])
    assert table.tolist() == [[5, 6, 7], [-1, -1, -1], [3, 9, -1]]
    assert table.dtype == torch.int32
    assert csr_to_block_table(torch.tensor([0, 1]), torch.tensor([4]), pad_to=5).tolist() == [[4, -1, -1, -1, -1]]


def test_empty_inputs():
    indptr, indices, last = block_table_to_csr([], [], 16)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0], [], [])
    assert tuple(csr_to_block_table([0], []).shape) == (0, 0)


def test_padded_block_table_drops_trailing_padding():
    # a padded array and its ragged rows give the same table and page counts
    table, num_pages = padded_block_table(np.array([[4, 2, -1, -1], [7, -1, -1, -1]], dtype=np.int32))
    assert table.tolist() == [[4, 2], [7, -1]]
    assert num_pages.tolist() == [2, 1]
    assert table.dtype == np.int64


# --- properties -----------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(batch=batches(), table_form=st.sampled_from(["ragged", "numpy", "torch"]), extra_columns=st.integers(0, 2))
def test_block_table_to_csr_matches_twin(batch, table_form, extra_columns):
    tables = batch.block_tables
    if table_form != "ragged":
        tables = padded_array(tables, extra_columns)
        tables = tables if table_form == "numpy" else torch.from_numpy(tables)
    indptr, indices, last = block_table_to_csr(tables, batch.context_lens, batch.block_size)
    expected = twin_block_table_to_csr(batch.block_tables, batch.context_lens, batch.block_size)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == expected
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert ((last >= 1) & (last <= batch.block_size)).all()  # no empty rows in a batch


@PROPERTY_SETTINGS
@given(
    row_pages=st.lists(st.integers(0, 6), max_size=8),
    pad_extra=st.none() | st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_csr_to_block_table_matches_twin(row_pages, pad_extra, seed):
    rng = np.random.default_rng(seed)
    indices = rng.permutation(10 * sum(row_pages) + 1)[: sum(row_pages)].tolist()
    indptr = np.concatenate([[0], np.cumsum(row_pages, dtype=np.int64)]).tolist()
    pad_to = None if pad_extra is None else max(row_pages, default=0) + pad_extra
    table = csr_to_block_table(indptr, indices, pad_to=pad_to)
    assert table.dtype == torch.int32
    assert table.tolist() == twin_csr_to_block_table(indptr, indices, pad_to)


@PROPERTY_SETTINGS
@given(batch=batches())
def test_round_trips(batch):
    context = batch.context_lens
    # a table holding exactly the pages in use survives table -> CSR -> table
    used_rows = [row[: twin_pages_used(c, batch.block_size)] for row, c in zip(batch.block_tables, context)]
    indptr, indices, _ = block_table_to_csr(batch.block_tables, context, batch.block_size)
    assert csr_to_block_table(indptr, indices).tolist() == padded_array(used_rows).tolist()
    # and CSR -> table -> CSR gives the CSR back
    again = block_table_to_csr(csr_to_block_table(indptr, indices), context, batch.block_size)
    assert again[0].tolist() == indptr.tolist() and again[1].tolist() == indices.tolist()


# --- errors ---------------------------------------------------------------------------------------


def test_short_table_is_rejected():
    # 33 tokens at block size 16 need ceil(33 / 16) = 3 pages; the row has 2
    with pytest.raises(ValueError, match=r"row 0 has 2 blocks .* needs ceil\(33 / 16\) = 3"):
        block_table_to_csr([[1, 2]], [33], 16)


def test_negative_context_is_rejected():
    with pytest.raises(ValueError, match=r"context_lens\[1\] = -1"):
        block_table_to_csr([[1], [2]], [3, -1], 16)


def test_context_and_table_rows_must_agree():
    with pytest.raises(ValueError, match="rows"):
        block_table_to_csr([[1], [2]], [3], 16)


def test_bad_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size"):
        block_table_to_csr([[1]], [3], 0)


@pytest.mark.parametrize(
    "indptr, indices, pad_to, match",
    [
        ([1, 2], [4], None, "start with 0"),
        ([], [], None, "start with 0"),
        ([0, 2, 1], [4, 5], None, "decreases at row 1"),
        ([0, 1], [4, 5], None, "ends at 1 but kv_indices has 2"),
        ([0, 1], [-4], None, "kv_indices"),
        ([0, 3], [4, 5, 6], 2, "pad_to=2"),
    ],
)
def test_malformed_csr_is_rejected(indptr, indices, pad_to, match):
    with pytest.raises(ValueError, match=match):
        csr_to_block_table(indptr, indices, pad_to=pad_to)


def test_block_table_with_a_hole_is_rejected():
    with pytest.raises(ValueError, match="row 1, column 2 holds 3"):
        padded_block_table([[0], [1, -1, 3]])


def test_block_table_of_wrong_type_is_rejected():
    with pytest.raises(TypeError, match="block_tables"):
        padded_block_table(7)
    with pytest.raises(TypeError, match="block_tables"):
        padded_block_table(np.zeros((1, 2), dtype=np.float32))
    for bad in ([[1.7]], [["3"]], [[True]]):  # lists: refused as the arrays are, not truncated to other ids
        with pytest.raises(TypeError, match="block_tables must hold integers"):
            padded_block_table(bad)
