"""Load and disconnects: 200 concurrent streaming clients, a fifth of them hanging up mid-stream;
every completed greedy stream equals the offline ``Engine.generate`` result, every request is
accounted for in /metrics, no block is leaked and /health is fine afterwards. A client that hangs
up aborts its request at once (checked with the engine held still)."""

from __future__ import annotations

import asyncio
import threading

from atom_core.engine import SamplingParams
from tests.serve.conftest import MODEL, LiveServer, demo_engine, metric_samples

NUM_CLIENTS = 200
NUM_PROMPTS = 25  # clients share prompts: the prefix cache serves the repeats
MAX_TOKENS = 16
STEMS = ["Return the number of", "This module provides", "If the file does not exist,", "Create a new",
         "The default value is"]
CONTEXT = ("the file object is a string, and the default value of the optional argument is None when it is "
           "not given; the function returns the number of bytes written to the file")


def scrape(live) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{live.url}/metrics", timeout=60) as response:
        return metric_samples(response.read().decode())


def finished_count(samples: dict, reason: str) -> float:
    return samples.get(("atom_core_requests_total", (("finish_reason", reason),)), 0.0)


def test_200_concurrent_streams_with_disconnects_are_correct_and_leak_nothing():
    engine = demo_engine()
    # Over two KV blocks each (16 tokens a block), so that the repeats can take full blocks from the cache.
    prompts = [f"{STEMS[i % len(STEMS)]} {i}: {CONTEXT}" for i in range(NUM_PROMPTS)]
    assert all(len(engine.tokenizer.encode(p)) > 32 for p in prompts)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = {p: out for p, out in zip(prompts, engine.generate(prompts, greedy, use_tqdm=False))}
    live = LiveServer(engine).start()
    try:
        async def one(client, k: int):
            prompt, hang_up = prompts[k % NUM_PROMPTS], k % 5 == 0
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, temperature=0, stream=True,
                max_tokens=200 if hang_up else MAX_TOKENS, extra_body={"ignore_eos": hang_up})
            text, finish, chunks = "", None, 0
            async for chunk in stream:
                chunks += 1
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason
                if hang_up and chunks == 2:
                    await stream.close()
                    return prompt, None, None
            return prompt, text, finish

        async def main():
            async with live.async_client(timeout=600) as client:
                return await asyncio.gather(*(one(client, k) for k in range(NUM_CLIENTS)))

        results = asyncio.run(main())
        completed = [(p, text, finish) for p, text, finish in results if text is not None]
        assert len(completed) == NUM_CLIENTS - NUM_CLIENTS // 5
        for prompt, text, finish in completed:
            assert (text, finish) == (want[prompt].text, want[prompt].finish_reason), prompt

        live.assert_no_block_leaked()
        samples = scrape(live)
        ended = {r: finished_count(samples, r) for r in ("stop", "length", "abort", "error")}
        assert sum(ended.values()) == NUM_CLIENTS and ended["error"] == 0, ended
        assert ended["abort"] <= NUM_CLIENTS // 5, ended  # only the clients that hung up
        assert samples[("atom_core_time_to_first_token_seconds_count", ())] == NUM_CLIENTS
        assert samples[("atom_core_num_requests_running", ())] == samples[("atom_core_num_requests_waiting", ())] == 0
        assert samples[("atom_core_prefix_cache_hits_total", ())] > 0  # the shared prompts
        with live.client() as client:
            assert client.completions.create(model=MODEL, prompt=prompts[0], temperature=0,
                                             max_tokens=MAX_TOKENS).choices[0].text == want[prompts[0]].text
        import urllib.request

        with urllib.request.urlopen(f"{live.url}/health", timeout=60) as response:
            assert response.status == 200
    finally:
        live.stop()


def test_a_client_hanging_up_mid_stream_aborts_its_request_and_frees_its_blocks(server):
    server.wait_idle()
    before = scrape(server)
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt=STEMS[0], temperature=0, stream=True, max_tokens=480,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # the request runs
    release = threading.Event()
    held = server.async_engine.submit(lambda e: release.wait())  # the engine stops stepping: it cannot finish
    try:
        assert server.async_engine.stats().num_running == 1
        stream.close()
        deadline_wait(lambda: server.async_engine.stats().num_running == 0)
    finally:
        release.set()
        held.result(60)
    server.assert_no_block_leaked()
    after = scrape(server)
    assert finished_count(after, "abort") == finished_count(before, "abort") + 1
    assert finished_count(after, "length") == finished_count(before, "length")


def deadline_wait(condition, seconds: float = 120) -> None:
    import time

    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)
