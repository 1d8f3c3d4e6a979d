"""``atom-core bench --url``'s vLLM-shaped figures: ``--max-concurrency`` (requests in flight never above
it, arrivals still on the ``--rate`` schedule, latencies counted from when a request is sent) against a
fake endpoint that counts its streams in flight, and ``summarize``'s TPOT / means on hand-built results
(``vllm bench serve``'s definitions)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from atom_core.serve import bench, cli

FIRST_CHUNK_S = 0.02  # the fake server's time to the first chunk
GAP_S = 0.005  # ... and between chunks


class InFlight:
    """A fake ``_Endpoint.stream``: each request streams three one-token chunks after a short wait,
    and the most streams open at once is recorded."""

    def __init__(self):
        self.now = 0
        self.peak = 0
        self.streams = 0

    def install(self, monkeypatch):
        counter = self

        async def stream(self, path, body):
            counter.now += 1
            counter.streams += 1
            counter.peak = max(counter.peak, counter.now)
            try:
                await asyncio.sleep(FIRST_CHUNK_S)
                for _ in range(3):
                    yield json.dumps({"choices": [{"text": "x"}]})
                    await asyncio.sleep(GAP_S)
            finally:
                counter.now -= 1

        monkeypatch.setattr(bench._Endpoint, "stream", stream)
        return self


def run(workload, rate, **kwargs) -> dict:
    return asyncio.run(bench.run_online("http://127.0.0.1:9", workload, rate, model="m", **kwargs))


@pytest.mark.parametrize("rate, cap", [(math.inf, 1), (math.inf, 3), (2000.0, 2)])
def test_max_concurrency_is_never_exceeded_and_is_reached(monkeypatch, rate, cap):
    fake = InFlight().install(monkeypatch)
    workload = bench.make_workload(12, (4, 8), (3, 3), 50, 0, None)
    row = run(workload, rate, max_concurrency=cap)
    assert fake.streams == 12 and row["failed"] == 0
    assert fake.peak == cap  # never above; and reached, so the cap is not a serialization
    assert row["max_concurrency"] == cap


def test_without_max_concurrency_every_request_is_in_flight_at_once(monkeypatch):
    fake = InFlight().install(monkeypatch)
    row = run(bench.make_workload(12, (4, 8), (3, 3), 50, 0, None), math.inf)
    assert fake.peak == 12  # (so the fake sees concurrency: the capped test above can fail)
    assert row["max_concurrency"] is None


def test_waiting_for_a_place_is_not_counted_in_ttft(monkeypatch):
    """One place, ten requests at once, on a virtual clock the fake server advances: 20 ms to the first chunk,
    then three 5 ms gaps. vLLM starts a request's clock once it holds its place, so every TTFT is exactly 20 ms
    (counted from arrival, the last one's would be 9 x 35 + 20 ms)."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    async def stream(self, path, body):
        await asyncio.sleep(0)  # let the other requests queue for the place
        clock[0] += 0.020
        for _ in range(3):
            yield json.dumps({"choices": [{"text": "x"}]})
            clock[0] += 0.005

    monkeypatch.setattr(bench._Endpoint, "stream", stream)
    row = run(bench.make_workload(10, (4, 8), (3, 3), 50, 0, None), math.inf, max_concurrency=1)
    assert row["seconds"] == pytest.approx(10 * 0.035)
    assert row["ttft_p50_ms"] == pytest.approx(20) and row["ttft_p99_ms"] == pytest.approx(20)


def test_run_online_refuses_max_concurrency_0():
    with pytest.raises(ValueError, match="max_concurrency"):
        run(bench.make_workload(1, (4, 8), (3, 3), 50, 0, None), math.inf, max_concurrency=0)


def request(ttft, e2e, output_tokens, itl=(), ok=True) -> bench.RequestResult:
    return bench.RequestResult(ok=ok, error="" if ok else "boom", ttft=ttft, e2e=e2e, itl=list(itl),
                               output_tokens=output_tokens)


def test_tpot_is_e2e_minus_ttft_over_output_tokens_minus_1_with_mean_p50_p99():
    results = [request(0.1, 0.5, 5, [0.1] * 4),  # TPOT (0.5 - 0.1) / 4 = 100 ms
               request(0.2, 0.8, 4, [0.2] * 3),  # TPOT (0.8 - 0.2) / 3 = 200 ms
               request(9.0, 99.0, 50, ok=False)]  # a failed request: in no latency
    row = bench.summarize(results, 2.0, math.inf)
    assert row["tpot_mean_ms"] == pytest.approx(150)
    assert row["tpot_p50_ms"] == pytest.approx(150)
    assert row["tpot_p99_ms"] == pytest.approx(100 + 0.99 * 100)  # numpy's linear interpolation
    assert row["ttft_mean_ms"] == pytest.approx(150)
    assert row["e2e_mean_ms"] == pytest.approx(650)
    assert row["failed"] == 1 and row["max_concurrency"] is None


def test_itl_mean_pools_every_gap_of_every_request():
    # vLLM's ITL is over all gaps together: (4 * 100 + 3 * 200) / 7 ms, not the mean of the two requests' means
    row = bench.summarize([request(0.1, 0.5, 5, [0.1] * 4), request(0.2, 0.8, 4, [0.2] * 3)], 2.0, math.inf)
    assert row["itl_mean_ms"] == pytest.approx(1000 / 7)
    assert row["itl_p50_ms"] == pytest.approx(100)


def test_a_request_with_one_output_token_is_left_out_of_tpot_but_not_ttft():
    one_token = request(0.1, 0.3, 1)  # (0.3 - 0.1) / 0 if it were counted
    row = bench.summarize([one_token, request(0.1, 0.5, 5, [0.1] * 4)], 1.0, math.inf)
    assert row["tpot_mean_ms"] == pytest.approx(100) and row["tpot_p99_ms"] == pytest.approx(100)
    assert row["ttft_mean_ms"] == pytest.approx(100) and row["requests_per_s"] == 2
    only = bench.summarize([one_token], 1.0, math.inf)
    assert all(math.isnan(only[k]) for k in ("tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms"))
    assert only["ttft_p50_ms"] == pytest.approx(100)


def test_the_max_concurrency_flag_parses_and_defaults_to_no_limit():
    parse = cli.build_parser().parse_args
    assert parse(["bench", "--url", "http://127.0.0.1:9", "--max-concurrency", "4"]).max_concurrency == 4
    assert parse(["bench", "--url", "http://127.0.0.1:9"]).max_concurrency is None


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_the_max_concurrency_flag_refuses_values_below_1(value, capsys):
    assert cli.main(["bench", "--url", "http://127.0.0.1:9", "--max-concurrency", value]) == 2
    assert "--max-concurrency" in capsys.readouterr().err


def test_bench_url_caps_concurrency_and_writes_the_new_columns(monkeypatch, tmp_path, capsys):
    fake = InFlight().install(monkeypatch)

    async def info(url, api_key):
        return "m", 64, 50

    monkeypatch.setattr(bench, "server_info", info)
    path = tmp_path / "online.json"
    assert cli.main(["bench", "--url", "http://127.0.0.1:9", "--max-concurrency", "2", "--rate", "inf", "500",
                     "--num-prompts", "6", "--input-len", "4:8", "--output-len", "3:3", "--json", str(path)]) == 0
    assert fake.peak == 2 and fake.streams == 12
    rows = json.loads(path.read_text())["rows"]
    assert [(r["rate"], r["max_concurrency"]) for r in rows] == [(None, 2), (500, 2)]
    for row in rows:
        assert row["failed"] == 0
        # three one-token chunks: TPOT = (e2e - ttft) / 2, about the fake's gap (the last sleep is in e2e)
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in
                   ("tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "ttft_mean_ms", "itl_mean_ms", "e2e_mean_ms"))
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header == bench.ONLINE_COLUMNS and {"max_concurrency", "tpot_p50_ms", "tpot_p99_ms"} <= set(header)
