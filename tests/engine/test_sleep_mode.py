"""Sleep mode for colocated RL (vLLM's ``LLM(enable_sleep_mode=True)``, ``sleep(level)``, ``wake_up(tags)``): an
engine that sleeps and wakes generates as before, keeps its parameter objects, gets a new pool of the same shape
and forgets its prefix cache; after level 2 and ``load_weights`` it generates as an engine built from those
weights; and it refuses what it cannot do, by name.

Tiny random HF checkpoints (conftest's), fp32 on the CPU; the last test measures GPU memory and runs only on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from tests.engine.conftest import _checkpoint_b
from tests.engine.test_engine_parity import prompts_for
from tests.engine.test_weight_update import ARGS as UPDATE_ARGS
from tests.engine.test_weight_update import GREEDY, LENGTHS, _greedy, _torch_ops  # noqa: F401 (_torch_ops: autouse)

ARGS = dict(UPDATE_ARGS, enable_sleep_mode=True)


def _prompts(folder_and_hf):
    return prompts_for(folder_and_hf[1].config.vocab_size, LENGTHS)


def test_level_1_sleep_and_wake_up_generates_the_same_tokens_with_the_same_bit_exact_parameter_objects(tiny_qwen3):
    folder, _ = tiny_qwen3
    prompts = _prompts(tiny_qwen3)
    engine = Engine.from_pretrained(folder, **ARGS)
    want = _greedy(engine, prompts)
    before = {name: (p, p.detach().clone()) for name, p in engine.model.named_parameters()}
    buffers = {name: b.clone() for name, b in engine.model.named_buffers()}

    engine.sleep(level=1)
    assert engine.is_sleeping
    engine.wake_up()
    assert not engine.is_sleeping

    after = dict(engine.model.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, values) in before.items():
        assert after[name] is param, name
        assert torch.equal(param, values), name
    for name, buffer in engine.model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert _greedy(engine, prompts) == want


def test_sleep_frees_the_pool_and_wake_up_allocates_a_zeroed_pool_of_the_same_shape(tiny_qwen3):
    folder, _ = tiny_qwen3
    engine = Engine.from_pretrained(folder, **ARGS)
    _greedy(engine, _prompts(tiny_qwen3))
    old_pool = engine.runner.kv_pool
    assert old_pool.count_nonzero() > 0  # the generation wrote KV

    engine.sleep(level=1)
    assert engine.runner.kv_pool.numel() == 0 and not engine.runner.has_pool
    assert engine.model.bound_kv_caches is engine.runner._kv_caches  # the model holds the empty pool, not the old
    engine.wake_up()

    pool = engine.runner.kv_pool
    assert pool is not old_pool and pool.shape == old_pool.shape and pool.dtype == old_pool.dtype
    assert pool.count_nonzero() == 0
    assert engine.runner.is_bound and engine.runner.has_pool


def test_a_prompt_cached_before_sleep_is_not_a_prefix_hit_after_wake_up(tiny_qwen3):
    folder, _ = tiny_qwen3
    prompt = prompts_for(tiny_qwen3[1].config.vocab_size, [13])[0]
    engine = Engine.from_pretrained(folder, **ARGS)
    want = _greedy(engine, [prompt])
    assert engine.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 12  # the cache works
    engine.sleep(level=1)
    assert engine.block_manager.num_cached_blocks == 0
    engine.wake_up()
    out = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == want[0]


@pytest.mark.parametrize("which", ["b", "same"])
def test_level_2_then_load_weights_generates_as_an_engine_built_from_that_checkpoint(which, tiny_qwen3,
                                                                                    tmp_path_factory):
    folder_a, hf_a = tiny_qwen3
    folder_b, hf_b = _checkpoint_b("tiny_qwen3", hf_a, tmp_path_factory)
    folder, hf = (folder_b, hf_b) if which == "b" else (folder_a, hf_a)
    prompts = _prompts(tiny_qwen3)
    want = _greedy(Engine.from_pretrained(folder, **ARGS), prompts)
    engine = Engine.from_pretrained(folder_a, **ARGS)
    _greedy(engine, prompts)
    params = dict(engine.model.named_parameters())

    engine.sleep(level=2)
    assert all(p.numel() == 0 for p in params.values())  # the values are discarded, not kept
    engine.wake_up(["weights"])
    assert all(p is params[name] for name, p in engine.model.named_parameters())
    report = engine.load_weights(hf.state_dict().items(), strict=True)
    assert report.missing == []
    engine.wake_up(["kv_cache"])
    assert _greedy(engine, prompts) == want


def test_level_2_keeps_the_buffers_values(tiny_qwen3):
    folder, _ = tiny_qwen3
    engine = Engine.from_pretrained(folder, **ARGS)
    buffers = {name: b.clone() for name, b in engine.model.named_buffers()}
    assert buffers, "the model must have buffers (the rotary cache) for this test to mean anything"
    engine.sleep(level=2)
    engine.wake_up()
    for name, buffer in engine.model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name


def test_a_dsa_model_gets_its_indexer_caches_freed_and_back_and_generates_the_same_tokens(tmp_path):
    pytest.importorskip("transformers")
    from tests.models.moe_parity import build_moe_pair
    from tests.models.test_parity_deepseek_v32 import V32_SPARSE

    pair = build_moe_pair(V32_SPARSE, tmp_path)
    prompts = prompts_for(pair.hf_model.config.vocab_size, (17, 1, 9))
    engine = Engine.from_pretrained(pair.path, **ARGS)
    assert engine.runner.extra_pools, "the model must have caches beside the pool for this test to mean anything"
    want = _greedy(engine, prompts)
    shapes = {name: pool.shape for name, pool in engine.runner.extra_pools.items()}

    engine.sleep(level=1)
    assert all(pool.numel() == 0 for pool in engine.runner.extra_pools.values())
    engine.wake_up()
    assert {name: pool.shape for name, pool in engine.runner.extra_pools.items()} == shapes
    assert _greedy(engine, prompts) == want


def test_stepping_with_only_the_weights_awake_raises_naming_the_kv_cache_and_works_once_it_is_awake(tiny_qwen3):
    folder, _ = tiny_qwen3
    prompts = _prompts(tiny_qwen3)
    engine = Engine.from_pretrained(folder, **ARGS)
    want = _greedy(engine, prompts)
    engine.sleep(level=1)
    engine.wake_up(tags=["weights"])
    assert engine.is_sleeping
    with pytest.raises(RuntimeError, match="'kv_cache' asleep"):
        engine.step()
    with pytest.raises(RuntimeError, match="'kv_cache' asleep"):
        engine.add_request(prompts[0], GREEDY)
    engine.wake_up(["kv_cache"])
    assert not engine.is_sleeping
    assert _greedy(engine, prompts) == want


def test_add_request_and_step_and_load_weights_while_asleep_raise_naming_what_is_asleep(tiny_qwen3):
    folder, hf = tiny_qwen3
    engine = Engine.from_pretrained(folder, **ARGS)
    engine.sleep()
    with pytest.raises(RuntimeError, match=r"Engine.add_request: .*'kv_cache', 'weights' asleep"):
        engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match=r"Engine.step: .*asleep"):
        engine.step()
    with pytest.raises(RuntimeError, match=r"Engine.load_weights: .*'weights' asleep"):
        engine.load_weights(hf.state_dict().items())
    assert not engine.has_unfinished_requests()  # nothing was queued


def test_sleep_is_refused_while_requests_are_unfinished_naming_the_count(tiny_qwen3):
    folder, _ = tiny_qwen3
    engine = Engine.from_pretrained(folder, **ARGS)
    engine.add_request([1, 2, 3], GREEDY)
    engine.add_request([4, 5], GREEDY)
    with pytest.raises(RuntimeError, match="2 requests are unfinished"):
        engine.sleep()
    assert not engine.is_sleeping and engine.runner.has_pool
    while engine.has_unfinished_requests():
        engine.step()
    engine.sleep()
    assert engine.is_sleeping


def test_sleep_runs_out_the_step_launched_ahead_of_a_request_that_stopped_on_a_stop_token(tiny_qwen3):
    folder, _ = tiny_qwen3
    prompts = _prompts(tiny_qwen3)
    engine = Engine.from_pretrained(folder, **ARGS)
    want = _greedy(engine, prompts)
    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[want[0][1]]))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine._in_flight is not None, "async scheduling must have launched a step ahead for this test to mean anything"
    engine.sleep(level=1)
    assert engine._in_flight is None
    engine.wake_up()
    assert _greedy(engine, prompts) == want


def test_a_sleep_that_fails_copying_the_weights_leaves_the_engine_awake_with_its_weights(tiny_qwen3, monkeypatch):
    from atom_core.engine import sleep_mode

    folder, _ = tiny_qwen3
    prompts = _prompts(tiny_qwen3)
    engine = Engine.from_pretrained(folder, **ARGS)
    want = _greedy(engine, prompts)
    values = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    calls = []

    def offload_until_the_host_is_full(tensor, keep_values, pin):
        calls.append(tensor)
        if len(calls) == 3:
            raise MemoryError("host memory exhausted")
        return real_offload(tensor, keep_values, pin)

    real_offload = sleep_mode.offload
    monkeypatch.setattr(sleep_mode, "offload", offload_until_the_host_is_full)
    with pytest.raises(MemoryError):
        engine.sleep(level=1)
    monkeypatch.undo()
    assert not engine.is_sleeping and engine.runner.has_pool and engine.runner.is_bound
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, values[name]), name
    assert _greedy(engine, prompts) == want


def test_sleep_and_wake_up_are_refused_without_enable_sleep_mode(tiny_qwen3):
    folder, _ = tiny_qwen3
    engine = Engine.from_pretrained(folder, **ARGS | {"enable_sleep_mode": False})
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        engine.sleep()
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        engine.wake_up()
    assert not engine.is_sleeping and engine.runner.has_pool


@pytest.mark.parametrize("level", [0, 3, True, "1", None])
def test_sleep_refuses_a_level_other_than_1_or_2(level, tiny_qwen3):
    engine = Engine.from_pretrained(tiny_qwen3[0], **ARGS)
    with pytest.raises(ValueError, match="level must be 1"):
        engine.sleep(level)
    assert not engine.is_sleeping


@pytest.mark.parametrize("tags, error", [(["weight"], ValueError), (["weights", "kv"], ValueError), ([], ValueError),
                                         ("weights", TypeError)])
def test_wake_up_refuses_tags_that_are_not_a_list_of_weights_or_kv_cache_and_stays_asleep(tags, error, tiny_qwen3):
    engine = Engine.from_pretrained(tiny_qwen3[0], **ARGS)
    engine.sleep()
    with pytest.raises(error, match="tags must be"):
        engine.wake_up(tags)
    assert engine.is_sleeping and not engine.runner.has_pool
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in engine.model.parameters())  # (level 1: on the host)


def test_sleeping_twice_and_waking_an_awake_tag_change_nothing(tiny_qwen3, caplog):
    folder, _ = tiny_qwen3
    prompts = _prompts(tiny_qwen3)
    engine = Engine.from_pretrained(folder, **ARGS)
    want = _greedy(engine, prompts)
    engine.wake_up()  # not asleep: a warning (vLLM's rule)
    engine.sleep(level=1)
    engine.sleep(level=2)  # already asleep: the level-1 state (the saved weights) is kept
    engine.wake_up(["kv_cache"])
    engine.wake_up(["kv_cache", "weights"])  # kv_cache is awake: nothing done, the weights stay asleep
    assert engine.is_sleeping
    assert "already asleep" in caplog.text and "already awake" in caplog.text
    engine.wake_up(["weights"])
    assert _greedy(engine, prompts) == want


def _gpu_engine(folder):
    return Engine.from_pretrained(folder, dtype=torch.bfloat16, device="cuda", block_size=16, max_model_len=64,
                                  num_kv_blocks=4096, max_num_seqs=8, max_num_batched_tokens=256,
                                  enable_sleep_mode=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_level_1_sleep_on_a_gpu_frees_the_pool_and_weights_and_wake_up_recaptures_the_graphs(tiny_qwen3):
    folder, _ = tiny_qwen3
    prompts = _prompts(tiny_qwen3)
    with ops.use_backend(None):  # the GPU backends (the autouse fixture prefers the reference ops, run eagerly)
        engine = _gpu_engine(folder)
        assert engine.runner.graphs is not None and engine.runner.graphs.num_captured > 0
        want = _greedy(engine, prompts)
        weight_bytes = sum(t.numel() * t.element_size() for t in engine.model.parameters())
        weight_bytes += sum(t.numel() * t.element_size() for t in engine.model.buffers())
        pool_bytes = engine.runner.kv_pool.numel() * engine.runner.kv_pool.element_size()
        torch.cuda.synchronize()
        allocated, free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]

        engine.sleep(level=1)
        assert torch.cuda.memory_allocated() <= allocated - pool_bytes - weight_bytes
        assert torch.cuda.mem_get_info()[0] >= free + pool_bytes  # returned to the driver, not only to the cache
        assert engine.runner.graphs.num_captured == 0

        engine.wake_up()
        assert engine.runner.graphs is not None and engine.runner.graphs.num_captured > 0
        assert _greedy(engine, prompts) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_level_2_on_a_gpu_then_load_weights_generates_as_before_with_the_graphs_captured_again(tiny_qwen3):
    folder, hf = tiny_qwen3
    prompts = _prompts(tiny_qwen3)
    with ops.use_backend(None):
        engine = _gpu_engine(folder)
        want = _greedy(engine, prompts)
        params = dict(engine.model.named_parameters())
        engine.sleep(level=2)
        engine.wake_up(["weights"])
        assert all(p.is_cuda and p is params[name] for name, p in engine.model.named_parameters())
        engine.load_weights(hf.state_dict().items(), strict=True)
        engine.wake_up(["kv_cache"])
        assert engine.runner.graphs is not None and engine.runner.graphs.num_captured > 0
        assert _greedy(engine, prompts) == want


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_a_two_rank_engine_generates_as_before_after_sleep_1_and_as_b_after_sleep_2_and_load_weights(
        tiny_qwen3, tmp_path_factory, monkeypatch):
    """The protocol end to end: rank 0 and its worker (a process of its own) sleep and wake over the control
    channel without hanging, and generate right after (what the worker's part does: the SleepWorker tests)."""
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")  # (the worker reads it at import)
    folder, hf_a = tiny_qwen3
    folder_b, hf_b = _checkpoint_b("tiny_qwen3", hf_a, tmp_path_factory)
    prompts = _prompts(tiny_qwen3)
    want_b = _greedy(Engine.from_pretrained(folder_b, **ARGS), prompts)
    with Engine.from_pretrained(folder, tensor_parallel_size=2, step_timeout=60.0, **ARGS) as engine:
        want = _greedy(engine, prompts)
        engine.sleep(level=1)
        assert engine.is_sleeping
        with pytest.raises(RuntimeError, match="asleep"):
            engine.add_request(prompts[0], GREEDY)
        engine.wake_up(["weights"])
        engine.wake_up(["kv_cache"])
        assert not engine.is_sleeping
        assert _greedy(engine, prompts) == want

        engine.sleep(level=2)
        engine.wake_up(["weights"])
        engine.load_weights(hf_b.state_dict().items(), strict=True)
        engine.wake_up(["kv_cache"])
        assert _greedy(engine, prompts) == want_b


class _Channel:
    """A worker's control channel as SleepWorker uses it: its device and the status exchange (recorded)."""

    def __init__(self):
        self.device, self.statuses = torch.device("cpu"), []

    def exchange_status(self, status):
        self.statuses.append(status)
        return [status]


def test_a_worker_frees_its_pool_and_weights_on_sleep_and_brings_them_back_on_wake(tiny_qwen3):
    from atom_core.engine.sleep_mode import SleepWorker

    folder, _ = tiny_qwen3
    engine = Engine.from_pretrained(folder, **ARGS)  # (its model and runner stand in for a worker's)
    values = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    worker = SleepWorker(engine.model, engine.runner, _Channel())
    channel = worker.channel
    worker.handle({"sleep": 2})
    assert not engine.runner.has_pool
    assert all(p.numel() == 0 for p in engine.model.parameters())  # level 2: the values discarded
    worker.handle({"wake": ["weights"]})
    assert all(p.shape == values[name].shape for name, p in engine.model.named_parameters())
    assert not engine.runner.has_pool and worker.state is not None
    worker.handle({"wake": ["kv_cache"]})
    assert engine.runner.has_pool and worker.state is None
    assert channel.statuses == ["", "", ""]


def test_a_worker_that_cannot_offload_reports_it_and_keeps_its_pool(tiny_qwen3, monkeypatch):
    from atom_core.engine import sleep_mode

    def no_host_memory(*args, **kwargs):
        raise MemoryError("no pinned memory left")

    folder, _ = tiny_qwen3
    engine = Engine.from_pretrained(folder, **ARGS)
    worker = sleep_mode.SleepWorker(engine.model, engine.runner, _Channel())
    monkeypatch.setattr(sleep_mode, "offload_weights", no_host_memory)
    worker.handle({"sleep": 1})
    assert worker.channel.statuses == ["MemoryError: no pinned memory left"]
    assert engine.runner.has_pool and worker.state is None
    worker.handle({"wake": ["weights", "kv_cache"]})  # (rank 0's undo: nothing asleep here)
    assert worker.channel.statuses[-1] == ""


class _RankZeroChannel(_Channel):
    """Rank 0's control channel with a worker (rank 1) that answers each status exchange with ``worker_status``."""

    def __init__(self, worker_status):
        super().__init__()
        self.worker_status, self.sent = worker_status, []

    def check_usable(self):
        pass

    def send(self, kind, payload=b""):
        import pickle

        self.sent.append(pickle.loads(payload))

    def exchange_status(self, status):
        self.statuses.append(status)
        return [status, self.worker_status]


def test_when_a_worker_cannot_sleep_rank_0_wakes_every_rank_and_raises_naming_it(tiny_qwen3):
    folder, _ = tiny_qwen3
    prompts = _prompts(tiny_qwen3)
    engine = Engine.from_pretrained(folder, **ARGS)
    want = _greedy(engine, prompts)
    channel = engine._channel = _RankZeroChannel("MemoryError: no pinned memory left")
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1: MemoryError: no pinned memory left; every rank"):
        engine.sleep(level=1)
    assert channel.sent == [{"sleep": 1}, {"wake": ["weights", "kv_cache"]}]  # the undo reaches the workers
    assert not engine.is_sleeping and engine.runner.has_pool
    channel.worker_status = ""
    with pytest.raises(RuntimeError, match="wake_up\\(\\['kv_cache'\\]\\) again"):
        engine.sleep(level=1)
        channel.worker_status = "OutOfMemoryError: the pool"
        engine.wake_up(["kv_cache"])
    assert engine.is_sleeping  # (rank 0 woke its pool, but keeps the tag asleep so that the retry reaches rank 1)
    channel.worker_status = ""
    engine.wake_up(["weights", "kv_cache"])
    engine._channel = None
    assert not engine.is_sleeping and _greedy(engine, prompts) == want
