"""Refusals: malformed JSON, wrong types, absurd values and too-long prompts get 400 with an OpenAI
error body, a missing key 401, an unknown model or route 404, a too-large body 413, a full waiting
queue 503, a failing step 500 (or an error event mid-stream); the server is unharmed after each."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from tests.serve.conftest import API_KEY, MODEL, LiveServer, demo_engine, metric_samples

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def request(server, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    """(status, parsed JSON or text) of one raw HTTP request."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or AUTH)})
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


def assert_error(status_and_body, status: int, param: str | None = "__any__", code: str | None = "__any__"):
    got_status, body = status_and_body
    assert got_status == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param != "__any__":
        assert body["error"]["param"] == param, body
    if code != "__any__":
        assert body["error"]["code"] == code, body
    return body["error"]


def completion(**fields):
    return {"model": MODEL, "prompt": "Return the number of", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


@pytest.fixture
def unharmed(server):
    """After the test: the server still answers correctly and holds no request or block."""
    yield
    status, body = request(server, "POST", "/v1/completions", completion(temperature=0))
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert request(server, "GET", "/health")[0] == 200
    server.assert_no_block_leaked()


@pytest.mark.parametrize("body", [b'{"prompt": "x", ', b"not json", b"", b'{"prompt": "x"}}', b"\xff\xfe"],
                         ids=["truncated", "text", "empty", "trailing", "bytes"])
def test_malformed_json_is_a_400(server, unharmed, body):
    assert_error(request(server, "POST", "/v1/completions", body), 400, param=None)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_that_is_not_an_object_is_a_400(server, unharmed, path):
    assert_error(request(server, "POST", path, b"[1, 2]"), 400)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", completion(temperature="hot"), "temperature"),
    ("/v1/completions", completion(max_tokens=1.5), "max_tokens"),
    ("/v1/completions", completion(max_tokens="4"), "max_tokens"),
    ("/v1/completions", completion(n=True), "n"),
    ("/v1/completions", completion(stream="yes"), "stream"),
    ("/v1/completions", completion(prompt=5), "prompt"),
    ("/v1/completions", completion(prompt=[1, "a"]), "prompt"),
    ("/v1/completions", completion(prompt=[[1, 2], []]), "prompt"),
    ("/v1/completions", completion(prompt=None), "prompt"),
    ("/v1/completions", completion(stop=5), "stop"),
    ("/v1/completions", completion(logit_bias={"a": 1}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"5": "up"}), "logit_bias"),
    ("/v1/completions", completion(seed="x"), "seed"),
    ("/v1/completions", completion(stream=True, stream_options={"include_usage": "yes"}), "stream_options"),
    ("/v1/chat/completions", chat(messages="hi"), "messages"),
    ("/v1/chat/completions", chat(messages=[{"content": "no role"}]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    ("/v1/chat/completions", chat(logprobs=1), "logprobs"),
    ("/v1/chat/completions", chat(response_format={"type": "yaml"}), "response_format"),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else None)
def test_wrong_types_are_a_400_naming_the_field(server, unharmed, path, body, param):
    assert_error(request(server, "POST", path, body), 400, param=param)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", completion(temperature=1e9), "temperature"),
    ("/v1/completions", completion(temperature=-1), "temperature"),
    ("/v1/completions", completion(max_tokens=0), "max_tokens"),
    ("/v1/completions", completion(max_tokens=10**12), "max_tokens"),
    ("/v1/completions", completion(n=0), "n"),
    ("/v1/completions", completion(n=10**6), "n"),
    ("/v1/completions", completion(top_p=0), "top_p"),
    ("/v1/completions", completion(top_p=2), "top_p"),
    ("/v1/completions", completion(presence_penalty=5), "presence_penalty"),
    ("/v1/completions", completion(logprobs=100), "logprobs"),
    ("/v1/completions", completion(seed=2**70), "seed"),
    ("/v1/completions", completion(stream_options={"include_usage": True}), "stream_options"),
    ("/v1/chat/completions", chat(stream=False, stream_options={"include_usage": False}), "stream_options"),
    ("/v1/completions", completion(prompt=[1, 2, 10**9]), "prompt"),
    ("/v1/completions", completion(prompt=[-1]), "prompt"),
    ("/v1/completions", completion(prompt=[]), "prompt"),
    ("/v1/completions", completion(stop=["x"] * 100), "stop"),
    ("/v1/completions", completion(min_tokens=10), "min_tokens"),
    ("/v1/completions", completion(best_of=3), "best_of"),
    ("/v1/completions", completion(suffix="the end"), "suffix"),
    ("/v1/completions", completion(logit_bias={str(10**9): 1}), "logit_bias"),
    ("/v1/completions", completion(stop_token_ids=[10**6]), "stop_token_ids"),
    ("/v1/chat/completions", chat(stop_token_ids=[2048]), "stop_token_ids"),
    ("/v1/chat/completions", chat(top_logprobs=3), "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    ("/v1/chat/completions", chat(messages=[]), "messages"),
    ("/v1/chat/completions", chat(max_completion_tokens=10**9), "max_completion_tokens"),
    ("/v1/chat/completions", chat(tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", chat(tool_choice="auto"), "tool_choice"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"special_tokens": {}}), "chat_template_kwargs"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"template": "x"}), "chat_template_kwargs"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"self": 1}), "chat_template_kwargs"),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else None)
def test_absurd_values_are_a_400(server, unharmed, path, body, param):
    assert_error(request(server, "POST", path, body), 400, param=param)


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format", "needs json_schema.schema"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}), "response_format", "Unsupported type"),
    ("/v1/completions", completion(guided_regex="[a-z"), "guided_regex", "Unclosed"),
    ("/v1/completions", completion(guided_json=5), "guided_json", "JSON schema"),
    ("/v1/completions", completion(guided_choice=[]), "guided_choice", "non-empty list"),
    ("/v1/completions", completion(guided_grammar='root ::= "a" |'), "guided_grammar", "EBNF"),
    ("/v1/completions", completion(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs",
     "exactly one of"),
    ("/v1/completions", completion(structured_outputs={"jsn": {}}), "structured_outputs", "not StructuredOutputs"),
    ("/v1/chat/completions", chat(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex",
     "at most one of"),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else None)
def test_bad_structured_output_is_a_400_naming_the_field(server, unharmed, path, body, param, message):
    pytest.importorskip("xgrammar")
    error = assert_error(request(server, "POST", path, body), 400, param=param)
    assert message in error["message"]


@pytest.mark.parametrize("path, body", [("/v1/completions", completion(n=2, temperature=0)),
                                        ("/v1/chat/completions", chat(n=3, temperature=0))])
def test_n_above_one_with_greedy_sampling_is_a_400_naming_n(server, unharmed, path, body):
    error = assert_error(request(server, "POST", path, body), 400, param="n")
    assert "must be 1 when sampling greedily" in error["message"]


def test_too_long_prompts_are_a_400_context_length_exceeded(server, unharmed):
    long_ids = list(range(1, server.engine.max_model_len + 5))
    assert_error(request(server, "POST", "/v1/completions", completion(prompt=long_ids)), 400, param="prompt",
                 code="context_length_exceeded")
    fits_alone = list(range(1, server.engine.max_model_len - 2))
    assert_error(request(server, "POST", "/v1/completions", completion(prompt=fits_alone, max_tokens=10)), 400,
                 param="max_tokens", code="context_length_exceeded")
    long_text = "the file " * server.engine.max_model_len
    assert_error(request(server, "POST", "/v1/chat/completions",
                         chat(messages=[{"role": "user", "content": long_text}], max_tokens=None)), 400,
                 param="messages", code="context_length_exceeded")


def test_a_missing_or_wrong_key_is_a_401_and_health_and_metrics_need_none(server, unharmed):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}):
        for method, path, body in [("POST", "/v1/completions", completion()), ("GET", "/v1/models", None),
                                   ("POST", "/v1/chat/completions", chat()), ("POST", "/tokenize", {"prompt": "a"}),
                                   ("POST", "/detokenize", {"tokens": [1]})]:
            assert_error(request(server, method, path, body, headers=headers or {"X-None": "1"}), 401,
                         code="invalid_api_key")
    assert request(server, "GET", "/health", headers={"X-None": "1"})[0] == 200
    assert request(server, "GET", "/metrics", headers={"X-None": "1"})[0] == 200


def test_health_is_a_503_naming_the_failure_while_the_engine_cannot_step(server, monkeypatch):
    """What a dead worker rank or replica makes ``Engine.check_health`` raise (tests/engine/test_multi_rank.py and
    test_data_parallel.py kill real ones) turns /health into a 503 that names it."""
    from atom_core.engine.distributed import WorkerFailedError

    def dead():
        raise WorkerFailedError("this multi-rank engine can no longer run: worker rank 1 (pid 7) was killed by SIGKILL")

    monkeypatch.setattr(server.engine, "check_health", dead)
    error = assert_error(request(server, "GET", "/health"), 503, code="engine_failed")
    assert "worker rank 1 (pid 7) was killed by SIGKILL" in error["message"]
    monkeypatch.undo()
    assert request(server, "GET", "/health") == (200, {"status": "ok"})


def test_unknown_model_route_and_method_are_404_and_405(server, unharmed):
    assert_error(request(server, "POST", "/v1/completions", completion(model="gpt-4")), 404, param="model",
                 code="model_not_found")
    assert_error(request(server, "GET", "/v1/nothing"), 404)
    assert_error(request(server, "GET", "/v1/completions"), 405)


def test_the_bounded_queue_answers_503_the_body_limit_413_and_the_output_limit_400():
    live = LiveServer(demo_engine(), max_waiting_requests=2, max_request_bytes=4096, max_output_tokens=32).start()
    try:
        assert_error(request(live, "POST", "/v1/completions", completion(prompt="x" * 5000)), 413,
                     code="request_too_large")
        assert_error(request(live, "POST", "/v1/completions", completion(max_tokens=33)), 400, param="max_tokens")
        release = threading.Event()
        blocked = live.async_engine.submit(lambda e: release.wait())  # no step runs: requests stay waiting
        results = []
        waiting = [threading.Thread(target=lambda: results.append(request(live, "POST", "/v1/completions",
                                                                          completion(temperature=0))))
                   for _ in range(2)]
        for thread in waiting:
            thread.start()
        live_wait(lambda: live.async_engine.stats().num_waiting == 2)
        assert_error(request(live, "POST", "/v1/completions", completion()), 503, code="queue_full")
        assert_error(request(live, "POST", "/v1/chat/completions", chat()), 503, code="queue_full")
        samples = metric_samples(request(live, "GET", "/metrics")[1])
        assert samples[("atom_core_num_requests_waiting", ())] == 2
        assert samples[("atom_core_requests_rejected_total", (("reason", "queue_full"),))] == 2
        release.set()
        blocked.result(60)
        for thread in waiting:
            thread.join(120)
        assert [status for status, _ in results] == [200, 200]
        assert request(live, "POST", "/v1/completions", completion())[0] == 200
        live.assert_no_block_leaked()
    finally:
        live.stop()


def test_the_output_limit_caps_a_completion_that_leaves_max_tokens_to_the_default():
    live = LiveServer(demo_engine(), max_output_tokens=8).start()  # below completions' default of 16
    try:
        status, body = request(live, "POST", "/v1/completions", completion(ignore_eos=True, max_tokens=None))
        assert status == 200 and body["usage"]["completion_tokens"] == 8
    finally:
        live.stop()


def live_wait(condition, deadline_s: float = 120) -> None:
    import time

    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


class FailingForward:
    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        raise RuntimeError("injected failure")


def test_a_failing_step_is_a_500_or_an_error_event_and_the_server_keeps_serving(server, unharmed):
    server.wait_idle()
    server.submit(lambda e: setattr(e.model, "forward", FailingForward(e.model)))
    try:
        error = assert_error(request(server, "POST", "/v1/completions", completion()), 500)
        assert "injected failure" in error["message"] and error["type"] == "server_error"
        status, text = request(server, "POST", "/v1/chat/completions", chat(stream=True))
        assert status == 200
        events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "injected failure" in json.loads(events[-2])["error"]["message"]
    finally:
        server.submit(lambda e: delattr(e.model, "forward"))


def test_an_engine_whose_ranks_failed_answers_503_engine_failed(server, unharmed):
    from atom_core.engine.distributed import DistributedEngineError

    def refuse(*args, **kwargs):
        raise DistributedEngineError("this multi-rank engine can no longer run: worker rank 1 was killed")

    server.wait_idle()
    server.submit(lambda e: setattr(e, "add_request", refuse))
    try:
        error = assert_error(request(server, "POST", "/v1/completions", completion()), 503, code="engine_failed")
        assert "can no longer run" in error["message"]
    finally:
        server.submit(lambda e: delattr(e, "add_request"))
