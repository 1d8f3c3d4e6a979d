"""The CUDA-graph buckets: their sizes, which bucket a step takes, and that a step padded to its
bucket computes the same logits for its real rows (checked on the CPU with the reference twins)."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from atom_core.engine.cuda_graphs import (
    DECODE,
    MIXED,
    StepGraphs,
    decode_graph_sizes,
    mixed_graph_sizes,
)
from atom_core.engine.runner import forward_logits


@given(limit=st.integers(1, 20000))
def test_mixed_sizes_grow_by_at_most_2x_then_1_5x_and_end_at_the_limit(limit):
    sizes = mixed_graph_sizes(limit)
    assert sizes == sorted(set(sizes)) and sizes[-1] == limit
    for small, large in zip(sizes, sizes[1:]):
        assert large <= 2 * small and (small < 512 or 2 * large <= 3 * small)


@given(limit=st.integers(1, 1024))
def test_decode_sizes_are_sorted_and_end_at_max_num_seqs(limit):
    sizes = decode_graph_sizes(limit)
    assert sizes == sorted(set(sizes)) and sizes[-1] == limit and sizes[0] == 1


def _graphs(max_num_seqs, max_num_batched_tokens):
    # The bucket arithmetic needs no GPU: buffers on the CPU.
    return StepGraphs(None, device="cpu", max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      max_model_len=64, block_size=16)


@settings(max_examples=200, deadline=None)
@given(max_num_seqs=st.integers(1, 300), budget=st.integers(1, 9000), data=st.data())
def test_every_step_the_scheduler_can_make_has_a_bucket_that_holds_it(max_num_seqs, budget, data):
    graphs = _graphs(max_num_seqs, budget)
    is_decode = data.draw(st.booleans())
    if is_decode:
        num_rows = data.draw(st.integers(1, min(max_num_seqs, budget)))
        num_tokens = num_rows
    else:
        num_tokens = data.draw(st.integers(1, budget))
        num_rows = data.draw(st.integers(1, min(num_tokens, max_num_seqs)))
    bucket = graphs.bucket_for(num_tokens, num_rows, is_decode)
    assert bucket is not None
    assert bucket.kind == (DECODE if is_decode else MIXED)
    assert bucket.num_tokens >= num_tokens and bucket.num_rows >= num_rows
    if bucket.kind == MIXED and bucket.num_tokens > num_tokens:
        assert bucket.num_rows > num_rows  # room for the row that holds the padding tokens
    assert bucket in graphs.buckets()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_padded_to_their_bucket_give_the_same_logits(tiny_qwen3, async_scheduling):
    """Every step of a workload (prefills, chunks, mixed, decode) run padded as its graph would run
    it, against the same step unpadded: the real rows' logits are equal."""
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4,
                                        max_num_batched_tokens=24, max_num_seqs=6, async_scheduling=async_scheduling)
        runner = engine.runner
        graphs = _graphs(6, 24)
        launch = runner.launch
        kinds = set()

        def checked_launch(step):
            bucket = graphs.bucket_for(step.num_tokens, len(step), step.is_decode)
            kinds.add(bucket.kind)
            plain_ids, plain = runner.prepare(step)
            padded_ids, padded = runner.prepare(step, bucket)
            assert padded.num_tokens == bucket.num_tokens and padded.num_rows == bucket.num_rows
            if bucket.kind == MIXED:  # what the graph's static layout says
                padded = replace(padded, max_seqlen_q=bucket.num_tokens)
            with torch.inference_mode():
                # pending ids (from the previous step) are zeros in both: they see the same inputs
                want = forward_logits(runner.model, torch.from_numpy(plain_ids), plain)
                got = forward_logits(runner.model, torch.from_numpy(padded_ids), padded)[:len(step)]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            return launch(step)

        runner.launch = checked_launch
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, 90, n).tolist() for n in (3, 17, 30, 1, 9, 5, 12)]
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert kinds == {DECODE, MIXED}
