"""``DataParallelEngine.load_weights`` over two replicas (CPU; real replica processes): a front built from
checkpoint A and updated with B's ``state_dict`` generates, on both replicas, the greedy tokens of a
one-process engine loaded from B and forgets every replica's prefix cache; a refused tensor or a failing
iterable raises in the front and every replica serves on; unfinished requests refuse the load before
anything is read; a replica killed during the load gives ``ReplicaFailedError`` and leaves no process;
replicas of two TP ranks each and DP-attention replicas (each holding half of the experts) load too, and
one DP-attention replica's refusal stops both. Each round travels through one shared-memory file
(``engine/shared_round.py``): its tensors arrive bit-exact in every dtype (pure-function tests, no engine), and
no file is left behind after a load that succeeds, is refused, meets a raising iterable or a round the front
cannot write, or loses a replica.

A and B are ``test_weight_update``'s tiny random checkpoints (same config, other seed), fp32. The module
shares one plain front and one DP-attention front; each test first loads the weights it starts from. The
bounds (``step_timeout``) are there so that a broken build fails instead of hanging.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from contextlib import contextmanager

import pytest
import torch

from atom_core import ops
from atom_core.engine import (
    Engine,
    ReplicaFailedError,
    SamplingParams,
    dp_weights,
    shared_round,
    weight_sync,
)
from tests.engine.test_engine_parity import prompts_for
from tests.engine.test_multi_rank import _live_children, _pid_exists
from tests.engine.conftest import _checkpoint_b

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ARGS = {"device": "cpu", "dtype": torch.float32, "block_size": 4, "max_model_len": 64}
LENGTHS = (7, 1, 13, 20)  # routed 7, 1, 13, 20 -> replicas 0, 1, 1, 0 (least outstanding tokens)
DP = {"data_parallel_size": 2, "step_timeout": 60}
DP_ATTENTION = {"data_parallel_size": 2, "expert_parallel": "all_to_all", "dp_attention": True, "step_timeout": 60}


def _start(folder, **kwargs):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATOM_CORE_BACKEND", "torch")  # the replicas read it at import
        patch.setenv("OMP_NUM_THREADS", "1")
        return Engine.from_pretrained(folder, **ARGS, **kwargs)


@contextmanager
def _served(folder, **kwargs):
    """A front started over ``folder``; on leaving, it is shut down, and its replicas must have left by
    themselves and no process be left behind."""
    children = _live_children()
    engine = _start(folder, **kwargs)
    try:
        yield engine
    finally:
        engine.shutdown()
    assert all(p.returncode == 0 for p in engine.processes), "the replicas left on shutdown, not by being killed"
    assert _live_children() <= children


def _one_process_greedy(folder, prompts):
    with ops.use_backend("torch"):
        return [o.token_ids for o in Engine.from_pretrained(folder, **ARGS).generate(prompts, GREEDY, use_tqdm=False)]


def _greedy_by_replica(front, prompts):
    """(each prompt's greedy tokens, the replica that ran it), step by step over the front."""
    ids = [front.add_request(prompt, GREEDY) for prompt in prompts]
    where = [front.replica_of(i) for i in ids]
    done = {}
    while front.has_unfinished_requests():
        for out in front.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids], where


def _pairs(state, taken):
    """A generator over ``state``'s pairs, recording each name as it is read."""
    for name, tensor in state.items():
        taken.append(name)
        yield name, tensor


@pytest.fixture
def shared_dir(tmp_path, monkeypatch):
    """The rounds' files go to an empty folder of this test; returns (the folder, the paths of the files written,
    recorded as they are written)."""
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setattr(shared_round, "SHARED_DIR", str(folder))  # (read by the front alone)
    written = []

    def recording(batch):
        message = shared_round.write_round(batch)
        written.append(message["file"])
        return message

    monkeypatch.setattr(dp_weights, "write_round", recording)
    return folder, written


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3, tmp_path_factory):
    """(prompts, A's state, B's state, A's greedy tokens, B's greedy tokens; one-process engines)."""
    folder_a, hf_a = tiny_qwen3
    folder_b, hf_b = _checkpoint_b("tiny_qwen3", hf_a, tmp_path_factory)
    prompts = prompts_for(hf_a.config.vocab_size, LENGTHS)
    want_a, want_b = _one_process_greedy(folder_a, prompts), _one_process_greedy(folder_b, prompts)
    assert want_a != want_b, "A and B must generate differently for the tests to mean anything"
    return prompts, hf_a.state_dict(), hf_b.state_dict(), want_a, want_b


@pytest.fixture(scope="module")
def front(tiny_qwen3):
    """Two replicas built from A."""
    with _served(tiny_qwen3[0], **DP) as engine:
        yield engine


