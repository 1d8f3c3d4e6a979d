"""vLLM's routes and naming rules on the live test server: ``/version`` and ``/ping`` (open, as vLLM leaves
them; /ping answers as /health does), several served model names (a request may give any, responses give the
first, /v1/models lists them all), and chat's reply role (the last message's without a generation prompt)."""

from __future__ import annotations

import json

import pytest

import atom_core
from tests.serve.conftest import MODEL, LiveServer, demo_engine
from tests.serve.test_server_errors import assert_error, request

NO_KEY = {"X-None": "1"}  # (request() sends the key when given no headers)
HI = [{"role": "user", "content": "hi"}]


def test_version_gives_the_package_version_without_a_key(server):
    assert request(server, "GET", "/version", headers=NO_KEY) == (200, {"version": atom_core.__version__})


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health_without_a_key(server, method):
    assert request(server, method, "/ping", headers=NO_KEY) == (200, {"status": "ok"})


def test_ping_is_a_503_naming_the_failure_as_health_is(server, monkeypatch):
    from atom_core.engine.distributed import WorkerFailedError

    def dead():
        raise WorkerFailedError("this multi-rank engine can no longer run: worker rank 1 (pid 7) was killed by SIGKILL")

    monkeypatch.setattr(server.engine, "check_health", dead)
    for method in ("GET", "POST"):
        ping = request(server, method, "/ping", headers=NO_KEY)
        assert ping == request(server, "GET", "/health", headers=NO_KEY)
        assert "worker rank 1 (pid 7)" in assert_error(ping, 503, code="engine_failed")["message"]


# ---- several served names


@pytest.fixture(scope="module")
def aliased():
    """A server named MODEL that also answers to "second" and "third" (--served-model-name demo second third)."""
    live = LiveServer(demo_engine(), model_aliases=("second", "third")).start()
    yield live
    live.stop()


@pytest.mark.parametrize("name", [MODEL, "second", "third", None])
def test_a_request_naming_any_served_name_is_served_and_answered_with_the_first(aliased, name):
    fields = {} if name is None else {"model": name}
    status, body = request(aliased, "POST", "/v1/completions", {"prompt": "Return the", "max_tokens": 2, **fields})
    assert status == 200 and body["model"] == MODEL, body
    status, body = request(aliased, "POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **fields})
    assert status == 200 and body["model"] == MODEL, body
    status, body = request(aliased, "POST", "/tokenize", {"prompt": "Return the", **fields})
    assert status == 200 and body["count"] > 0, body


def test_a_streamed_response_to_an_alias_gives_the_first_name(aliased):
    status, text = request(aliased, "POST", "/v1/chat/completions",
                           {"model": "third", "messages": HI, "max_tokens": 2, "stream": True})
    events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    assert status == 200 and events and {e["model"] for e in events} == {MODEL}


def test_an_unknown_name_is_still_a_404_beside_aliases(aliased):
    for path, body in [("/v1/completions", {"prompt": "Return the", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": HI, "max_tokens": 2})]:
        assert_error(request(aliased, "POST", path, {"model": "fourth", **body}), 404, param="model",
                     code="model_not_found")


def test_models_lists_every_served_name_first_name_first(aliased):
    status, body = request(aliased, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL, "second", "third"]
    assert len({(m["max_model_len"], m["vocab_size"]) for m in body["data"]}) == 1


def test_without_aliases_models_lists_one_name_and_an_alias_is_a_404(server):
    assert [m["id"] for m in request(server, "GET", "/v1/models")[1]["data"]] == [MODEL]
    assert_error(request(server, "POST", "/v1/completions", {"model": "second", "prompt": "a", "max_tokens": 1}),
                 404, code="model_not_found")


# ---- chat's reply role


def _chat_roles(server, messages, **fields) -> tuple[str, str]:
    """(the non-streamed message's role, the streamed first delta's role) of a 2-token greedy chat."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, **fields}
    status, got = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, got
    status, text = request(server, "POST", "/v1/chat/completions", {**body, "stream": True})
    first = json.loads(text.split("\n\n")[0].removeprefix("data: "))
    assert status == 200 and "role" in first["choices"][0]["delta"], first
    return got["choices"][0]["message"]["role"], first["choices"][0]["delta"]["role"]


def test_chat_role_is_assistant_with_a_generation_prompt(server):
    assert _chat_roles(server, HI) == ("assistant", "assistant")


def test_chat_role_is_the_last_messages_without_a_generation_prompt(server):
    assert _chat_roles(server, HI, add_generation_prompt=False) == ("user", "user")
    system = [{"role": "system", "content": "be brief"}]
    assert _chat_roles(server, system, add_generation_prompt=False) == ("system", "system")

