"""``Engine.update_weights_from_distributed``: a trainer (group rank 0, a thread of this process with its own
``WeightUpdateGroup``) broadcasts checkpoint B's tensors over a gloo weight-update group to an engine built from
A, one-rank and over two tensor-parallel ranks (a real worker process); the engine then holds B's weights and
generates as an engine built from B. Refusals come before any collective, and a refused tensor leaves the group
and the engine usable.
"""

from __future__ import annotations

import queue
import socket
import threading
from types import SimpleNamespace

import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from atom_core.engine.weight_group import WeightUpdateGroup
from tests.engine.test_engine_parity import prompts_for
from tests.engine.test_weight_update_tp import tokens  # noqa: F401 - (prompts, A's and B's greedy tokens, one rank)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ARGS = dict(device="cpu", dtype=torch.float32, block_size=4, max_model_len=64)
TIMEOUT = 60.0  # seconds a member waits: a broken build fails instead of hanging; no claim about speed
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(autouse=True)
def _torch_ops(monkeypatch):
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")  # (a worker reads it at import)
    with ops.use_backend("torch"):
        yield
    assert not [t for t in threading.enumerate() if t.name == "test-trainer"], "a trainer thread was left running"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _greedy(engine, prompts):
    return [out.token_ids for out in engine.generate(prompts, GREEDY, use_tqdm=False)]


class Trainer:
    """Group rank 0 on a thread: joins the group, then broadcasts each list of tensors ``send`` is given, in
    order, until ``close``. Its error (if any) is raised by ``close``."""

    def __init__(self, port: int, world_size: int, group_name: str = "weight_update"):
        self.port, self.world_size, self.group_name = port, world_size, group_name
        self.work: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.broadcast = 0  # tensors broadcast so far
        self.thread = threading.Thread(target=self._run, name="test-trainer", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            group = WeightUpdateGroup("127.0.0.1", self.port, 0, self.world_size, group_name=self.group_name,
                                      timeout=TIMEOUT)
            try:
                while (tensors := self.work.get()) is not None:
                    for tensor in tensors:
                        group.broadcast(tensor.contiguous(), src=0)
                        self.broadcast += 1
            finally:
                group.close()
        except BaseException as error:  # noqa: BLE001 - raised in the test by close()
            self.error = error

    def send(self, tensors) -> None:
        self.work.put(list(tensors))

    def close(self) -> None:
        self.work.put(None)
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "the trainer is still broadcasting: the engine did not receive everything"
        if self.error is not None:
            raise self.error


def _join(engine, world_size: int, group_name: str = "weight_update") -> Trainer:
    """A trainer and ``engine`` in a new gloo group (the engine's ranks from group rank 1 on)."""
    port = _free_port()
    trainer = Trainer(port, world_size, group_name)
    engine.init_weight_update_group("127.0.0.1", port, 1, world_size, backend="gloo", group_name=group_name,
                                    timeout=TIMEOUT)
    return trainer


def _update(engine, trainer: Trainer, state: dict, **kwargs):
    """The trainer broadcasts ``state``'s tensors while the engine receives them by their names, dtypes, shapes."""
    trainer.send(state.values())
    return engine.update_weights_from_distributed(list(state), [t.dtype for t in state.values()],
                                                  [list(t.shape) for t in state.values()], **kwargs)


def test_two_group_members_broadcast_tensors_of_every_dtype_bit_for_bit_and_refuse_once_closed():
    port, got = _free_port(), {}
    sent = [torch.randn(3, 4).to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)]
    sent += [torch.arange(5), torch.tensor([True, False]), torch.empty(0, 2)]

    def member(rank):
        group = WeightUpdateGroup("127.0.0.1", port, rank, 2, timeout=TIMEOUT)
        tensors = sent if rank == 0 else [torch.zeros_like(t) for t in sent]
        for tensor in tensors:
            group.broadcast(tensor, src=0)
        group.close()
        group.close()
        try:
            group.broadcast(tensors[0], src=0)
            refused = None
        except RuntimeError as error:
            refused = str(error)
        got[rank] = (tensors, refused)

    other = threading.Thread(target=member, args=(1,))
    other.start()
    member(0)
    other.join(TIMEOUT)
    received, refused = got[1]
    assert refused == "weight-update group 'weight_update' is closed" and len(received) == len(sent)
    for want, tensor in zip(sent, received):
        assert want.dtype == tensor.dtype and torch.equal(want.view(torch.uint8), tensor.view(torch.uint8))


