"""``Engine.load_weights`` over two tensor-parallel ranks (CPU, gloo; a real worker process each engine):
an engine loaded from checkpoint A and updated with B's ``state_dict`` generates B's greedy tokens, and a
refused tensor or a failing iterable raises on rank 0 while the ranks stay in step (the engine serves on).
"""

from __future__ import annotations

import pickle

import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams, weight_sync
from tests.engine.test_engine_parity import prompts_for

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ARGS = dict(device="cpu", dtype=torch.float32, block_size=4, max_model_len=64)
LENGTHS = (7, 1, 13, 20)
STEP_TIMEOUT = 60.0  # a broken build fails instead of hanging; no claim about speed


@pytest.fixture(autouse=True)
def _torch_ops(monkeypatch):
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")  # (the worker reads it at import)
    with ops.use_backend("torch"):
        yield


def _greedy(engine, prompts):
    return [out.token_ids for out in engine.generate(prompts, GREEDY, use_tqdm=False)]


def _two_ranks(folder):
    return Engine.from_pretrained(folder, tensor_parallel_size=2, step_timeout=STEP_TIMEOUT, **ARGS)


@pytest.fixture
def tokens(pair):
    """(prompts, A's greedy tokens, B's greedy tokens) of one-rank engines."""
    folder_a, folder_b, hf_b = pair
    prompts = prompts_for(hf_b.config.vocab_size, LENGTHS)
    want_a = _greedy(Engine.from_pretrained(folder_a, **ARGS), prompts)
    want_b = _greedy(Engine.from_pretrained(folder_b, **ARGS), prompts)
    assert want_a != want_b
    return prompts, want_a, want_b


# 1: a batch per round holds one tensor (many rounds); the default: the whole tiny model in one round.
@pytest.mark.parametrize("batch_bytes", [1, weight_sync.BATCH_BYTES])
def test_two_rank_engine_updated_with_b_generates_as_one_rank_engine_loaded_from_b(pair, tokens, batch_bytes,
                                                                                   monkeypatch):
    folder_a, _, hf_b = pair
    prompts, want_a, want_b = tokens
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", batch_bytes)  # (read by rank 0 alone)
    state = hf_b.state_dict()
    taken = []

    def pairs():  # a generator: read once, one pair at a time
        for name, tensor in state.items():
            taken.append(name)
            yield name, tensor

    with _two_ranks(folder_a) as engine:
        assert _greedy(engine, prompts) == want_a
        report = engine.load_weights(pairs(), strict=True)
        assert taken == list(state) and report.missing == []
        assert _greedy(engine, prompts) == want_b
        engine.check_health()


def test_a_tensor_of_the_wrong_shape_raises_on_rank_0_naming_it_and_the_engine_serves_on(pair, tokens):
    folder_a, _, hf_b = pair
    prompts, _, want_b = tokens
    state = hf_b.state_dict()
    with _two_ranks(folder_a) as engine:
        bad = [("model.layers.0.self_attn.q_proj.weight", state["model.layers.0.self_attn.q_proj.weight"]),
               ("model.layers.1.self_attn.q_proj.weight", torch.zeros(3, 5)),
               ("model.layers.1.mlp.down_proj.weight", state["model.layers.1.mlp.down_proj.weight"])]
        with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.q_proj\.weight'.*shape \(3, 5\)"):
            engine.load_weights(bad)
        engine.check_health()  # the ranks are in step: no worker failed, the engine is usable
        assert len(_greedy(engine, prompts)) == len(prompts)  # (A's weights but layer 0's q from B: it runs)
        engine.load_weights(state.items())
        assert _greedy(engine, prompts) == want_b


def test_an_iterable_that_raises_midway_raises_on_rank_0_and_the_engine_serves_on(pair, tokens, monkeypatch):
    folder_a, _, hf_b = pair
    prompts, _, want_b = tokens
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", 1)  # the failure comes after rounds already loaded
    state = hf_b.state_dict()

    def broken():
        for i, item in enumerate(state.items()):
            if i == 3:
                raise OSError("the trainer's gather failed")
            yield item

    with _two_ranks(folder_a) as engine:
        with pytest.raises(OSError, match="the trainer's gather failed"):
            engine.load_weights(broken())
        with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
            engine.load_weights([("model.norm.weight", [1.0, 2.0])])
        engine.check_health()
        engine.load_weights(state.items())
        assert _greedy(engine, prompts) == want_b




class _ScriptedChannel:
    """Rank 0's side of a channel whose worker (rank 1) fails at the round ``fail_at`` (a worker-only failure
    cannot be provoked with real tensors: every rank checks the full shape before it cuts its shard)."""

    device = torch.device("cpu")
    failure = None

    def __init__(self, fail_at: int):
        self.fail_at, self.rounds, self.sent = fail_at, 0, []

    def send(self, kind, inputs=None, payload=b""):
        self.sent.append(pickle.loads(payload))

    def broadcast_tensor(self, tensor):
        pass

    def exchange_status(self, status):
        self.rounds += 1
        return [status, "MemoryError: rank 1 ran out" if self.rounds == self.fail_at else ""]

    def fail(self, error):
        raise AssertionError(f"the ranks stay in step, got {error!r}")


def test_a_worker_that_fails_a_round_stops_the_load_there_and_rank_0_raises_naming_it(pair, monkeypatch):
    folder_a, _, hf_b = pair
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", 1)  # one tensor a round
    model = Engine.from_pretrained(folder_a, **ARGS).model
    taken = []

    def pairs():
        for item in hf_b.state_dict().items():
            taken.append(item[0])
            yield item

    channel = _ScriptedChannel(fail_at=2)
    with pytest.raises(weight_sync.WeightLoadError, match=r"rank 1 .*MemoryError: rank 1 ran out"):
        weight_sync.load_weights_driver(model, channel, pairs(), strict=False, check_finite=True)
    assert len(taken) == 2 and channel.rounds == 2  # nothing read or sent after the failed round
    assert [list(m) for m in channel.sent] == [["start"], ["batch"], ["batch"]]
