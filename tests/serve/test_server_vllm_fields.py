"""vLLM's request fields: the prompt ones (``truncate_prompt_tokens``, ``add_special_tokens``, chat's
``continue_final_message`` / ``add_generation_prompt`` / ``chat_template`` / ``documents`` / ``reasoning_effort``),
``prompt_logprobs`` in vLLM's shape, ``return_tokens_as_token_ids``, ``echo`` with ``max_tokens=0``, the
checkpoint's ``max_new_tokens`` as chat's default length, and the vLLM fields refused by name
(``REFUSED_FIELDS``) or ignored; each against the engine's own result for the same token ids."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("pydantic")  # the server's extra (atom_core.serve.protocol): absent, the server tests skip

from atom_core.engine import Engine, SamplingParams  # noqa: E402
from atom_core.engine.engine import DEMO_MODEL  # noqa: E402
from atom_core.serve.engine_options import FALLBACK_CHAT_TEMPLATE  # noqa: E402
from atom_core.serve.protocol import (IGNORED_FIELDS, REFUSED_FIELDS, ChatCompletionRequest, CompletionRequest,  # noqa: E402
                                      RequestError, parse_request)
from tests.serve.conftest import MODEL, LiveServer  # noqa: E402
from tests.serve.test_server_errors import assert_error, request  # noqa: E402

PROMPT = "Return the number of"
CONTINUED = [{"role": "user", "content": "Open a file"}, {"role": "assistant", "content": "Use open("}]


def completion(server, **fields) -> dict:
    status, body = request(server, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields})
    assert status == 200, body
    return body


def chat(server, messages=CONTINUED, **fields) -> dict:
    status, body = request(server, "POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **fields})
    assert status == 200, body
    return body


def offline(server, token_ids: list[int], **fields):
    """The engine's greedy result for exactly these token ids."""
    server.wait_idle()
    params = SamplingParams(**{"temperature": 0, "max_tokens": 4, **fields})
    return server.submit(lambda e: e.generate([token_ids], params, use_tqdm=False))[0]


def render(server, messages=CONTINUED, template=FALLBACK_CHAT_TEMPLATE, **kwargs) -> list[int]:
    return server.engine.tokenizer.apply_chat_template(messages, chat_template=template, **kwargs)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A server on a copy of the demo model whose generation_config.json sets max_new_tokens=5, trusting the
    requests' chat templates (--trust-request-chat-template)."""
    folder = tmp_path_factory.mktemp("model")
    shutil.copytree(DEMO_MODEL, folder, dirs_exist_ok=True)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 5}))
    live = LiveServer(Engine.from_pretrained(folder, device="cpu"), trust_request_chat_template=True).start()
    yield live
    live.stop()


def test_truncate_prompt_tokens_keeps_the_last_k_tokens_and_the_bos_a_text_prompt_gets(server):
    tokenizer = server.engine.tokenizer
    plain = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert tokenizer.encode(PROMPT) == [tokenizer.bos_token_id] + plain  # the demo tokenizer adds a BOS
    # A text prompt: transformers' truncation (vLLM's): the BOS stays, the text keeps its last k - 1 tokens.
    got = completion(server, truncate_prompt_tokens=3)
    want = offline(server, [tokenizer.bos_token_id] + plain[-2:])
    assert (got["usage"]["prompt_tokens"], got["choices"][0]["text"]) == (3, want.text)
    ids = [40, 41, 42, 43, 44]
    for side, kept in [(None, [43, 44]), ("left", [43, 44]), ("right", [40, 41])]:
        got = completion(server, prompt=ids, truncate_prompt_tokens=2, truncation_side=side)
        assert (got["usage"]["prompt_tokens"], got["choices"][0]["text"]) == (2, offline(server, kept).text)
    # -1: as many as the context leaves beside max_tokens (a prompt that would not fit then runs)
    long = [40 + i % 50 for i in range(server.engine.max_model_len - 2)]
    assert completion(server, prompt=long, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == \
        server.engine.max_model_len - 4
    for k in (server.engine.max_model_len - 3, 0):
        assert_error(request(server, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                                 "truncate_prompt_tokens": k}),
                     400, param="truncate_prompt_tokens")
    # chat: the rendered prompt's tokens (no special tokens added to it by default)
    got = chat(server, truncate_prompt_tokens=3)
    want = offline(server, render(server)[-3:])
    assert (got["usage"]["prompt_tokens"], got["choices"][0]["message"]["content"]) == (3, want.text)


