"""Dropping an Engine frees its KV pool at once, without waiting for Python's cycle collector
(on a GPU a pool is most of the memory: a second engine built after the first would not fit)."""

import gc
import weakref

import pytest
import torch

from atom_core.engine import Engine, SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_dropping_the_engine_frees_the_pool_without_gc(tiny_qwen3, device):
    folder, _ = tiny_qwen3
    engine = Engine.from_pretrained(folder, device=device, dtype=torch.float32, num_kv_blocks=64, max_num_seqs=8)
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                    use_tqdm=False)
    if device == "cuda":
        assert engine.runner.graphs is not None, "the GPU case is meant to cover the CUDA graphs"
    # The model holds views of the pool (its bound caches), so both must go for the memory to go.
    pool, model = weakref.ref(engine.runner.kv_pool), weakref.ref(engine.model)
    gc.disable()
    try:
        del engine
        assert pool() is None, "something still refers to the KV pool: a reference cycle through the engine"
        assert model() is None, "something still refers to the model (and its views of the pool)"
    finally:
        gc.enable()