# 1: one tensor a round (many rounds); the default: the whole tiny model in one round.
@pytest.mark.parametrize("batch_bytes", [1, weight_sync.BATCH_BYTES])
def test_two_replicas_from_a_updated_with_a_generator_of_b_give_b_greedy_tokens_on_both_replicas(
        front, qwen3, batch_bytes, monkeypatch):
    prompts, state_a, state_b, want_a, want_b = qwen3
    front.load_weights(state_a.items())  # (a parametrization before this one loaded B)
    got, where = _greedy_by_replica(front, prompts)
    assert got == want_a and sorted(set(where)) == [0, 1]
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", batch_bytes)  # (read by the front alone)
    taken = []
    reports = front.load_weights(_pairs(state_b, taken), strict=True)
    assert taken == list(state_b)  # read once, in order
    assert len(reports) == 2 and all(r.missing == [] and r.unused == [] and r.loaded for r in reports)
    got, where = _greedy_by_replica(front, prompts)
    assert sorted(set(where)) == [0, 1], "both replicas must serve some prompts"
    assert got == want_b
    front.check_health()


def test_a_prompt_cached_on_both_replicas_before_the_update_is_not_a_prefix_hit_after_it(front, qwen3):
    prompts, state_a, state_b, _, want_b = qwen3
    prompt = prompts[2]  # 13 tokens: 12 in full blocks of 4
    front.load_weights(state_a.items())
    front.generate([prompt, prompt], GREEDY, use_tqdm=False)  # one on each replica (an idle front: 0, then 1)
    cached = front.generate([prompt, prompt], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in cached] == [12, 12]  # the caches work, on both replicas
    front.load_weights(state_b.items())
    after = front.generate([prompt, prompt], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in after] == [0, 0]
    assert [o.token_ids for o in after] == [want_b[2]] * 2


def test_a_tensor_of_the_wrong_shape_raises_weight_load_error_naming_the_replica_and_the_tensor_and_it_serves_on(
        front, qwen3, monkeypatch):
    prompts, state_a, state_b, _, want_b = qwen3
    front.load_weights(state_a.items())
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", 1)  # the bad tensor is the second round
    bad = [("model.layers.0.self_attn.q_proj.weight", state_b["model.layers.0.self_attn.q_proj.weight"]),
           ("model.layers.1.self_attn.q_proj.weight", torch.zeros(3, 5)),
           ("model.layers.1.mlp.down_proj.weight", state_b["model.layers.1.mlp.down_proj.weight"])]
    with pytest.raises(weight_sync.WeightLoadError,
                       match=r"replica 0 failed .*'model\.layers\.1\.self_attn\.q_proj\.weight'.*shape \(3, 5\)"):
        front.load_weights(bad)
    front.check_health()
    got, where = _greedy_by_replica(front, prompts)  # (A's weights but layer 0's q from B: it runs)
    assert len(got) == len(prompts) and sorted(set(where)) == [0, 1]
    front.load_weights(state_b.items())
    assert _greedy_by_replica(front, prompts)[0] == want_b


def test_an_iterable_that_raises_midway_reraises_its_error_and_every_replica_serves_on(front, qwen3, monkeypatch):
    prompts, _, state_b, _, want_b = qwen3
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", 1)  # the failure comes after rounds already loaded

    def broken():
        for i, item in enumerate(state_b.items()):
            if i == 3:
                raise OSError("the trainer's gather failed")
            yield item

    with pytest.raises(OSError, match="the trainer's gather failed"):
        front.load_weights(broken())
    with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
        front.load_weights([("model.norm.weight", [1.0, 2.0])])
    front.check_health()
    front.load_weights(state_b.items())
    got, where = _greedy_by_replica(front, prompts)
    assert got == want_b and sorted(set(where)) == [0, 1]


def test_load_weights_is_refused_naming_the_count_while_requests_are_unfinished_and_reads_nothing(front, qwen3):
    prompts, state_a, state_b, want_a, _ = qwen3
    front.load_weights(state_a.items())
    for prompt in prompts[:2]:
        front.add_request(prompt, GREEDY)
    taken = []
    with pytest.raises(RuntimeError, match="2 requests are unfinished"):
        front.load_weights(_pairs(state_b, taken))
    assert taken == []
    while front.has_unfinished_requests():
        front.step()
    assert _greedy_by_replica(front, prompts)[0] == want_a  # nothing was loaded