def test_add_special_tokens_completions_by_default_chat_on_request(server):
    tokenizer = server.engine.tokenizer
    plain = tokenizer.encode(PROMPT, add_special_tokens=False)
    got = completion(server, add_special_tokens=False)
    assert (got["usage"]["prompt_tokens"], got["choices"][0]["text"]) == (len(plain), offline(server, plain).text)
    assert completion(server)["usage"]["prompt_tokens"] == len(plain) + 1
    text = render(server, tokenize=False)
    got = chat(server, add_special_tokens=True)
    want = offline(server, tokenizer.encode(text, add_special_tokens=True))
    assert (got["usage"]["prompt_tokens"], got["choices"][0]["message"]["content"]) == \
        (len(render(server)) + 1, want.text)


def test_continue_final_message_leaves_the_final_message_open(server):
    continued = render(server, add_generation_prompt=False, continue_final_message=True)
    closed = render(server, add_generation_prompt=False)
    assert len(continued) < len(closed)
    got = chat(server, continue_final_message=True, add_generation_prompt=False)
    want = offline(server, continued)
    assert (got["usage"]["prompt_tokens"], got["choices"][0]["message"]["content"]) == (len(continued), want.text)
    assert chat(server, add_generation_prompt=False)["usage"]["prompt_tokens"] == len(closed)
    assert chat(server)["usage"]["prompt_tokens"] == len(render(server, add_generation_prompt=True))
    # add_generation_prompt defaults to true (vLLM's): both is a 400 naming the field
    error = assert_error(request(server, "POST", "/v1/chat/completions",
                                 {"model": MODEL, "messages": CONTINUED, "continue_final_message": True}),
                         400, param="continue_final_message")
    assert "add_generation_prompt" in error["message"]


def test_a_requests_chat_template_needs_the_trust_flag_and_then_wins_over_the_servers(server, tuned):
    template = ("{{ messages[0]['content'] }}|{{ reasoning_effort }}|{{ enable_thinking }}|{{ documents[0]['title'] }}"
                "|{{ flavour }}")
    fields = dict(chat_template=template, documents=[{"title": "Doc", "text": "..."}], reasoning_effort="low",
                  chat_template_kwargs={"flavour": "x"})
    assert_error(request(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": CONTINUED, **fields}),
                 400, param="chat_template")
    tokenizer = tuned.engine.tokenizer
    for extra, text in [({}, "Open a file|low|True|Doc|x"),
                        ({"chat_template_kwargs": {"flavour": "y", "enable_thinking": False}},
                         "Open a file|low|False|Doc|y"),
                        ({"reasoning_effort": "none"}, "Open a file|none|False|Doc|x")]:
        got = chat(tuned, **{**fields, **extra})
        want = offline(tuned, tokenizer.encode(text, add_special_tokens=False))
        assert (got["usage"]["prompt_tokens"], got["choices"][0]["message"]["content"]) == \
            (len(want.prompt_token_ids), want.text)
    # without one, the server's (here the fallback template, as conftest configures it)
    assert chat(tuned)["usage"]["prompt_tokens"] == len(render(tuned, add_generation_prompt=True))
    assert_error(request(tuned, "POST", "/v1/chat/completions",
                         {"model": MODEL, "messages": CONTINUED, "chat_template": "{% for %}"}), 400,
                 param="chat_template")


def test_chat_without_max_tokens_runs_to_the_checkpoints_max_new_tokens(tuned):
    """vLLM's default length (generation_config.json's max_new_tokens); an explicit max_tokens is not capped by it,
    and completions keep OpenAI's 16, also for max_tokens=null (vLLM's rules, without --generation-config)."""
    messages = [{"role": "user", "content": "Open a file"}]
    unset = request(tuned, "POST", "/v1/chat/completions", {"model": MODEL, "messages": messages, "ignore_eos": True})
    assert unset[0] == 200 and unset[1]["usage"]["completion_tokens"] == 5
    assert chat(tuned, messages, max_tokens=9, ignore_eos=True)["usage"]["completion_tokens"] == 9
    assert chat(tuned, messages, max_tokens=None, max_completion_tokens=7,
                ignore_eos=True)["usage"]["completion_tokens"] == 7
    for fields in ({}, {"max_tokens": None}):
        status, body = request(tuned, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "ignore_eos": True,
                                                                  **fields})
        assert status == 200 and body["usage"]["completion_tokens"] == 16


