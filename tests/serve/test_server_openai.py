"""The server through the official ``openai`` client: completions and chat equal the engine's own
results (greedy, seeded, n), streaming adds up to the non-streamed response, stop strings, log-probs
with token strings, echo with prompt log-probs, logit_bias, usage, /v1/models."""

from __future__ import annotations

from dataclasses import replace

import pytest

from atom_core.serve.engine_options import FALLBACK_CHAT_TEMPLATE
from tests.serve.conftest import MODEL

PROMPT = "Return the number of"
CONVERSATION = [{"role": "system", "content": "You write docstrings."}, {"role": "user", "content": "Open a file"}]


def offline(server, prompts, **fields):
    """The engine's own result for the same request (on its step thread, while the server idles)."""
    server.wait_idle()
    params = replace(server.engine.default_sampling_params, **fields)
    return server.submit(lambda e: e.generate(prompts, params, use_tqdm=False))


def offline_chat(server, conversation, **fields):
    server.wait_idle()
    params = replace(server.engine.default_sampling_params, **fields)
    return server.submit(lambda e: e.chat(conversation, params, chat_template=FALLBACK_CHAT_TEMPLATE,
                                          use_tqdm=False))[0]


def test_completion_equals_offline_generate_with_usage(server):
    client = server.client()
    want = offline(server, PROMPT, temperature=0, max_tokens=20)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    assert got.object == "text_completion" and got.model == MODEL and got.id.startswith("cmpl-")
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_streamed_completion_chunks_concatenate_to_the_non_streamed_text(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_null_in_the_fields_openai_declares_nullable_means_their_default(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    want = client.completions.create(**kwargs).choices
    got = client.completions.create(n=None, stream=None, echo=None, **kwargs).choices
    assert [(c.index, c.text) for c in got] == [(c.index, c.text) for c in want]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": None}, **kwargs))
    assert all(c.usage is None for c in chunks) and "".join(c.choices[0].text for c in chunks) == want[0].text
    chat = dict(model=MODEL, messages=CONVERSATION, max_tokens=8, temperature=0)
    want = client.chat.completions.create(**chat).choices
    got = client.chat.completions.create(n=None, stream=None, logprobs=None, **chat).choices
    assert [(c.index, c.message.content, c.logprobs) for c in got] == [(c.index, c.message.content, None) for c in want]


def test_without_max_tokens_each_prompt_of_a_batch_gets_the_default_its_own_room_allows(server):
    client = server.client()
    short, near_full = [17, 18, 19], [40 + i % 50 for i in range(server.engine.max_model_len - 3)]
    kwargs = dict(model=MODEL, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    alone = client.completions.create(prompt=[short], **kwargs).choices
    both = client.completions.create(prompt=[short, near_full], **kwargs).choices
    assert [len(c.logprobs.tokens) for c in alone] == [16]  # OpenAI's default max_tokens
    assert [len(c.logprobs.tokens) for c in both] == [16, 3]  # the second prompt leaves room for 3
    assert both[0].text == alone[0].text


def test_token_id_prompts_and_a_prompt_batch_give_choices_in_prompt_then_sequence_order(server):
    client = server.client()
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    want = offline(server, prompts, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, n=2, seed=3)
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=2, seed=3, temperature=1.0,
                                    top_p=1.0, extra_body={"top_k": -1})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [seq.text for out in want for seq in out.outputs]
    assert got.usage.prompt_tokens == 7
    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=2, seed=3, temperature=1.0,
                                           top_p=1.0, extra_body={"top_k": -1}, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(4)] == [c.text for c in got.choices]


def test_the_same_seed_gives_the_same_text_and_other_seeds_other_texts(server):
    client = server.client()

    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed)\
            .choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, *(sample(seed) for seed in range(4))}) > 1


def test_stop_strings_end_the_text_before_them(server):
    client = server.client()
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = free.strip().split()[2]  # a word from the middle of the free text
    want = offline(server, PROMPT, temperature=0, max_tokens=30, stop=[stop])[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop]).choices[0]
    assert got.text == want.text == free[:free.index(stop)]
    assert got.finish_reason == "stop" and got.model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=stop, stream=True))
    assert streamed == got.text


