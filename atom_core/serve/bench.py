"""``atom-core bench``: offline engine throughput, and online serving against any OpenAI-compatible URL.

The workload is nano-vllm's by default: 256 requests, prompt and output lengths uniform in
[100, 1024], random token ids below 10000, EOS ignored, seed 0. Lengths that do not fit the
model's context (``max_model_len``, read from the engine or from the server's ``/v1/models``) are
scaled down together, and the scaling is printed.

Online: requests arrive as a Poisson process at ``--rate`` requests/s (``inf``: all at once),
each a streamed ``/v1/completions`` request with a token-id prompt (``--endpoint chat`` sends a
text prompt of as many words to ``/v1/chat/completions`` instead, for servers that take no
token ids). ``--max-concurrency N`` caps the requests in flight at N, as ``vllm bench serve``'s
does: an arrived request waits for a free place before it is sent, and its clock starts when it
is sent. Per rate it reports throughput and, with ``vllm bench serve``'s definitions, the time to
first token (TTFT), time per output token after the first (TPOT: (e2e - TTFT) / (output tokens -
1), over the requests with more than one output token), inter-token latency (ITL: the gaps between
streamed chunks, all requests' gaps pooled) and end-to-end latency: mean, p50 (the median) and
p99. The HTTP client is a small asyncio one written here (HTTP/1.1, plain TCP), so this runs on
the base install.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

CHAT_TEMPLATE_ALLOWANCE = 32  # tokens a chat template may add around a message
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "on", "be", "by", "this", "are",
         "value", "file", "return", "object", "list", "string", "number", "function", "module", "default")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    note: str = ""


def parse_range(text: str) -> tuple[int, int]:
    """"MIN:MAX" (or one number) -> (min, max), 1 <= min <= max."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"expected MIN:MAX token counts, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def make_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int,
                  max_model_len: int | None) -> Workload:
    """nano-vllm's generator (``random.Random(seed)``: each prompt's length, its ids, then the output
    lengths), with both ranges scaled by one factor when the longest request would not fit."""
    note = ""
    if max_model_len is not None and input_len[1] + output_len[1] > max_model_len:
        f = max_model_len / (input_len[1] + output_len[1])
        scaled_in = (max(1, int(input_len[0] * f)), max(1, int(input_len[1] * f)))
        scaled_out = (max(1, int(output_len[0] * f)), max(1, int(output_len[1] * f)))
        note = (f"lengths scaled by {f:.3g} to fit max_model_len={max_model_len}: input {scaled_in[0]}:{scaled_in[1]},"
                f" output {scaled_out[0]}:{scaled_out[1]}")
        input_len, output_len = scaled_in, scaled_out
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]
    output_lens = [rng.randint(*output_len) for _ in range(num_prompts)]
    return Workload(prompts, output_lens, note)


# ---------------------------------------------------------------------------------------------- offline

