"""What one request cannot do to the others: a prompt being tokenized (or a chat template being rendered) does
not stop the server answering other requests, a request's own chat template cannot make gigabytes, and
browsers get CORS answers (vLLM's defaults)."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from atom_core.engine.chat_template import MAX_REPEAT_ITEMS  # noqa: E402
from atom_core.serve.common import ServerContext  # noqa: E402
from tests.serve.conftest import API_KEY, DEADLINE_S, MODEL, LiveServer, demo_engine  # noqa: E402


def _post(url: str, body: dict, *, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_prompt_being_tokenized_does_not_stop_the_server_answering_others(monkeypatch):
    """The completion's tokenization is held until /health has answered: answered on the event loop, the
    request would hold the loop and /health would wait for it (the hold then times out and the test fails)."""
    live = LiveServer(demo_engine()).start()
    entered, health_answered = threading.Event(), threading.Event()
    encode = ServerContext.encode

    def held_encode(self, text, **kwargs):
        if text == "held prompt":
            entered.set()
            assert health_answered.wait(DEADLINE_S / 4), "/health did not answer while a prompt was tokenized"
        return encode(self, text, **kwargs)

    monkeypatch.setattr(ServerContext, "encode", held_encode)
    try:
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault("completion", _post(
            f"{live.url}/v1/completions", {"model": MODEL, "prompt": "held prompt", "max_tokens": 2})))
        worker.start()
        assert entered.wait(DEADLINE_S)
        with urllib.request.urlopen(f"{live.url}/health", timeout=DEADLINE_S) as response:
            assert response.status == 200
        health_answered.set()
        worker.join(DEADLINE_S)
        status, body = result["completion"]
        assert status == 200 and body["usage"]["completion_tokens"] == 2
    finally:
        live.stop()


@pytest.fixture(scope="module")
def trusting_server():
    live = LiveServer(demo_engine(), trust_request_chat_template=True).start()
    yield live
    live.stop()


@pytest.mark.parametrize("template, message", [
    ("{{ 'a' * 100000000 }}", f"a repetition of 100000000 items \\(at most {MAX_REPEAT_ITEMS}\\)"),
    ("{{ [0] * 2000000 }}", "a repetition of 2000000 items"),
    ("{{ 10 ** 100000 }}", "a power of exponent 100000"),
])
def test_a_requests_own_chat_template_cannot_render_gigabytes(trusting_server, template, message):
    status, body = _post(f"{trusting_server.url}/v1/chat/completions",
                         {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                          "chat_template": template})
    assert status == 400
    assert re.search(message, body["error"]["message"])
    ok, reply = _post(f"{trusting_server.url}/v1/chat/completions",
                      {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                       "chat_template": "{{ 'ab' * 3 }}{{ messages[0]['content'] }}"})
    assert ok == 200 and reply["usage"]["prompt_tokens"] > 0


def test_browsers_get_cors_answers_on_every_origin_by_default(server):
    preflight = urllib.request.Request(f"{server.url}/v1/chat/completions", method="OPTIONS",
                                       headers={"Origin": "http://localhost:3000",
                                                "Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers": "authorization,content-type"})
    with urllib.request.urlopen(preflight, timeout=DEADLINE_S) as response:
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in response.headers["Access-Control-Allow-Methods"]
    status, _ = _post(f"{server.url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                      headers={"Origin": "http://localhost:3000"})
    assert status == 200


def test_cors_origins_can_be_limited():
    live = LiveServer(demo_engine(), allowed_origins=("http://allowed.example",)).start()
    try:
        for origin, allowed in (("http://allowed.example", True), ("http://other.example", False)):
            request = urllib.request.Request(f"{live.url}/v1/models", headers={
                "Origin": origin, "Authorization": f"Bearer {API_KEY}"})
            with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
                assert (response.headers.get("Access-Control-Allow-Origin") == origin) == allowed
    finally:
        live.stop()
