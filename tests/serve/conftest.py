"""A live server for the tests: the demo model on the CPU behind uvicorn, in a background thread of
the test process, listening on 127.0.0.1 and a port the OS picked; stopped after its tests."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from atom_core.engine import Engine

API_KEY = "test-key"
MODEL = "demo"
DEADLINE_S = 120  # a wait that long means something hung (each waits for a fraction of a second)


def demo_engine(**kwargs) -> Engine:
    return Engine.from_pretrained(device="cpu", **kwargs)


class LiveServer:
    """uvicorn serving ``create_app`` in a thread; ``submit`` runs a function on the engine's step thread."""

    def __init__(self, engine: Engine, *, max_waiting_requests: int = 1024, **config):
        import uvicorn

        from atom_core.engine.async_engine import AsyncEngine
        from atom_core.serve.app import create_app
        from atom_core.serve.common import ServerConfig
        from atom_core.serve.engine_options import FALLBACK_CHAT_TEMPLATE

        self.engine = engine
        self.async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests)
        config = {"model_name": MODEL, "api_key": API_KEY, "chat_template": FALLBACK_CHAT_TEMPLATE, **config}
        self.app = create_app(self.async_engine, ServerConfig(**config))
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(512)
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + DEADLINE_S
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(DEADLINE_S)
        self.socket.close()

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def submit(self, fn):
        """``fn(engine)`` on the step thread; its result."""
        return self.async_engine.submit(fn).result(DEADLINE_S)

    def wait_idle(self) -> None:
        """Until the server holds no request (aborts of disconnected clients applied included)."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            stats = self.async_engine.stats()
            if stats.num_running == 0 and stats.num_waiting == 0 and not self.submit(
                    lambda e: e.has_unfinished_requests()):
                return
            assert time.monotonic() < deadline, f"the server did not become idle: {stats}"
            time.sleep(0.02)

    def assert_no_block_leaked(self) -> None:
        self.wait_idle()

        def check(engine):
            engine.block_manager.check_integrity()
            return engine.block_manager.num_free_blocks, engine.block_manager.num_blocks

        free, total = self.submit(check)
        assert free == total


@pytest.fixture(scope="module")
def server():
    live = LiveServer(demo_engine()).start()
    yield live
    live.stop()


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value}, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="package", autouse=True)
def _torch_backend():
    """The reference ops: the suite sets TRITON_INTERPRET=1, under which auto picks Triton's CPU
    interpreter for some ops (seconds per step). The step threads copy this context (AsyncEngine
    is built in it)."""
    from atom_core import ops

    with ops.use_backend("torch"):
        yield