def test_one_rank_engine_updated_by_a_trainer_broadcast_holds_b_bit_for_bit_generates_as_b_and_forgets_its_cache(
        pair, tokens):  # noqa: F811 (tokens: a fixture)
    folder_a, folder_b, hf_b = pair
    prompts, want_a, want_b = tokens
    engine = Engine.from_pretrained(folder_a, **ARGS)
    assert _greedy(engine, prompts) == want_a
    cached = prompts[2]
    assert engine.generate([cached], GREEDY, use_tqdm=False)[0].num_cached_tokens == 12  # the cache works
    trainer = _join(engine, world_size=2)
    assert not torch.distributed.is_initialized()  # the group is built on its own store, not the default group
    state = hf_b.state_dict()
    report = _update(engine, trainer, state, strict=True)
    engine.destroy_weight_update_group()
    trainer.close()
    assert trainer.broadcast == len(state) and report.missing == []
    fresh_b = Engine.from_pretrained(folder_b, **ARGS)
    for (name, got), (_, want) in zip(engine.model.named_parameters(), fresh_b.model.named_parameters()):
        assert torch.equal(got, want), name
    assert engine.generate([cached], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert _greedy(engine, prompts) == want_b


# 1: every tensor is a round of its own (a status exchange between the ranks after each).
@pytest.mark.parametrize("batch_bytes", [1, None])
def test_two_rank_engine_updated_by_a_trainer_broadcast_generates_as_b_and_forgets_its_cache(pair, tokens,  # noqa: F811 (tokens: a fixture)
                                                                                           batch_bytes, monkeypatch):
    from atom_core.engine import weight_sync

    folder_a, _, hf_b = pair
    prompts, want_a, want_b = tokens
    if batch_bytes is not None:
        monkeypatch.setattr(weight_sync, "BATCH_BYTES", batch_bytes)  # (read by rank 0, which plans the rounds)
    with Engine.from_pretrained(folder_a, tensor_parallel_size=2, step_timeout=TIMEOUT, **ARGS) as engine:
        assert _greedy(engine, prompts) == want_a
        cached = prompts[2]
        trainer = _join(engine, world_size=3)  # the trainer, engine rank 0 (group rank 1), the worker (rank 2)
        state = hf_b.state_dict()
        report = _update(engine, trainer, state, strict=True)
        engine.destroy_weight_update_group()
        trainer.close()
        assert trainer.broadcast == len(state) and report.missing == []
        assert engine.generate([cached], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
        assert _greedy(engine, prompts) == want_b
        engine.check_health()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_declared_shape_that_does_not_fit_raises_naming_the_tensor_and_the_group_and_engine_serve_on(
        pair, tokens, tp, monkeypatch):  # noqa: F811 (tokens: a fixture)
    from atom_core.engine import weight_sync

    monkeypatch.setattr(weight_sync, "BATCH_BYTES", 1)  # a round a tensor: the load stops before the last one
    folder_a, _, hf_b = pair
    prompts, _, want_b = tokens
    state = hf_b.state_dict()
    bad = {"model.layers.0.self_attn.q_proj.weight": state["model.layers.0.self_attn.q_proj.weight"],
           Q_PROJ: torch.zeros(3, 5),  # the trainer broadcasts the shape it declared
           "model.layers.1.mlp.down_proj.weight": state["model.layers.1.mlp.down_proj.weight"]}
    with Engine.from_pretrained(folder_a, tensor_parallel_size=tp, step_timeout=TIMEOUT, **ARGS) as engine:
        trainer = _join(engine, world_size=1 + tp)
        with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.q_proj\.weight'.*shape \(3, 5\)"):
            _update(engine, trainer, bad)
        # every tensor was received (the last one after the refusal), so the group is in step: B loads over it
        _update(engine, trainer, state, strict=True)
        engine.destroy_weight_update_group()
        trainer.close()
        assert trainer.broadcast == len(bad) + len(state)
        assert _greedy(engine, prompts) == want_b


@pytest.mark.parametrize("names, dtypes, shapes, message", [
    ([Q_PROJ, "model.norm.weight"], ["float32"], [[64, 64], [64]], "one length, got 2, 1 and 2"),
    ([Q_PROJ], ["float33"], [[64, 64]], r"dtypes\[0\] \(tensor 'model\.layers\.1\.self_attn\.q_proj\.weight'\)"),
    ([Q_PROJ], ["torch.float32"], [[64, -1]], r"shapes\[0\] .* ints >= 0"),
    (Q_PROJ, ["float32"], [[64, 64]], "names must be a list"),
])
def test_bad_lists_raise_value_error_before_any_collective(pair, names, dtypes, shapes, message):
    folder_a, _, hf_b = pair
    engine = Engine.from_pretrained(folder_a, **ARGS)
    trainer = _join(engine, world_size=2)
    with pytest.raises(ValueError, match=message):
        engine.update_weights_from_distributed(names, dtypes, shapes)
    assert trainer.broadcast == 0
    # nothing was received: the next update's first broadcast is the first the engine takes
    norm = hf_b.state_dict()["model.norm.weight"]
    _update(engine, trainer, {"model.norm.weight": norm}, strict=True)
    engine.destroy_weight_update_group()
    trainer.close()
    assert torch.equal(engine.model.model.norm.weight, norm)


def test_an_update_is_refused_before_any_collective_without_a_group_from_an_engine_rank_quantized_or_busy(pair):
    folder_a, _, hf_b = pair
    engine = Engine.from_pretrained(folder_a, **ARGS)
    spec = (["model.norm.weight"], [torch.float32], [[64]])
    with pytest.raises(RuntimeError, match="no weight-update group is open"):
        engine.update_weights_from_distributed(*spec)
    trainer = _join(engine, world_size=2)
    with pytest.raises(ValueError, match=r"src must be a rank .* outside the engine's ranks 1\.\.1"):
        engine.update_weights_from_distributed(*spec, src=1)
    engine.add_request(prompts_for(hf_b.config.vocab_size, [5])[0], GREEDY)
    quant_config, engine.model.quant_config = engine.model.quant_config, SimpleNamespace(online=False,
                                                                                         quant_method="fp8")
    with pytest.raises(NotImplementedError, match="built from a quantized checkpoint"):  # (as if from an FP8 file)
        engine.update_weights_from_distributed(*spec, unfinished="abort")
    assert engine.has_unfinished_requests()  # refused before any request was aborted
    engine.model.quant_config = quant_config
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        engine.update_weights_from_distributed(*spec)
    engine.shutdown()  # closes the group
    trainer.close()  # (it broadcast nothing: the engine never waited for a tensor)
    assert engine._weight_group is None and trainer.broadcast == 0


def test_a_second_group_is_refused_naming_the_open_one_and_destroy_then_init_again_works(pair):
    folder_a, _, hf_b = pair
    engine = Engine.from_pretrained(folder_a, **ARGS)
    first = _join(engine, world_size=2, group_name="first")
    with pytest.raises(ValueError, match="weight-update group 'first' is open"):
        engine.init_weight_update_group("127.0.0.1", _free_port(), 1, 2, backend="gloo")
    engine.destroy_weight_update_group()
    engine.destroy_weight_update_group()  # idempotent
    first.close()
    second = _join(engine, world_size=2, group_name="second")
    norm = hf_b.state_dict()["model.norm.weight"]
    _update(engine, second, {"model.norm.weight": norm})
    engine.destroy_weight_update_group()
    second.close()
    assert torch.equal(engine.model.model.norm.weight, norm)


@pytest.mark.parametrize("args, message", [
    (dict(master_port=0), "master_port must be an int from 1 to 65535"),
    (dict(rank_offset=-1), "rank_offset must be an int >= 0"),
    (dict(world_size=1), "world_size must be an int >= 2"),
    (dict(rank_offset=2, world_size=2), r"rank_offset=2 \+ the engine's 1 ranks do not fit in world_size=2"),
    (dict(backend="nccl"), "backend 'nccl' needs the engine on CUDA"),
    (dict(backend="mpi"), "backend must be None"),
    (dict(timeout=0), "timeout must be"),
    (dict(group_name=""), "group_name must be a non-empty string"),
])
def test_init_refuses_arguments_that_make_no_sense_by_name_and_opens_no_group(pair, args, message):
    engine = Engine.from_pretrained(pair[0], **ARGS)
    call = dict(master_address="127.0.0.1", master_port=_free_port(), rank_offset=1, world_size=2) | args
    with pytest.raises(ValueError, match=message):
        engine.init_weight_update_group(**call)
    assert engine._weight_group is None


def test_data_parallel_replicas_updated_by_one_trainer_broadcast_generate_as_b(pair, tokens, monkeypatch):  # noqa: F811
    """Replica i's rank joins as group rank 1 + i: each of the trainer's broadcasts reaches both replicas."""
    folder_a, _, hf_b = pair
    prompts, want_a, want_b = tokens
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with Engine.from_pretrained(folder_a, data_parallel_size=2, step_timeout=TIMEOUT, **ARGS) as engine:
        assert _greedy(engine, prompts) == want_a
        with pytest.raises(RuntimeError, match="no weight-update group is open"):
            engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
        with pytest.raises(ValueError, match=r"rank_offset=2 \+ the engine's 2 ranks do not fit in world_size=3"):
            engine.init_weight_update_group("127.0.0.1", _free_port(), 2, 3, backend="gloo")
        trainer = _join(engine, world_size=3)
        with pytest.raises(ValueError, match=r"src must be a rank .* outside the engine's ranks 1\.\.2"):
            engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], src=2)
        engine.add_request(prompts[0], GREEDY)
        with pytest.raises(RuntimeError, match="1 requests are unfinished"):
            engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
        state = hf_b.state_dict()
        reports = _update(engine, trainer, state, strict=True, unfinished="abort")
        assert not engine.has_unfinished_requests()
        engine.destroy_weight_update_group()
        engine.destroy_weight_update_group()  # idempotent
        trainer.close()
        assert trainer.broadcast == len(state) and [r.missing for r in reports] == [[], []]
        assert _greedy(engine, prompts) == want_b
        engine.check_health()
