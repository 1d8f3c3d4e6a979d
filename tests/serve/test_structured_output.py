"""Structured output through the server and the official ``openai`` client: ``response_format``
json_schema (also through the client's ``parse`` helper and a pydantic model) and json_object on chat,
vLLM's ``guided_regex`` / ``guided_choice`` on completions, streamed chunks adding up to a matching
text. The demo model's text means nothing; what is checked is that it satisfies the constraint."""

from __future__ import annotations

import json
import re

import pytest

from tests.serve.conftest import MODEL

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


def test_chat_json_schema_response_format_gives_json_that_follows_the_schema(server):
    client = server.client()
    got = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=120, temperature=1.0, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    choice = got.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    value = json.loads(choice.message.content)
    assert set(value) == {"city", "population", "capital"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 8
    assert isinstance(value["population"], int) and 0 <= value["population"] <= 99999
    assert isinstance(value["capital"], bool)
    server.assert_no_block_leaked()


def test_the_clients_parse_helper_fills_a_pydantic_model(server):
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        word: str = Field(max_length=6)
        count: int = Field(ge=0, le=9)

    got = server.client().chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0,
                                                 seed=2, response_format=Answer)
    parsed = got.choices[0].message.parsed
    assert isinstance(parsed, Answer) and len(parsed.word) <= 6 and 0 <= parsed.count <= 9


def test_chat_json_object_is_a_json_object_or_a_prefix_of_one(server):
    got = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0.8,
                                                  seed=3, response_format={"type": "json_object"})
    text, reason = got.choices[0].message.content, got.choices[0].finish_reason
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert reason == "length" and got.usage.completion_tokens == 40


def test_completions_guided_regex_streamed_and_guided_choice(server):
    client = server.client()
    regex = r"[a-z]{2,5}( [a-z]{2,5}){0,2}\."
    kwargs = {"model": MODEL, "prompt": "Return the number of", "max_tokens": 60, "temperature": 1.0, "seed": 9,
                  "extra_body": {"guided_regex": regex}}
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop" and re.fullmatch(regex, whole.text), whole.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole.text
    choices = ["alpha", "beta gamma"]
    got = client.completions.create(model=MODEL, prompt="The default is", max_tokens=20, temperature=1.0, n=3,
                                    seed=4, extra_body={"guided_choice": choices})
    assert [c.text in choices for c in got.choices] == [True] * 3
    server.assert_no_block_leaked()


def test_the_server_builds_the_grammar_compiler_before_it_serves():
    """Built at the first structured request, importing the grammar library held the interpreter lock for most
    of a second, stalling every running stream; the server's start-up does it instead."""
    from tests.serve.conftest import LiveServer, demo_engine

    engine = demo_engine()
    assert engine._grammar_compiler is None
    live = LiveServer(engine).start()
    try:
        assert engine._grammar_compiler is not None
    finally:
        live.stop()