def test_completion_logprobs_are_the_engines_with_token_strings(server):
    client = server.client()
    want = offline(server, PROMPT, temperature=0, max_tokens=6, logprobs=2)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2).choices[0]
    tokenizer = server.engine.tokenizer
    lp = got.logprobs
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    for top, ref, token in zip(lp.top_logprobs, want.top_logprobs, lp.tokens):
        assert token in top  # the chosen token is always listed
        expected = {tokenizer.decode([t], skip_special_tokens=False): v for t, v in ref.items()}
        assert {k: top[k] for k in expected} == pytest.approx(expected, abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_with_logprobs_prepends_the_prompt_and_its_logprobs(server):
    """What lm-eval's loglikelihood requests send: echo, logprobs, max_tokens=1."""
    client = server.client()
    want = offline(server, PROMPT, temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                    logprobs=1).choices[0]
    assert got.text == PROMPT + want.text
    n_prompt = len(want.prompt_token_ids)
    assert len(got.logprobs.tokens) == n_prompt + 1
    assert got.logprobs.token_logprobs[0] is None
    assert got.logprobs.token_logprobs[1:n_prompt] == pytest.approx(want.prompt_logprobs[1:], abs=1e-5)
    assert got.logprobs.token_logprobs[n_prompt] == pytest.approx(want.logprobs[0], abs=1e-5)
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                              logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == got.text
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == got.logprobs.tokens
    assert [t for c in streamed for t in c.choices[0].logprobs.text_offset] == got.logprobs.text_offset


@pytest.mark.parametrize("stream", [False, True])
def test_echoed_text_offsets_run_over_the_prompt_then_the_output_tokens_strings(server, stream):
    """vLLM's offsets: cumulative over every token's string, the BOS the tokenizer adds to a text prompt included."""
    client = server.client()
    response = client.completions.create(model=MODEL, prompt="a b.", max_tokens=6, temperature=0, echo=True,
                                         logprobs=0, stream=stream, extra_body={"ignore_eos": True})
    choices = [c.choices[0] for c in response] if stream else response.choices
    tokens = [t for c in choices for t in c.logprobs.tokens]
    offsets = [o for c in choices for o in c.logprobs.text_offset]
    assert len(tokens) > 6
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]


def test_logit_bias_is_clamped_to_100_and_applied(server):
    client = server.client()
    greedy = offline(server, PROMPT, temperature=0, max_tokens=1)[0].token_ids[0]
    other = 1000 if greedy != 1000 else 1001
    want = offline(server, PROMPT, temperature=0, max_tokens=5, logit_bias={other: 100.0})[0]
    assert want.token_ids == [other] * 5  # +100 makes it the argmax every time
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logit_bias={str(other): 100}).choices[0]
    assert got.text == want.text
    # Both at +100 after clamping: the model's own favourite wins (unclamped, +5000 would win).
    both = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                     logit_bias={str(other): 5000, str(greedy): 100}).choices[0]
    assert both.logprobs.tokens == [server.engine.tokenizer.decode([greedy], skip_special_tokens=False)]


def test_chat_completion_equals_engine_chat_with_usage(server):
    client = server.client()
    want = offline_chat(server, CONVERSATION, temperature=0, max_tokens=20)
    got = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=20, temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    message = got.choices[0].message
    assert message.role == "assistant" and message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    # Text parts are joined with newlines, as vLLM joins them.
    parts = [{"role": "system", "content": [{"type": "text", "text": "You write"}, {"type": "text", "text": "docs."}]},
             CONVERSATION[1]]
    joined = offline_chat(server, [{"role": "system", "content": "You write\ndocs."}, CONVERSATION[1]],
                          temperature=0, max_tokens=20)
    got = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=20, temperature=0)
    assert (got.choices[0].message.content, got.usage.prompt_tokens) == (joined.text, len(joined.prompt_token_ids))


def test_chat_stream_opens_with_the_role_and_its_deltas_add_up(server):
    client = server.client()
    kwargs = dict(model=MODEL, messages=CONVERSATION, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content
    assert deltas[-1].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_logprobs_give_token_strings_bytes_and_top_alternatives(server):
    client = server.client()
    want = offline_chat(server, CONVERSATION, temperature=0, max_tokens=5, logprobs=3)
    got = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3).choices[0]
    tokenizer = server.engine.tokenizer
    entries = got.logprobs.content
    assert [e.token for e in entries] == [tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert [e.logprob for e in entries] == pytest.approx(want.logprobs, abs=1e-5)
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    for entry, ref in zip(entries, want.top_logprobs):
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i], skip_special_tokens=False) for i in ref]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(list(ref.values()), abs=1e-5)
    streamed = [c for c in client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=5,
                                                          temperature=0, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [e.token for c in streamed for e in c.choices[0].logprobs.content] == [e.token for e in entries]


def test_chat_n_with_a_seed_equals_engine_chat_and_repeats(server):
    client = server.client()
    want = offline_chat(server, CONVERSATION, temperature=1.0, top_p=1.0, max_tokens=10, n=3, seed=9)
    kwargs = dict(model=MODEL, messages=CONVERSATION, max_tokens=10, n=3, seed=9, temperature=1.0, top_p=1.0)
    got = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in got.choices] == [seq.text for seq in want.outputs]
    assert [c.message.content for c in client.chat.completions.create(**kwargs).choices] == \
        [c.message.content for c in got.choices]


def test_chat_stop_strings(server):
    client = server.client()
    free = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=30, temperature=0)\
        .choices[0].message.content
    stop = free.strip().split()[1]
    got = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=30, temperature=0,
                                         stop=[stop]).choices[0]
    assert got.message.content == free[:free.index(stop)] and got.finish_reason == "stop"


def test_models_lists_the_served_model_with_its_context(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == server.engine.max_model_len
    assert models[0].model_extra["vocab_size"] == server.engine.model.config.vocab_size