def test_a_replica_killed_during_the_load_raises_replica_failed_error_naming_it_and_leaves_no_process(
        tiny_qwen3, qwen3, shared_dir, monkeypatch):
    _, _, state_b, _, _ = qwen3
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", 1)
    children = _live_children()
    engine = _start(tiny_qwen3[0], **(DP | {"step_timeout": 10}))
    victim = engine.processes[1]

    def killing():
        for i, item in enumerate(state_b.items()):
            if i == 3:  # rounds 1-3 went to both replicas
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
            yield item

    t0 = time.monotonic()
    with pytest.raises(ReplicaFailedError, match=f"replica 1 \\(pid {victim.pid}\\)"):
        engine.load_weights(killing())
    assert time.monotonic() - t0 < 30
    pids = [p.pid for p in engine.processes]
    engine.shutdown()
    assert _live_children() <= children and not any(map(_pid_exists, pids))
    folder, written = shared_dir
    assert len(written) == 4 and list(folder.iterdir()) == []  # (the fourth round's file too)


def test_no_round_file_is_left_after_a_load_that_succeeds_is_refused_or_meets_a_raising_iterable(
        front, qwen3, shared_dir, monkeypatch):
    prompts, _, state_b, _, want_b = qwen3
    folder, written = shared_dir
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", 1)  # one file per tensor
    front.load_weights(state_b.items())
    assert len(written) == len(state_b) and all(os.path.dirname(p) == str(folder) for p in written)
    assert len(set(written)) == len(written) and list(folder.iterdir()) == []
    del written[:]
    with pytest.raises(weight_sync.WeightLoadError, match="replica 0 failed"):
        front.load_weights([("model.norm.weight", state_b["model.norm.weight"]),
                            ("model.layers.1.self_attn.q_proj.weight", torch.zeros(3, 5))])
    assert len(written) == 2 and list(folder.iterdir()) == []
    del written[:]

    def broken():
        yield from list(state_b.items())[:2]
        raise OSError("the trainer's gather failed")

    with pytest.raises(OSError, match="the trainer's gather failed"):
        front.load_weights(broken())
    assert len(written) == 2 and list(folder.iterdir()) == []
    front.load_weights(state_b.items())
    assert _greedy_by_replica(front, prompts)[0] == want_b and list(folder.iterdir()) == []


def test_a_round_the_front_cannot_write_raises_its_os_error_leaves_no_file_and_every_replica_serves_on(
        front, qwen3, shared_dir, monkeypatch):
    prompts, state_a, state_b, want_a, _ = qwen3
    folder, written = shared_dir
    front.load_weights(state_a.items())
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", 1)
    recording = dp_weights.write_round

    def full(batch):
        if len(written) == 2:
            raise OSError("could not write a round of new weights: No space left on device")
        return recording(batch)

    monkeypatch.setattr(dp_weights, "write_round", full)
    with pytest.raises(OSError, match="No space left on device"):
        front.load_weights(state_b.items())
    assert list(folder.iterdir()) == []
    front.check_health()
    monkeypatch.setattr(dp_weights, "write_round", recording)
    front.load_weights(state_a.items())
    assert _greedy_by_replica(front, prompts)[0] == want_a


# ---- the round's file: write_round / read_round alone ---------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float64,
          torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64]
SHAPES = [(), (0,), (0, 5), (1,), (3,), (7, 13), (2, 3, 5)]