def _check_prompt_logprobs(server, got: list, token_ids: list[int], want, num_top: int) -> None:
    """``got`` is vLLM's prompt_logprobs of ``token_ids`` (None, then {id: {logprob, rank, decoded_token}})."""
    tokenizer = server.engine.tokenizer
    assert len(got) == len(token_ids) and got[0] is None
    for k in range(1, len(token_ids)):
        token, value = token_ids[k], want.prompt_logprobs[k]
        top = list((want.prompt_top_logprobs[k] if num_top else {}).items())
        assert list(got[k])[0] == str(token) and set(got[k]) == {str(token)} | {str(t) for t, _ in top}
        assert got[k][str(token)]["logprob"] == pytest.approx(value, abs=1e-5)
        for i, (t, v) in enumerate(top):
            assert got[k][str(t)] == {"logprob": pytest.approx(v, abs=1e-5), "rank": i + 1,
                                      "decoded_token": tokenizer.decode([t], skip_special_tokens=False)}
        if token not in dict(top):  # its own rank: the engine's, over the vocabulary
            assert got[k][str(token)]["rank"] == want.prompt_logprob_ranks[k] > len(top)


def test_prompt_logprobs_in_vllms_shape_per_choice_and_for_chat(server):
    ids = server.engine.tokenizer.encode(PROMPT)
    want = offline(server, ids, max_tokens=1, prompt_logprobs=2)
    got = completion(server, prompt_logprobs=2, max_tokens=1, n=2, temperature=1.0, seed=3)
    assert [c["prompt_logprobs"] for c in got["choices"]][0] == got["choices"][1]["prompt_logprobs"]
    _check_prompt_logprobs(server, got["choices"][0]["prompt_logprobs"], ids, want, 2)
    assert any(entry[str(t)]["rank"] > 2 for entry, t in zip(got["choices"][0]["prompt_logprobs"][1:], ids[1:]))
    # with echo and logprobs=1 too: each takes its own number of alternatives
    got = completion(server, prompt_logprobs=2, max_tokens=1, echo=True, logprobs=1)["choices"][0]
    _check_prompt_logprobs(server, got["prompt_logprobs"], ids, want, 2)
    assert all(len(top) <= 2 for top in got["logprobs"]["top_logprobs"][1:])
    assert "prompt_logprobs" not in completion(server)["choices"][0]
    # chat: the response's, the rendered prompt's
    prompt = render(server, add_generation_prompt=True)
    want = offline(server, prompt, max_tokens=1, prompt_logprobs=0)
    _check_prompt_logprobs(server, chat(server, prompt_logprobs=0, max_tokens=1)["prompt_logprobs"], prompt, want, 0)
    # vLLM's limits: none in a stream (0 aside), at most max_logprobs (-1 is the whole vocabulary)
    for path, body in [("/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1}),
                       ("/v1/chat/completions", {"messages": CONTINUED, "stream": True, "prompt_logprobs": -1}),
                       ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}),
                       ("/v1/chat/completions", {"messages": CONTINUED, "prompt_logprobs": 21})]:
        assert_error(request(server, "POST", path, {"model": MODEL, **body}), 400, param="prompt_logprobs")
    status, body = request(server, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True, "prompt_logprobs": 0})
    assert status == 200 and "prompt_logprobs" not in body