def run_offline(engine, workload: Workload, temperature: float) -> dict:
    from atom_core.engine import SamplingParams

    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m, seed=i)
              for i, m in enumerate(workload.output_lens)]
    engine.generate(workload.prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # one-time set-up costs
    start = time.perf_counter()
    outputs = engine.generate(workload.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(o.token_ids) for o in outputs)
    input_tokens = sum(len(p) for p in workload.prompts)
    return {"requests": len(outputs), "input_tokens": input_tokens, "output_tokens": output_tokens,
            "seconds": seconds, "output_tokens_per_s": output_tokens / seconds,
            "total_tokens_per_s": (input_tokens + output_tokens) / seconds}


# ---------------------------------------------------------------------------------------------- HTTP

class HTTPError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class _Endpoint:
    def __init__(self, url: str, api_key: str | None):
        parts = urlsplit(url.rstrip("/"))
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--url must be http://HOST:PORT[/PATH] (plain HTTP), got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.base = parts.path if parts.path.endswith("/v1") else parts.path + "/v1"
        self.api_key = api_key

    async def request(self, method: str, path: str, body: dict | None = None):
        """Open a connection, send the request; returns (status, a reader of the body's bytes, writer)."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        data = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {self.base}{path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Connection: close",
                "Accept: application/json, text/event-stream", f"Content-Length: {len(data)}"]
        if body is not None:
            head.append("Content-Type: application/json")
        if self.api_key:
            head.append(f"Authorization: Bearer {self.api_key}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, _body_chunks(reader, headers), writer

    async def get_json(self, path: str) -> dict:
        status, chunks, writer = await self.request("GET", path)
        try:
            data = b"".join([c async for c in chunks])
        finally:
            writer.close()
        if status != 200:
            raise HTTPError(status, data.decode(errors="replace"))
        return json.loads(data)

    async def stream(self, path: str, body: dict):
        """POST and yield each server-sent event's data (str) until [DONE]."""
        status, chunks, writer = await self.request("POST", path, body)
        try:
            if status != 200:
                raise HTTPError(status, b"".join([c async for c in chunks]).decode(errors="replace"))
            buffer = b""
            async for chunk in chunks:
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            data = line[5:].strip().decode()
                            if data == "[DONE]":
                                return
                            yield data
        finally:
            writer.close()


async def _body_chunks(reader: asyncio.StreamReader, headers: dict):
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readline()  # the chunk's CRLF
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while chunk := await reader.read(65536):
            yield chunk


# ---------------------------------------------------------------------------------------------- online

@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0


async def _one_request(endpoint: _Endpoint, kind: str, model: str, prompt: list[int], max_tokens: int,
                       temperature: float, seed: int, ignore_eos: bool) -> RequestResult:
    result = RequestResult()
    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "seed": seed}
    if ignore_eos:  # (vLLM's extension: servers that refuse unknown fields run without it)
        body["ignore_eos"] = True
    if kind == "chat":
        # About one token a word; the chat template adds its own tokens: leave them room.
        words = random.Random(seed).choices(WORDS, k=max(1, len(prompt) - CHAT_TEMPLATE_ALLOWANCE))
        body["messages"] = [{"role": "user", "content": " ".join(words)}]
        path = "/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/completions"
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async for data in endpoint.stream(path, body):
            now = time.perf_counter()
            event = json.loads(data)
            if "error" in event:
                raise HTTPError(200, json.dumps(event["error"]))
            if event.get("usage"):
                result.output_tokens = event["usage"].get("completion_tokens", 0)
            choices = event.get("choices") or []
            if not choices:  # the usage chunk
                continue
            delta = choices[0].get("delta") or {}
            if kind == "chat" and (delta.get("role") is not None and not delta.get("content")):
                continue  # the opening role chunk carries no token
            chunks += 1
            if last is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "no tokens streamed"
    except (OSError, HTTPError, ValueError, asyncio.IncompleteReadError) as e:
        result.error = str(e)
    return result


