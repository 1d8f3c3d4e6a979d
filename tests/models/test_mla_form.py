"""Which form MLA's attention runs (``MLAPagedAttention.uses_absorbed`` under form="auto"): the expanded form
only where its temporary K/V stay within EXPANDED_MAX_SLOTS_PER_TOKEN slots per query token of the step."""

import pytest
import torch

from atom_core.cache import build_step_layout
from atom_core.models.layers.mla import ABSORBED_MAX_QUERY_LEN, EXPANDED_MAX_SLOTS_PER_TOKEN, MLAPagedAttention

BLOCK_SIZE = 16


def layout(query_lens, cached_lens, width=None):
    """A step's layout with consecutive blocks per row; ``width`` pads every row's table to that many pages."""
    tables, next_block = [], 0
    for q, c in zip(query_lens, cached_lens):
        pages = -(-(q + c) // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + pages)))
        next_block += pages
    return build_step_layout(query_lens, cached_lens, tables, BLOCK_SIZE, pad_pages_to=width)


@pytest.fixture
def attention():
    layer = MLAPagedAttention(4, 32, 8, 16, scale=0.1)
    layer.bind_kv_cache(torch.zeros(4096, BLOCK_SIZE, 40))
    return layer


@pytest.mark.parametrize("query_lens, cached_lens, width, absorbed", [
    ([512], [0], None, False),                      # a fresh prompt: 512 slots for 512 queries
    ([300, 200], [0, 0], None, False),              # two prompts, the shorter padded to the longer's pages
    ([1] * 8, [100] * 8, None, True),               # decode rows: at most ABSORBED_MAX_QUERY_LEN queries
    ([64], [4000], None, True),                     # a prefix hit: 4064 slots for 64 queries
    ([256] + [1] * 20, [0] + [300] * 20, None, True),  # a prefill chunk beside decode rows' long contexts
    ([512], [0], 2048 // BLOCK_SIZE, True),         # a CUDA graph's static table, max_model_len wide
])
def test_auto_expands_only_within_the_slot_limit(attention, query_lens, cached_lens, width, absorbed):
    batch = layout(query_lens, cached_lens, width)
    rows, pages = batch.block_tables.shape
    within_limit = rows * pages * BLOCK_SIZE <= EXPANDED_MAX_SLOTS_PER_TOKEN * sum(query_lens)
    assert attention.uses_absorbed(batch) is absorbed
    assert absorbed == (max(query_lens) <= ABSORBED_MAX_QUERY_LEN or not within_limit)


@pytest.mark.parametrize("form, absorbed", [("expanded", False), ("absorbed", True)])
def test_a_fixed_form_is_kept_whatever_the_layout(attention, form, absorbed):
    attention.form = form
    for batch in (layout([512], [0]), layout([1] * 8, [100] * 8), layout([64], [4000])):
        assert attention.uses_absorbed(batch) is absorbed
