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
