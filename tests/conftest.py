import gc
import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The variable must be set before
# any kernel module is imported (triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every test runs the ops' argument checks (off by default: they cost microseconds a call). Set
# before atom_core is imported, which reads the variable once; tests of the switch flip it themselves.
os.environ["ATOM_CORE_DEBUG"] = "1"


@pytest.fixture(autouse=True, scope="session")
def _one_cpu_thread():
    """Tests use tiny tensors: one intra-op thread is many times faster than several here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _empty_selftest_record(tmp_path_factory):
    """The suite runs without a selftest record (a user's ~/.cache record must not change auto's choices, in
    the engine and model tests as in the op tests); tests that need one point ATOM_CORE_SELFTEST_PATH
    elsewhere with tests/ops' ``selftest_record``."""
    from atom_core.ops import verified

    saved = os.environ.get(verified.PATH_ENV_VAR)
    os.environ[verified.PATH_ENV_VAR] = str(tmp_path_factory.mktemp("selftest") / "none.json")
    verified.reload()
    yield
    if saved is None:
        os.environ.pop(verified.PATH_ENV_VAR)
    else:
        os.environ[verified.PATH_ENV_VAR] = saved
    verified.reload()


@pytest.fixture
def cuda_caching_dropped_tensors(monkeypatch):
    """``cache(cached, total=80 GiB)`` makes torch.cuda a GPU of ``total`` bytes whose allocator caches ``cached``
    bytes of dropped tensors: the driver's free memory counts them as used until ``empty_cache`` gives them back.
    No GPU is needed (only ``mem_get_info`` and ``empty_cache`` are replaced)."""
    def cache(cached: int, total: int = 80 << 30) -> None:
        state = {"cached": cached}
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: state.update(cached=0))
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - state["cached"], total))

    return cache


@pytest.fixture(autouse=True)
def _give_back_cached_cuda_memory():
    """On a GPU, after each test: the blocks of the engines and models it dropped go back to the driver, so
    that an engine a later test starts in another process (sized from the GPU's free memory) finds them free."""
    yield
    if torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
