"""RequestOutput / StepOutputs: built on access, snapshots of their step, streaming adds up."""

import numpy as np
import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, RequestOutput, SamplingParams, StepOutputs
from atom_core.engine.request import Request


def running_request(rid, prompt, **params):
    return Request(rid, prompt, SamplingParams(**params), seed=rid)


def append_token(request, token):
    request.token_ids.append(token)  # what Scheduler.record does


def test_outputs_are_snapshots_of_their_step():
    a = running_request(0, [1, 2, 3], logprobs=0)
    b = running_request(1, [9])
    append_token(a, 50)
    append_token(b, 60)
    a.logprobs.append(-0.5)
    first = StepOutputs([a, b], np.array([50, 60]), np.array([4, 2]), {1: "length"})  # a: 3 prompt + 1, b: 1 + 1
    append_token(a, 51)
    a.logprobs.append(-0.25)
    second = StepOutputs([a], np.array([51]), np.array([5]), {})

    assert len(first) == 2 and len(second) == 1
    out_a, out_b = first
    assert isinstance(out_a, RequestOutput)
    # the first step's outputs still show that step, although a has generated more since
    assert out_a.token_ids == [50] and out_a.new_token_ids == [50] and out_a.logprobs == [-0.5]
    assert not out_a.finished and out_a.finish_reason is None and out_a.text == ""
    assert out_b.finished and out_b.finish_reason == "length" and out_b.token_ids == [60]
    assert out_a.prompt_token_ids == [1, 2, 3] and out_a.request_id == 0 and out_b.new_token_ids == [60]
    assert second[0].token_ids == [50, 51] and second[0].new_token_ids == [51] and second[0].logprobs == [-0.5, -0.25]
    assert out_b.logprobs is None


def test_sequence_protocol():
    requests = [running_request(rid, [rid + 1]) for rid in range(3)]
    for r in requests:
        append_token(r, 7)
    # 1-token prompts, one token each
    outs = StepOutputs(requests, np.array([7, 7, 7]), np.array([2, 2, 2]), {0: "stop", 2: "length"})
    assert [o.request_id for o in outs] == [0, 1, 2]
    assert outs[-1].request_id == 2 and [o.request_id for o in outs[1:]] == [1, 2]
    assert [(o.request_id, o.finish_reason) for o in outs.finished()] == [(0, "stop"), (2, "length")]
    with pytest.raises(IndexError):
        outs[3]
    with pytest.raises(ValueError, match="3 requests but 3 new tokens and 2 token counts"):
        StepOutputs(requests, np.array([7, 7, 7]), np.array([2, 2]), {})
    assert len(StepOutputs([], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), {})) == 0
    assert [o.new_token_ids for o in outs] == [[7], [7], [7]]


def test_iterating_gives_each_rows_output_as_indexing_does_with_python_ints():
    prompts = ([1, 2, 3], [4], [5, 6])
    requests = [running_request(rid, prompt) for rid, prompt in enumerate(prompts)]
    for r, tokens in zip(requests, ([70, 71], [80], [90, 91, 92])):
        r.token_ids.extend(tokens)
    outs = StepOutputs(requests, np.array([71, 80, 92]), np.array([5, 2, 5]), {1: "stop"})

    def fields(o):
        return o.request_id, o.num_output_tokens, o.new_token_ids, o.finish_reason, o.token_ids

    assert [fields(o) for o in outs] == [fields(outs[i]) for i in range(3)] == [
        (0, 2, [71], None, [70, 71]), (1, 1, [80], "stop", [80]), (2, 3, [92], None, [90, 91, 92])]
    assert all(type(o.new_token_ids[0]) is int and type(o.num_output_tokens) is int for o in outs)  # JSON-ready


def test_streamed_new_tokens_add_up_to_the_final_output(tiny_qwen3):
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4)
        params = [SamplingParams(temperature=0.8, seed=s, max_tokens=n, ignore_eos=True) for s, n in ((1, 9), (2, 5))]
        ids = [engine.add_request(p, sp) for p, sp in zip([[1, 2, 3], [4, 5, 6, 7, 8]], params)]
        streamed = {rid: [] for rid in ids}
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                streamed[out.request_id] += out.new_token_ids
                assert out.token_ids == streamed[out.request_id]
                if out.finished:
                    final[out.request_id] = out
    for rid, n in zip(ids, (9, 5)):
        assert len(final[rid].token_ids) == n and final[rid].token_ids == streamed[rid]
        assert final[rid].finish_reason == "length"
