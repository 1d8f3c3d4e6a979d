"""Shared fixtures for op tests: the device, size grids, and which backends can be tested here."""

import os

import pytest
import torch

from atom_core.ops.dispatch import backend_available

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Deliberately odd sizes; the interpreter is slow, so the CPU grid stays small.
ROWS = [1, 19, 99, 989, 4096] if ON_GPU else [1, 19, 99]
HIDDEN = [111, 128, 4096] if ON_GPU else [111, 128]

needs_triton = pytest.mark.skipif(not backend_available("triton"), reason="triton not installed / no GPU or interpreter")
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def rand(*shape, dtype=torch.float32, device=DEVICE, generator=None):
    return torch.randn(*shape, dtype=torch.float32, device="cpu", generator=generator).to(device=device, dtype=dtype)


def non_contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    """The same values as x, rows strided: a view into a wider buffer (last dim still contiguous)."""
    wide = torch.zeros(x.shape[0], x.shape[1] + 13, dtype=x.dtype, device=x.device)
    wide[:, : x.shape[1]] = x
    return wide[:, : x.shape[1]]


@pytest.fixture
def selftest_record(tmp_path):
    """``write(results, device="cpu")`` merges ``{op: {backend: result}}`` into a fresh record of this
    test (keyed by the device and this machine's versions) and reloads it; returns the record's path."""
    from atom_core.ops import verified

    saved = os.environ[verified.PATH_ENV_VAR]
    os.environ[verified.PATH_ENV_VAR] = str(tmp_path / "selftest.json")
    verified.reload()

    def write(results: dict, device: str = "cpu"):
        return verified.write_results(torch.device(device), results)

    yield write
    os.environ[verified.PATH_ENV_VAR] = saved
    verified.reload()
