"""A model serves one engine at a time: each engine rebinds its own KV pool before its steps."""

import random

import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from atom_core.models import load_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _prompts(vocab, n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab - 1) for _ in range(rng.randint(2, 30))] for _ in range(n)]


@pytest.mark.parametrize("device", DEVICES)
def test_two_engines_on_one_model_interleaved_match_each_alone(tiny_qwen3, device):
    folder, hf_model = tiny_qwen3
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    backend = "torch" if device == "cpu" else None
    vocab = hf_model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts_a, prompts_b = _prompts(vocab, 5, seed=1), _prompts(vocab, 4, seed=2)
    with ops.use_backend(backend):
        model = load_model(folder, dtype=dtype, device=device)
        args = dict(device=device, block_size=4, num_kv_blocks=256, max_num_seqs=8)
        alone_a = [o.token_ids for o in Engine(model, **args).generate(prompts_a, params, use_tqdm=False)]
        alone_b = [o.token_ids for o in Engine(model, **args).generate(prompts_b, params, use_tqdm=False)]
        a, b = Engine(model, **args), Engine(model, **args)  # b bound its pool last
        ids_a = [a.add_request(p, params) for p in prompts_a]
        ids_b = [b.add_request(p, params) for p in prompts_b]
        done = {}
        while a.has_unfinished_requests() or b.has_unfinished_requests():
            for engine, tag in ((a, "a"), (b, "b")):  # every step of one engine follows one of the other
                if engine.has_unfinished_requests():
                    done.update({(tag, o.request_id): o.token_ids for o in engine.step() if o.finished})
    assert [done[("a", i)] for i in ids_a] == alone_a
    assert [done[("b", i)] for i in ids_b] == alone_b
