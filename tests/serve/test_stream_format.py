"""The per-token fast paths write what the plain ones did: streamed chunks written from a request's
head equal ``sse`` of the whole payload, byte for byte; ``LoopHistogram`` / ``LoopCounter`` read out
at /metrics as prometheus_client's ``Histogram`` / ``Counter`` fed the same values; a consumer
cancelled while it waits on a ``RequestStream`` loses no output."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("pydantic")  # the server's extra (atom_core.serve.protocol): absent, the server tests skip

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest  # noqa: E402

from atom_core.engine.async_engine import AsyncEngine  # noqa: E402
from atom_core.engine.request_stream import RequestStream, _Delta  # noqa: E402
from atom_core.engine.sampling_params import SamplingParams  # noqa: E402
from atom_core.serve.chat import ChatJob  # noqa: E402
from atom_core.serve.common import ServerConfig, ServerContext, json_value, sse, sse_head  # noqa: E402
from atom_core.serve.completions import CompletionJob  # noqa: E402
from atom_core.serve.engine_options import FALLBACK_CHAT_TEMPLATE  # noqa: E402
from atom_core.serve.metrics import ITL_BUCKETS, LoopCounter, LoopHistogram, ServerMetrics  # noqa: E402
from atom_core.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_request  # noqa: E402
from tests.serve.conftest import demo_engine  # noqa: E402

TEXTS = ["", " the", 'say "hi"\n', "tab\there\\back/slash", "\x00\x1f\x7f control", "ünïcødé €", "日本語",
         "emoji 🙂", "\u2028\u2029 separators", "\ud800 lone surrogate", "</script>"]
LOGPROBS = [None, {"tokens": [" a"], "token_logprobs": [-0.5], "top_logprobs": [{" a": -0.5, "é": -9999.0}],
                   "text_offset": [3]}]
CHAT_LOGPROBS = [None, {"content": [{"token": " a", "logprob": -1.25, "bytes": [32, 97], "top_logprobs": []}]}]
ENDINGS = [(None, None), ("length", None), ("stop", None), ("stop", "\n\n"), ("stop", 151645), ("stop", "é\"")]


@pytest.fixture(scope="module")
def ctx():
    engine = demo_engine()
    async_engine = AsyncEngine(engine)
    return ServerContext(async_engine, ServerConfig(model_name='demo "model" é', chat_template=FALLBACK_CHAT_TEMPLATE),
                         ServerMetrics(async_engine))


def test_completion_chunks_equal_sse_of_the_payload(ctx):
    job = CompletionJob(ctx, parse_request(CompletionRequest, json.dumps(
        {"prompt": [1, 2, 3], "stream": True, "n": 2}).encode()))
    for text in TEXTS:
        for logprobs in LOGPROBS:
            for finish_reason, stop_reason in ENDINGS:
                for index in (0, 1, 17):
                    want = sse({"id": job.id, "object": "text_completion", "created": job.created,
                                "model": ctx.config.model_name,
                                "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                             "finish_reason": finish_reason, "stop_reason": stop_reason}]})
                    assert job.chunk(index, text, logprobs, finish_reason, stop_reason) == want


def test_chat_chunks_equal_sse_of_the_payload(ctx):
    job = ChatJob(ctx, parse_request(ChatCompletionRequest, json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()))
    for text in TEXTS:
        for logprobs in CHAT_LOGPROBS:
            for finish_reason, stop_reason in ENDINGS:
                want = sse(job._chunk([{"index": 3, "delta": {"content": text}, "logprobs": logprobs,
                                        "finish_reason": finish_reason, "stop_reason": stop_reason}]))
                assert job.delta_chunk(3, text, logprobs, finish_reason, stop_reason) == want


def test_sse_head_and_json_value_compose_to_sse():
    fields = {"id": "x\"y", "object": "o", "created": 12, "model": "m\u00e9"}
    for value in [None, "s", 'q"\n', 3, -2.5, 1e-300, True, [1, "a"], {"k": [None, 0.1]}]:
        assert sse_head(fields) + f'"v":{json_value(value)}' + "}]}\n\n" == sse({**fields, "choices": [{"v": value}]})


def _samples(registry) -> list[str]:
    """The exposition's lines, the creation timestamps (the only values that differ) left out."""
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_loop_histogram_and_counter_read_out_as_prometheus_client_ones():
    ours, theirs = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
    histogram = LoopHistogram("h_seconds", "A histogram.", ITL_BUCKETS)
    counter = LoopCounter("c", "A counter.")
    ours.register(histogram)
    ours.register(counter)
    reference = Histogram("h_seconds", "A histogram.", buckets=ITL_BUCKETS, registry=theirs)
    reference_counter = Counter("c", "A counter.", registry=theirs)
    assert _samples(ours) == _samples(theirs)  # nothing observed
    values = [0.0, 0.001, 0.0010000001, 0.0042, 0.02, 0.02, 0.3, 4.99, 5.0, 5.01, 1e9, 0.1 + 0.2, 1 / 3]
    for value in values:
        histogram.observe(value)
        reference.observe(value)
    for amount in (1, 3, 0, 7):
        counter.inc(amount)
        reference_counter.inc(amount)
    assert _samples(ours) == _samples(theirs)
    assert any(line.startswith("h_seconds_sum") for line in _samples(ours))
    assert sum(line.startswith("h_seconds_created") for line in generate_latest(ours).decode().splitlines()) == 1


def test_a_consumer_cancelled_while_waiting_loses_no_output(ctx):
    async def main():
        async_engine = ctx.async_engine
        stream = RequestStream(async_engine, "r", SamplingParams(max_tokens=2))
        stream.state = "running"
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not stream._waiters
        late = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        for k in (1, 2):
            stream._on_delta(_Delta(0, [5], "x", None, None, k, "length" if k == 2 else None, None, float(k),
                                    [1] if k == 1 else None, 0, None, None))
        first = await late
        rest = [out async for out in stream]
        return [first, *rest]

    outs = asyncio.run(main())
    assert [o.num_output_tokens for o in outs] == [1, 2] and outs[-1].text == "xx"