def test_return_tokens_as_token_ids_writes_token_id_n(server):
    ids = server.engine.tokenizer.encode(PROMPT)
    want = offline(server, ids, max_tokens=3, logprobs=1)
    got = completion(server, max_tokens=3, logprobs=1, echo=True, return_tokens_as_token_ids=True)["choices"][0]
    tokens = [f"token_id:{t}" for t in ids + want.token_ids]
    assert got["logprobs"]["tokens"] == tokens
    assert got["logprobs"]["text_offset"] == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    assert all(key.startswith("token_id:") for top in got["logprobs"]["top_logprobs"][1:] for key in top)
    prompt = render(server, add_generation_prompt=True)
    want = offline(server, prompt, max_tokens=3, logprobs=1)
    content = chat(server, max_tokens=3, logprobs=True, top_logprobs=1,
                   return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in content] == [(f"token_id:{t}", list(f"token_id:{t}".encode()))
                                                           for t in want.token_ids]
    assert [e["top_logprobs"][0]["token"] for e in content] == [f"token_id:{next(iter(top))}"
                                                                for top in want.top_logprobs]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_only(server, stream):
    ids = server.engine.tokenizer.encode(PROMPT)
    want = offline(server, ids, max_tokens=1, prompt_logprobs=1)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "n": 2}
    if stream:
        status, text = request(server, "POST", "/v1/completions",
                               {**body, "stream": True, "stream_options": {"include_usage": True}})
        events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
        choices = {}
        for event in events[:-1]:
            for c in event["choices"]:
                old = choices.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [], "ends": []})
                old["text"] += c["text"]
                old["tokens"] += c["logprobs"]["tokens"] if c["logprobs"] else []
                old["token_logprobs"] += c["logprobs"]["token_logprobs"] if c["logprobs"] else []
                old["ends"].append(c["finish_reason"])
        usage = events[-1]["usage"]
        assert [c["ends"][-1] for c in choices.values()] == ["length", "length"]
    else:
        status, got = request(server, "POST", "/v1/completions", body)
        assert status == 200, got
        choices = {c["index"]: {"text": c["text"], **c["logprobs"]} for c in got["choices"]}
        usage = got["usage"]
        assert [c["finish_reason"] for c in got["choices"]] == ["length", "length"]
    tokenizer = server.engine.tokenizer
    assert sorted(choices) == [0, 1]
    for choice in choices.values():
        assert choice["text"] == PROMPT
        assert choice["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        assert choice["token_logprobs"][0] is None
        assert choice["token_logprobs"][1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-5)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 0)


def test_refused_fields_are_each_a_400_naming_them_and_ignored_ones_pass():
    """Every REFUSED_FIELDS entry, set to something that is not a no-op, is refused by parse_request; every
    IGNORED_FIELDS one is taken."""
    ignored = [name for names in IGNORED_FIELDS for name in names.split(", ")]
    assert not set(ignored) & set(REFUSED_FIELDS)
    for model, fields in [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": [
            {"role": "user", "content": "x"}]})]:
        parse_request(model, json.dumps({**fields, **{name: "x" for name in ignored}}).encode())
    for name in REFUSED_FIELDS:
        *parents, field = name.split(".")
        value = {"priority": 1, "thinking_token_budget": 10}.get(field, True)
        body = {"stream": True, parents[0]: {field: value}} if parents else {field: value}
        for model in (CompletionRequest, ChatCompletionRequest):
            if model is CompletionRequest and name == "echo":
                continue  # completions implement echo
            fields = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
            with pytest.raises(RequestError) as refused:
                parse_request(model, json.dumps({**fields, **body}).encode())
            assert (refused.value.param, refused.value.code) == (name.split(".")[0], "unsupported")
            assert refused.value.message.startswith(name)


