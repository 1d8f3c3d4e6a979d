import pytest
import torch


@pytest.fixture(scope="module")
def model(pair):
    """The atom_core model (fp32, CPU) loaded from the module's ``pair`` checkpoint."""
    return pair.load_atom(dtype=torch.float32, device="cpu")
