"""The server's cost per streamed token, and its throughput at saturation against the offline engine's.

The server's event loop shares the process (and the GIL) with the step thread: every microsecond
the loop spends on a streamed token is taken from the engine's steps. Two measures:

    python -m benchmarks.serve_overhead loop [--streams 128 --steps 200 --endpoint completions --http h11]
    python -m benchmarks.serve_overhead e2e PATH [--num-prompts 128 --input-len 16:64 --output-len 64:256]
    python -m benchmarks.serve_overhead tiny FOLDER      # a tiny random Qwen3 (1 layer, hidden 64) to run e2e on

``loop``: CPU microseconds of the event loop per streamed token, with no engine running. The app
(``create_app``, the demo model's tokenizer and limits) sits behind uvicorn's HTTP protocol (``--http
h11`` or ``httptools``, whichever uvicorn would pick) on in-memory transports; ``--streams`` streamed
requests are opened, then for each of ``--steps`` steps the harness posts one output per stream the
way the step thread does (one ``AsyncEngine._deliver`` per step) and runs the loop until every
response has written its chunk. Counted: the delivery, the handlers, the metrics, JSON, Starlette and
uvicorn down to ``transport.write`` (not the socket's syscall, not the step thread's reading of the
outputs).

``e2e``: the offline engine (``bench.run_offline``) and the served one (``atom-core serve`` in a
subprocess, ``bench.run_online`` at rate inf on the same requests) on the same folder; prints both
throughputs and their ratio (the issue's target: >= 0.9). On a machine with few cores the client's
own work competes with the server for them. The server runs with ``--no-engine-process`` (the engine in
its process); ``--engine-process`` also serves with ``atom-core serve --engine-process`` (the engine in a
process of its own, a one-replica ``DataParallelEngine``: the server's step thread then only reads the
replica's outputs and detokenizes), the layout vLLM V1 uses and serve's default on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.common import print_table


# ---------------------------------------------------------------------------------------------- loop

class _Transport(asyncio.Transport):
    """An in-memory socket: counts what uvicorn writes (``totals``: [writes, bytes] of all transports)."""

    def __init__(self, totals: list[int]):
        super().__init__()
        self.totals = totals
        self.closing = False

    def write(self, data) -> None:
        self.totals[0] += 1
        self.totals[1] += len(data)

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _replay_engine_class():
    from atom_core.engine.async_engine import AsyncEngine

    class ReplayEngine(AsyncEngine):
        """An ``AsyncEngine`` whose step thread never runs: adds are accepted at once; the harness posts outputs."""

        def start(self) -> None:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()

        def _send(self, command: tuple) -> None:
            if command[0] == "add":
                stream = command[1]
                self.added.append((stream, command[2]))
                stream._accepted.set_result(None)

    return ReplayEngine


def _request(i: int, endpoint: str, max_tokens: int) -> bytes:
    body = {"model": "demo", "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "seed": i}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "the value of the list " * 8}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = [(7 * i + k) % 2000 + 1 for k in range(48)]
        path = "/v1/completions"
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


async def _run_loop(streams: int, steps: int, endpoint: str, http: str) -> dict:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from atom_core.engine import Engine
    from atom_core.engine.async_engine import _Delta
    from atom_core.serve.app import create_app
    from atom_core.serve.common import ServerConfig
    from atom_core.serve.engine_options import FALLBACK_CHAT_TEMPLATE

    engine = Engine.from_pretrained(device="cpu")
    replay = _replay_engine_class()(engine, max_waiting_requests=streams)
    replay.added = []
    app = create_app(replay, ServerConfig(model_name="demo", chat_template=FALLBACK_CHAT_TEMPLATE))
    config = Config(app, http=http, lifespan="off", log_level="warning")
    config.load()
    state = ServerState()
    totals = [0, 0]
    for i in range(streams):
        protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
        protocol.connection_made(_Transport(totals))
        protocol.data_received(_request(i, endpoint, steps))
    while len(replay.added) < streams:
        await asyncio.sleep(0)
    for _ in range(10):  # the handlers reach their first wait for an output
        await asyncio.sleep(0)
    # What the step thread would hand over: one delta per stream per step (the last finishes it).
    tok = engine.tokenizer
    texts = [tok.decode([t]) for t in range(100, 100 + 64)]
    rounds = []
    for step in range(steps):
        now = time.monotonic()
        last = step == steps - 1
        items = []
        for i, (stream, prompt) in enumerate(replay.added):
            delta = _Delta(index=0, new_token_ids=[100 + (i + step) % 64], new_text=texts[(i + step) % 64],
                           new_logprobs=None, new_top_logprobs=None, num_output_tokens=step + 1,
                           finish_reason="length" if last else None, stop_reason=None, time=now,
                           prompt_token_ids=list(prompt) if step == 0 else None, num_cached_tokens=0,
                           prompt_logprobs=None, prompt_top_logprobs=None)
            items.append((stream, "delta", delta))
        rounds.append(items)
    loop = asyncio.get_running_loop()
    start_writes, start_bytes = totals
    cpu, wall = time.thread_time(), time.perf_counter()
    for items in rounds:
        target = totals[0] + streams  # every response writes this step's chunk
        loop.call_soon(replay._deliver, items)  # what the step thread's call_soon_threadsafe schedules
        while totals[0] < target:
            await asyncio.sleep(0)
    while state.tasks:  # the usage chunk, [DONE], the end of each response
        await asyncio.sleep(0)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    tokens = streams * steps
    return {"endpoint": endpoint, "http": http, "streams": streams, "steps": steps,
            "us_per_token_cpu": cpu / tokens * 1e6, "us_per_token_wall": wall / tokens * 1e6,
            "writes_per_token": (totals[0] - start_writes) / tokens, "bytes_per_token": (totals[1] - start_bytes) / tokens}


def run_loop(args) -> None:
    http = args.http
    if http == "auto":
        try:
            import httptools  # noqa: F401
            http = "httptools"
        except ImportError:
            http = "h11"
    rows = [asyncio.run(_run_loop(args.streams, args.steps, args.endpoint, http)) for _ in range(args.repeats)]
    print_table(rows)


# ---------------------------------------------------------------------------------------------- e2e

def _engine_flags(args) -> list[str]:
    flags = ["--device", args.device] if args.device else []
    return flags + ["--threads", str(args.threads)] if args.threads else flags


def _bench(args, mode: list[str], endpoint: str = "completions") -> dict:
    """One ``atom-core bench`` run (its own process) on the e2e workload: its JSON row."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "row.json")
        subprocess.run([sys.executable, "-m", "atom_core.serve.cli", "bench", *mode, "--num-prompts",
                        str(args.num_prompts), "--input-len", args.input_len, "--output-len", args.output_len,
                        "--vocab", str(args.vocab), "--endpoint", endpoint, "--json", out], check=True,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["rows"][0]


# atom-core serve with the engine in the server's process, or in its own (a one-replica DataParallelEngine)
def _served(args, engine_process: bool) -> list[dict]:
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "atom_core.serve.cli", "serve", args.path, "--port",
                               str(args.port), "--log-level", "warning", *_engine_flags(args)]
                              + (["--engine-process"] if engine_process else ["--no-engine-process"]))
    rows = []
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.2)
        for endpoint in args.endpoint:
            for _ in range(args.repeats):
                row = _bench(args, ["--url", url, "--rate", "inf"], endpoint)
                rows.append({"mode": f"served ({endpoint}{', engine process' if engine_process else ''})",
                             "output_tokens_per_s": row["output_tokens_per_s"], "seconds": row["seconds"],
                             "itl_p50_ms": row["itl_p50_ms"], "failed": row["failed"]})
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    return rows