def test_refused_vllm_fields_answer_400_and_no_op_or_other_unknown_fields_change_nothing(server):
    for path, fields, param in [("/v1/chat/completions", {"echo": True}, "echo"),
                                ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
                                ("/v1/completions", {"priority": -1}, "priority"),
                                ("/v1/completions", {"logprob_token_ids": [5]}, "logprob_token_ids"),
                                ("/v1/chat/completions", {"stream": True, "stream_options": {
                                    "include_usage": True, "continuous_usage_stats": True}}, "stream_options")]:
        body = {"model": MODEL, "max_tokens": 4, **({"prompt": PROMPT} if "chat" not in path else
                                                  {"messages": CONTINUED}), **fields}
        error = assert_error(request(server, "POST", path, body), 400, param=param, code="unsupported")
        assert "not supported" in error["message"]
    want = completion(server)["choices"][0]["text"]
    ignored = {"priority": 0, "use_beam_search": False, "echo": False, "metadata": {"a": "b"}, "store": True,
               "user": "u", "spaces_between_special_tokens": False, "detokenize": False, "request_id": "r",
               "logits_processors": [], "thinking_token_budget": -1, "vllm_xargs": None}
    assert completion(server, **ignored)["choices"][0]["text"] == want


def test_tools_with_tool_choice_none_reach_the_template_and_the_reply_is_text(tuned):
    template = "{{ messages[0]['content'] }}|{{ tools[0]['function']['name'] }}"
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    got = chat(tuned, chat_template=template, tools=tools, tool_choice="none")
    want = offline(tuned, tuned.engine.tokenizer.encode("Open a file|get_weather", add_special_tokens=False))
    assert (got["usage"]["prompt_tokens"], got["choices"][0]["message"]["content"]) == \
        (len(want.prompt_token_ids), want.text)
    assert "tool_calls" not in got["choices"][0]["message"] or not got["choices"][0]["message"]["tool_calls"]


def test_tokenize_gives_the_ids_the_completion_and_chat_endpoints_run_and_detokenize_inverts_it(server):
    text = completion(server, prompt=PROMPT, max_tokens=1)
    status, body = request(server, "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    assert status == 200, body
    ids = server.engine.tokenizer.encode(PROMPT)
    assert body == {"count": len(ids), "max_model_len": server.engine.max_model_len, "tokens": ids,
                    "token_strs": [server.engine.tokenizer.backend.id_to_token(t) for t in ids]}
    assert body["count"] == text["usage"]["prompt_tokens"]
    status, plain = request(server, "POST", "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert plain["tokens"] == server.engine.tokenizer.encode(PROMPT, add_special_tokens=False) and plain["token_strs"] is None
    fields = dict(add_generation_prompt=False, continue_final_message=True)
    status, chat_ids = request(server, "POST", "/tokenize", {"messages": CONTINUED, **fields})
    assert status == 200 and chat_ids["tokens"] == render(server, **fields)
    assert chat_ids["count"] == chat(server, **fields)["usage"]["prompt_tokens"]
    status, back = request(server, "POST", "/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and back == {"prompt": server.engine.tokenizer.decode(ids, skip_special_tokens=False)}
    assert_error(request(server, "POST", "/detokenize", {"tokens": [10**6]}), 400, param="tokens")
    assert_error(request(server, "POST", "/tokenize", {"prompt": 5}), 400, param="prompt")
    assert_error(request(server, "POST", "/tokenize", {"model": "other", "prompt": "x"}), 404, param="model")
    assert_error(request(server, "POST", "/tokenize", {"messages": CONTINUED, **fields, "add_generation_prompt": True}),
                 400, param="continue_final_message")