async def run_online(url: str, workload: Workload, rate: float, *, model: str, kind: str = "completions",
                     api_key: str | None = None, temperature: float = 0.6, seed: int = 0,
                     ignore_eos: bool = True, max_concurrency: int | None = None) -> dict:
    """Send the workload at ``rate`` requests/s (Poisson; inf = at once), at most ``max_concurrency``
    in flight (None: no limit); returns the figures."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (or None), got {max_concurrency}")
    endpoint = _Endpoint(url, api_key)
    rng = random.Random(seed)
    # vLLM's semantics: arrivals keep the --rate schedule; an arrived request then waits here for a
    # place, and _one_request's clock starts only once it has one (the wait is in no latency).
    places = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None

    async def limited(*request_args) -> RequestResult:
        if places is None:
            return await _one_request(*request_args)
        async with places:
            return await _one_request(*request_args)

    tasks = []
    start = time.perf_counter()
    next_time = 0.0
    for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.output_lens)):
        if math.isfinite(rate):
            next_time += rng.expovariate(rate)
            delay = start + next_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(limited(endpoint, kind, model, prompt, max_tokens, temperature, seed + i,
                                                   ignore_eos)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return summarize(results, duration, rate, max_concurrency)


def summarize(results: list[RequestResult], duration: float, rate: float,
              max_concurrency: int | None = None) -> dict:
    """One result row. Latencies over the successful requests, in ms, as ``vllm bench serve`` defines
    them: TTFT per request; TPOT per request with more than one output token, (e2e - ttft) /
    (output_tokens - 1) (a one-token request has no time per output token after the first); ITL, every
    gap between streamed chunks of every request pooled; e2e per request. Each as mean, p50 (= the
    median) and p99 (numpy's linear-interpolated percentiles); NaN where there is no value."""
    ok = [r for r in results if r.ok]
    ms = lambda values, q: float(np.percentile(values, q) * 1000) if len(values) else float("nan")  # noqa: E731
    mean_ms = lambda values: float(np.mean(values) * 1000) if len(values) else float("nan")  # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [gap for r in ok for gap in r.itl]
    e2e = [r.e2e for r in ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {"rate": rate, "max_concurrency": max_concurrency, "requests": len(results),
            "failed": len(results) - len(ok), "seconds": duration, "requests_per_s": len(ok) / duration,
            "output_tokens_per_s": output_tokens / duration,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "itl_p50_ms": ms(itl, 50),
            "itl_p99_ms": ms(itl, 99), "e2e_p50_ms": ms(e2e, 50), "e2e_p99_ms": ms(e2e, 99),
            "tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
            "ttft_mean_ms": mean_ms(ttft), "tpot_mean_ms": mean_ms(tpot), "itl_mean_ms": mean_ms(itl),
            "e2e_mean_ms": mean_ms(e2e),
            "first_error": next((r.error for r in results if not r.ok), "")}


async def server_info(url: str, api_key: str | None) -> tuple[str | None, int | None, int | None]:
    """(the first model's id, its max_model_len and vocab_size where the server says: atom-core's does);
    (None, None, None) when it lists no model (``transformers serve`` lists its cache's, loads on demand)."""
    models = await _Endpoint(url, api_key).get_json("/models")
    if not models["data"]:
        return None, None, None
    first = models["data"][0]
    return first["id"], first.get("max_model_len"), first.get("vocab_size")


def print_table(rows: list[dict], columns: list[str]) -> None:
    def cell(value):
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(cell(row.get(c, "")).rjust(w) for c, w in zip(columns, widths)))


# The table: p50 and p99 of each latency. The means are in the rows (and the --json file) only: with
# them the table would be 19 columns, wider than a terminal.
ONLINE_COLUMNS = ["rate", "max_concurrency", "requests", "failed", "seconds", "requests_per_s", "output_tokens_per_s",
                  "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms",
                  "e2e_p50_ms", "e2e_p99_ms"]
OFFLINE_COLUMNS = ["requests", "input_tokens", "output_tokens", "seconds", "output_tokens_per_s", "total_tokens_per_s"]


def run_info() -> dict:
    """What a result file says about its run: this machine's GPU (or "cpu"), versions, the commit
    (``ATOM_CORE_COMMIT`` where set, else ``git rev-parse HEAD`` beside the package, else None) and whether
    tracked files differed from it (``dirty``; None without git), the host, when, how. (The server's Triton
    cache is the server's to report: a client does not see it.)"""
    import importlib.metadata
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path

    import torch

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit, dirty = os.environ.get("ATOM_CORE_COMMIT"), None
    if not commit:
        commit = git("rev-parse", "HEAD")
        status = None if commit is None else git("status", "--porcelain", "--untracked-files=no")
        dirty = None if status is None else bool(status)
    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "torch": torch.__version__, "triton": version("triton"), "transformers": version("transformers"),
            "python": platform.python_version(), "atom_core": version("atom_core"), "commit": commit,
            "dirty": dirty, "hostname": platform.node(),
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv)}


def as_json(rows: list[dict]) -> str:
    """``{"meta": run_info(), "rows": rows}`` as JSON (non-finite floats, e.g. rate inf, as null)."""
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    return json.dumps({"meta": run_info(), "rows": clean}, indent=2)