def run_e2e(args) -> None:
    rows = []

    def record(new_rows: list[dict]) -> None:  # after each mode: a run stopped later keeps what it measured
        rows.extend(new_rows)
        offline = statistics.median(r["output_tokens_per_s"] for r in rows if r["mode"] == "offline")
        for row in rows:
            row["x_offline"] = row["output_tokens_per_s"] / offline
        for row in new_rows:
            print(row, flush=True)
        if args.json:
            from atom_core.serve.bench import as_json

            Path(args.json).write_text(as_json(rows))

    record([{"mode": "offline", **{k: row[k] for k in ("output_tokens_per_s", "seconds")}}
            for row in (_bench(args, ["--offline", args.path, *_engine_flags(args)]) for _ in range(args.repeats))])
    record(_served(args, engine_process=False))
    if args.engine_process:
        record(_served(args, engine_process=True))
    print_table(rows, ["mode", "output_tokens_per_s", "seconds", "itl_p50_ms", "failed", "x_offline"])


def make_tiny(folder: str) -> None:
    """A tiny random Qwen3 (1 layer, hidden 64, the demo model's tokenizer) saved to ``folder``: its steps
    are cheap, so a CPU run of ``e2e`` shows the server's own cost."""
    import shutil
    from pathlib import Path

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import atom_core

    config = Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(atom_core.__file__).parent / "demo_model" / name, Path(folder) / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    loop = commands.add_parser("loop", help="event-loop CPU per streamed token, no engine running")
    loop.add_argument("--streams", type=int, default=128)
    loop.add_argument("--steps", type=int, default=200)
    loop.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    loop.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto")
    loop.add_argument("--repeats", type=int, default=3)
    e2e = commands.add_parser("e2e", help="offline vs served throughput on the same requests")
    e2e.add_argument("path")
    e2e.add_argument("--num-prompts", type=int, default=128)
    e2e.add_argument("--input-len", default="16:64")
    e2e.add_argument("--output-len", default="64:256")
    e2e.add_argument("--vocab", type=int, default=10000)
    e2e.add_argument("--endpoint", nargs="+", choices=["completions", "chat"], default=["completions"])
    e2e.add_argument("--device", default=None)
    e2e.add_argument("--threads", type=int, default=None)
    e2e.add_argument("--port", type=int, default=8123)
    e2e.add_argument("--repeats", type=int, default=1)
    e2e.add_argument("--json", default=None, help="also write the rows (and the run) to this file")
    e2e.add_argument("--engine-process", action="store_true",
                     help="also serve with the engine in its own process (a one-replica DataParallelEngine)")
    tiny = commands.add_parser("tiny", help="save a tiny random Qwen3 to run e2e on a CPU")
    tiny.add_argument("folder", nargs="?", default=os.path.join(tempfile.gettempdir(), "atom_core_tiny_qwen3"))
    args = parser.parse_args()
    if args.command == "loop":
        run_loop(args)
    elif args.command == "e2e":
        run_e2e(args)
    else:
        make_tiny(args.folder)
        print(args.folder)


if __name__ == "__main__":
    main()