def _random(shape, dtype, generator):
    """A tensor of ``shape`` and ``dtype`` with random bytes (any bit pattern: NaNs of every kind included)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw &= 1  # (a bool byte is 0 or 1)
    return raw.view(dtype).reshape(shape)


def _bytes(tensor):
    return tensor.reshape(-1).view(torch.uint8)


def test_write_round_then_read_round_gives_every_tensor_bit_exact_in_every_dtype_and_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_round, "SHARED_DIR", str(tmp_path))
    monkeypatch.setattr(shared_round, "_WRITE_CHUNK", 7)  # (a tensor's bytes in several writes, as over 1 GiB)
    generator = torch.Generator().manual_seed(0)
    batch = [(f"t{i}.{j}", _random(shape, dtype, generator))
             for i, dtype in enumerate(DTYPES) for j, shape in enumerate(SHAPES)]
    whole = _random((6, 10), torch.bfloat16, generator)
    batch += [("a.view", whole[2:5]), ("a.transposed", whole.t()), ("empty.last", torch.empty(0, 3))]
    message = shared_round.write_round(batch)
    assert os.path.dirname(message["file"]) == str(tmp_path)
    assert all(offset % shared_round.ALIGN == 0 for *_, offset in message["tensors"])
    got = shared_round.read_round(message)
    shared_round.remove_round(message)
    assert list(tmp_path.iterdir()) == []
    assert [name for name, _ in got] == [name for name, _ in batch]
    for (name, want), (_, tensor) in zip(batch, got):  # (read after the file was removed: the mapping lives)
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
        assert torch.equal(_bytes(tensor), _bytes(want.contiguous())), name


def test_a_round_of_empty_tensors_only_reads_back_and_a_full_shared_folder_falls_back_to_the_temporary_one(
        tmp_path, monkeypatch):
    monkeypatch.setattr(shared_round, "SHARED_DIR", str(tmp_path / "missing"))  # (mkstemp fails there)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    message = shared_round.write_round([("e", torch.empty(0, 4, dtype=torch.bfloat16)), ("z", torch.empty(0))])
    assert os.path.dirname(message["file"]) == str(tmp_path) and message["nbytes"] == 0
    got = shared_round.read_round(message)
    assert [(n, t.dtype, t.shape) for n, t in got] == [("e", torch.bfloat16, (0, 4)), ("z", torch.float32, (0,))]
    shared_round.remove_round(message)
    shared_round.remove_round(message)  # (twice: nothing to remove)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing too"))
    with pytest.raises(OSError, match="could not write a round of new weights"):
        shared_round.write_round([("x", torch.ones(3))])


# ---- DP attention: each replica holds half of every MoE layer's experts ------------------------------------------

@pytest.fixture(scope="module")
def moe(tiny_qwen3_moe, tmp_path_factory):
    """(A's folder, prompts, B's state, B's greedy tokens of a one-process engine)."""
    folder_a, hf_a = tiny_qwen3_moe
    folder_b, hf_b = _checkpoint_b("tiny_qwen3_moe", hf_a, tmp_path_factory)
    prompts = prompts_for(hf_a.config.vocab_size, LENGTHS)
    want_b = _one_process_greedy(folder_b, prompts)
    assert want_b != _one_process_greedy(folder_a, prompts)
    return folder_a, prompts, hf_b.state_dict(), want_b


@pytest.fixture(scope="module")
def lock_step_front(moe):
    with _served(moe[0], **DP_ATTENTION) as engine:
        yield engine


def test_dp_attention_replicas_from_a_updated_with_b_give_b_greedy_tokens(lock_step_front, moe, monkeypatch):
    _, prompts, state_b, want_b = moe
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", 1)
    taken = []
    reports = lock_step_front.load_weights(_pairs(state_b, taken), strict=True)
    assert taken == list(state_b) and all(r.missing == [] for r in reports)
    got, where = _greedy_by_replica(lock_step_front, prompts)
    assert sorted(set(where)) == [0, 1]
    assert got == want_b
    lock_step_front.check_health()


def test_an_expert_tensor_only_replica_1_holds_refused_there_stops_both_replicas_and_they_serve_on(
        lock_step_front, moe):
    """Replica 1 holds experts 8-15: a wrong-shape expert 12 is refused there alone; replica 0 (which skips
    it) is told to stop, and the next full load and generation work on both."""
    _, prompts, state_b, want_b = moe
    bad = [("model.layers.0.mlp.experts.12.down_proj.weight", torch.zeros(3, 5))]
    with pytest.raises(weight_sync.WeightLoadError, match=r"replica 1 failed .*experts\.12\.down_proj") as error:
        lock_step_front.load_weights(bad)
    assert "replica 0" not in str(error.value)
    lock_step_front.check_health()
    lock_step_front.load_weights(state_b.items())
    assert _greedy_by_replica(lock_step_front, prompts)[0] == want_b


def test_dp_attention_replicas_take_fifty_back_to_back_loads_none_waiting_on_a_peer_in_the_agreement(
        lock_step_front, moe):
    """A load reaching one rank just before its next agreement and its peer just after must not leave the
    peer in the agreement while the front waits for its answer to a round (the ranks load after agreeing)."""
    _, _, state_b, _ = moe
    pair = [("model.norm.weight", state_b["model.norm.weight"])]
    t0 = time.monotonic()
    for _ in range(50):
        assert len(lock_step_front.load_weights(pair)) == 2
    assert time.monotonic() - t0 < 30  # (each takes milliseconds; a peer stuck in the agreement takes step_timeout)
    lock_step_front.check_health()


def test_two_replicas_of_two_tensor_parallel_ranks_from_a_updated_with_b_give_b_greedy_tokens(
        tiny_qwen3, qwen3, monkeypatch):
    """Each replica's engine streams the front's rounds on to its own worker rank (weight_sync)."""
    prompts, _, state_b, _, want_b = qwen3
    monkeypatch.setattr(weight_sync, "BATCH_BYTES", 1)  # the front's rounds: one tensor each
    with _served(tiny_qwen3[0], tensor_parallel_size=2, **DP) as engine:
        reports = engine.load_weights(state_b.items(), strict=True)
        assert len(reports) == 2 and all(r.missing == [] for r in reports)
        got, where = _greedy_by_replica(engine, prompts)
        assert got == want_b and sorted(set(where)) == [0, 1]
        engine.check_health()
