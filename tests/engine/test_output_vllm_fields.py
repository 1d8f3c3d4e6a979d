"""What a vLLM user's loop reads from an output: ``prompt`` (the text given, the rendered chat), vLLM V1's
``cumulative_logprob`` (None without log-probs), ``metrics`` (None offline), and on ``AsyncEngine``'s
``StreamOutput`` ``outputs[0].text`` (cumulative) and ``prompt``; the data-parallel front keeps the prompt
on its mirrors too.

The engine is the demo model with a plain-text chat template (as tests/engine/test_chat_template.py's).
"""

from __future__ import annotations

import asyncio
import math
import shutil

import pytest
import torch

from atom_core import ops
from atom_core.engine import AsyncEngine, Engine, SamplingParams
from atom_core.engine.engine import DEMO_MODEL
from tests.engine.test_data_parallel import dp  # noqa: F401  (the module's two-replica front, reused)

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}")
GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPT = "Return the number of"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo_chat") / "model"
    shutil.copytree(DEMO_MODEL, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    with ops.use_backend("torch"):
        yield Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)


def run_streaming(engine, prompt, params, **kwargs):
    """Every output of one request added with ``add_request``, in step order."""
    rid = engine.add_request(prompt, params, **kwargs)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(out for out in engine.step() if out.request_id == rid)
    return outs


def test_prompt_is_the_given_text_for_text_prompts_and_none_for_token_ids(engine):
    ids = engine.tokenizer.encode(PROMPT)
    outs = engine.generate([PROMPT, ids, {"prompt": "This module provides"}, {"prompt_token_ids": ids}], GREEDY,
                           use_tqdm=False)
    assert [out.prompt for out in outs] == [PROMPT, None, "This module provides", None]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == ids
    streamed = run_streaming(engine, PROMPT, GREEDY)
    assert len(streamed) > 1 and all(out.prompt == PROMPT for out in streamed)


def test_add_request_keeps_a_given_prompt_text_and_refuses_one_that_is_not_a_string(engine):
    ids = engine.tokenizer.encode(PROMPT)
    outs = run_streaming(engine, ids, GREEDY, prompt_text=PROMPT)
    assert outs[-1].finished and outs[-1].prompt == PROMPT
    with pytest.raises(TypeError, match="prompt_text must be a string, got list"):
        engine.add_request(ids, GREEDY, prompt_text=ids)
    assert not engine.has_unfinished_requests()


def test_chat_prompt_is_the_rendered_template_text_and_its_token_ids_are_the_templates(engine):
    conversations = [[{"role": "user", "content": "Hello!"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est la gare ?"}]]
    outs = engine.chat(conversations, GREEDY, use_tqdm=False)
    tokenizer = engine.tokenizer
    for conversation, out in zip(conversations, outs):
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert out.prompt == text and text.endswith("Assistant:")
        assert out.prompt_token_ids == tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    assert outs[0].prompt != outs[1].prompt


@pytest.mark.parametrize("logprobs", [0, 3])
def test_cumulative_logprob_is_the_fsum_of_the_logprobs(engine, logprobs):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=logprobs)
    out = engine.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(out.logprobs) == 8 and all(lp < 0 for lp in out.logprobs)
    assert out.cumulative_logprob == math.fsum(out.logprobs)
    assert out.outputs[0].cumulative_logprob == out.cumulative_logprob


def test_cumulative_logprob_is_none_without_logprobs(engine):
    out = engine.generate(PROMPT, SamplingParams(temperature=1.0, seed=7, max_tokens=4), use_tqdm=False)[0]
    assert out.logprobs is None and out.cumulative_logprob is None
    assert all(o.cumulative_logprob is None for o in run_streaming(engine, PROMPT, GREEDY))


def test_each_of_n_sequences_has_the_cumulative_logprob_of_its_own_tokens(engine):
    params = SamplingParams(n=2, temperature=1.5, seed=3, max_tokens=8, ignore_eos=True, logprobs=0)
    out = engine.generate(PROMPT, params, use_tqdm=False)[0]
    first, second = out.outputs
    assert first.token_ids != second.token_ids  # (the seeds draw different sequences)
    assert first.cumulative_logprob == math.fsum(first.logprobs)
    assert second.cumulative_logprob == math.fsum(second.logprobs)
    assert first.cumulative_logprob != second.cumulative_logprob


def test_a_mid_stream_output_has_the_cumulative_logprob_of_its_step(engine):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = run_streaming(engine, PROMPT, params)
    final = outs[-1]
    assert len(outs) == 6 and final.finished
    # Read after the request finished: each still sums the tokens it had at its step, not the final ones.
    for out in outs:
        assert out.cumulative_logprob == math.fsum(final.logprobs[:out.num_output_tokens])
    assert outs[2].cumulative_logprob != final.cumulative_logprob


def test_detokenize_false_gives_the_same_token_ids_with_an_empty_text(engine):
    with ops.use_backend("torch"):
        decoded, = engine.generate([PROMPT], GREEDY)
        ids_only, = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, detokenize=False))
        outs = run_streaming(engine, PROMPT, SamplingParams(temperature=0, max_tokens=6, detokenize=False))
    assert decoded.outputs[0].text and ids_only.outputs[0].text == ""
    assert ids_only.outputs[0].token_ids == decoded.outputs[0].token_ids
    assert [out.outputs[0].text for out in outs] == [""] * len(outs)
    assert outs[-1].outputs[0].token_ids == decoded.outputs[0].token_ids


def test_metrics_is_none(engine):
    out = engine.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.metrics is None and out.outputs[0].metrics is None


def test_stream_outputs_hold_themselves_with_the_text_so_far_the_prompt_and_the_cumulative_logprob(engine):
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    want = engine.generate(PROMPT, params, use_tqdm=False)[0]

    async def collect(async_engine, prompt):
        return [out async for out in async_engine.generate(prompt, params)]

    async def main():
        async with AsyncEngine(engine) as async_engine:
            return await collect(async_engine, PROMPT), await collect(async_engine, ids)

    by_text, by_ids = asyncio.run(main())
    assert len(by_text) == 8 and by_text[-1].finished
    for out in by_text:
        assert out.outputs == [out] and out.prompt == PROMPT
        assert out.outputs[0].text == "".join(o.new_text for o in by_text[:by_text.index(out) + 1])
        assert out.cumulative_logprob == math.fsum(out.logprobs)
    assert by_text[-1].outputs[0].text == want.text != by_text[2].outputs[0].text
    assert by_text[-1].cumulative_logprob == pytest.approx(want.cumulative_logprob)
    assert all(out.prompt is None for out in by_ids) and by_ids[-1].outputs[0].text == want.text


def test_the_data_parallel_front_keeps_the_prompt_text(dp):  # noqa: F811
    prompts = ["Return the number of", [5, 6, 7]]
    outs = dp.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [out.prompt for out in outs] == ["Return the number of", None]
    rid = dp.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, logprobs=0), prompt_text="five")
    finished = []
    while dp.has_unfinished_requests():
        finished.extend(out for out in dp.step() if out.request_id == rid and out.finished)
    assert finished[0].prompt == "five" and finished[0].cumulative_logprob == math.fsum(finished[0].logprobs)
