"""DP attention (CPU, gloo): two replicas that are the DP ranks of one world, each with the whole attention
and half of every MoE layer's experts, stepping in lock step (``engine/dp_attention.py``). Their greedy
tokens equal one engine's with chunked prefill, preemption and a rank that runs idle forwards while the
other still works; a killed rank gives a named error; nothing is left behind. The bounds (``step_timeout``)
are there so that a broken build fails instead of hanging; they claim nothing about speed."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from atom_core import ops
from atom_core.engine import DataParallelEngine, Engine, ReplicaFailedError, SamplingParams
from tests.engine.test_multi_rank import TIGHT, _live_children, _pid_exists, _prompts

# ten requests over two pools of 48 slots (preemption); the one of 20 tokens generates 24, the others 6: its
# replica works long after the other has finished (idle forwards there)
LENGTHS = (7, 1, 13, 20, 3, 9, 17, 5, 11, 19)
PARAMS = [SamplingParams(temperature=0, max_tokens=24 if n == 20 else 6, ignore_eos=True) for n in LENGTHS]
DP_ATTENTION = dict(data_parallel_size=2, expert_parallel="all_to_all", dp_attention=True, step_timeout=60)


@pytest.fixture
def cpu_replicas(monkeypatch):
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")  # the replicas read it at import
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_an_idle_forward_writes_no_kv_slot_and_counts_as_a_forward(tiny_qwen3_moe):
    folder, hf_model = tiny_qwen3_moe
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, **TIGHT)
        engine.generate(_prompts(hf_model.config.vocab_size, (7, 3)), PARAMS[:2], use_tqdm=False)  # a pool in use
        pool = engine.runner.kv_pool.clone()
        forwards = engine.runner.num_forwards
        engine.runner.idle_forward()
    assert engine.runner.num_forwards == forwards + 1
    assert torch.equal(engine.runner.kv_pool, pool)


def test_two_dp_attention_ranks_give_one_engines_greedy_tokens_with_preemption_and_idle_forwards(tiny_qwen3_moe,
                                                                                                  cpu_replicas):
    folder, hf_model = tiny_qwen3_moe
    prompts = _prompts(hf_model.config.vocab_size, LENGTHS)
    with ops.use_backend("torch"):
        one = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, **TIGHT)
        want = [o.token_ids for o in one.generate(prompts, PARAMS, use_tqdm=False)]
    children = _live_children()
    engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, **DP_ATTENTION, **TIGHT)
    assert isinstance(engine, DataParallelEngine) and engine.dp_attention
    got = [o.token_ids for o in engine.generate(prompts, PARAMS, use_tqdm=False)]
    stats = engine.replica_stats()
    routed = engine.requests_per_replica
    engine.shutdown()
    assert got == want
    assert min(routed) >= 1, routed
    assert sum(s["num_preemptions"] for s in stats) > 0, "the tiny pools are meant to preempt"
    assert max(s["idle_forwards"] for s in stats) > 0, "no rank ran a forward for its peer's sake"
    assert all(p.returncode == 0 for p in engine.processes), "the replicas left on shutdown, not by being killed"
    assert _live_children() <= children


def test_a_killed_dp_attention_rank_gives_a_named_error_and_leaves_no_process(tiny_qwen3_moe, cpu_replicas):
    folder, hf_model = tiny_qwen3_moe
    children = _live_children()
    engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, **(DP_ATTENTION | {"step_timeout": 10}))
    for prompt in _prompts(hf_model.config.vocab_size, (5, 9, 3)):
        engine.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    victim = engine.processes[1]
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(ReplicaFailedError) as failure:
        for _ in range(2000):  # bounded: a step that never fails ends the loop (and the test fails)
            engine.step()
    assert time.monotonic() - t0 < 30
    # (whichever the front hears first: the killed replica's closed socket, or its peer's failed collective)
    assert f"replica 1 (pid {victim.pid})" in str(failure.value) or "DP attention" in str(failure.value)
    pids = [p.pid for p in engine.processes]
    engine.shutdown()
    assert _live_children() <= children and not any(map(_pid_exists, pids))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_dp_attention_ranks_on_two_gpus_over_nccl_give_one_engines_greedy_tokens(tiny_qwen3_moe, monkeypatch):
    """Replica i on GPU i, the experts' exchange over NCCL, the agreement over gloo; fp32, so that the tokens
    compare exactly with one eager engine's on GPU 0 (the fp32 dot products of either path are the same)."""
    monkeypatch.delenv("ATOM_CORE_BACKEND", raising=False)
    folder, hf_model = tiny_qwen3_moe
    prompts = _prompts(hf_model.config.vocab_size, LENGTHS)
    args = dict(device="cuda", dtype=torch.float32, **TIGHT)
    one_gpu = Engine.from_pretrained(folder, enforce_eager=True, **args)
    want = [o.token_ids for o in one_gpu.generate(prompts, PARAMS, use_tqdm=False)]
    del one_gpu
    children = _live_children()
    with Engine.from_pretrained(folder, **DP_ATTENTION, **args) as engine:
        got = [o.token_ids for o in engine.generate(prompts, PARAMS, use_tqdm=False)]
        stats = engine.replica_stats()
    assert got == want
    assert all(s["device"].startswith("cuda") for s in stats) and max(s["idle_forwards"] for s in stats) > 0
    assert _live_children() <= children


@pytest.mark.parametrize("args, match", [
    (dict(data_parallel_size=2, expert_parallel=True, dp_attention=True), "expert_parallel='all_to_all'"),
    (dict(data_parallel_size=2, expert_parallel="all_to_all", tensor_parallel_size=2, dp_attention=True),
     "tensor_parallel_size=1"),
    (dict(dp_attention=True), "data_parallel_size > 1"),
])
def test_dp_attention_arguments_are_refused_before_any_replica_starts(tiny_qwen3_moe, args, match):
    children = _live_children()
    with pytest.raises(ValueError, match=match):
        Engine.from_pretrained(tiny_qwen3_moe[0], device="cpu", **args)
    assert _live_children() <= children
