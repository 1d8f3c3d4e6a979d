"""Data parallelism (CPU): two replicas behind one front give one engine's outputs, share the work by
outstanding tokens, route aborts to the replica that runs the request, turn a dead or hung replica into a
named error within a bound, and leave no process behind.

Each ``DataParallelEngine`` here starts two real replica processes (the demo model: it has a tokenizer,
so text, stop strings and log-probs are compared too). The module shares one front; the failure tests
start their own. The bounds (``step_timeout``) are there so that a broken build fails instead of
hanging; they claim nothing about speed.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from atom_core import ops
from atom_core.engine import (
    DataParallelEngine,
    DistributedEngineError,
    Engine,
    ReplicaFailedError,
    SamplingParams,
    WorkerFailedError,
)
from atom_core.engine.engine import DEMO_MODEL
from tests.engine.test_multi_rank import _live_children, _pid_exists

# Chunked prefill (prompts of up to 20 tokens, 8 per step) and a pool of 32 blocks of 2 slots per replica
# (preemption when six requests of up to 32 tokens share it), async scheduling on (the default).
ARGS = {"device": "cpu", "dtype": torch.float32, "block_size": 2, "num_kv_blocks": 32, "max_model_len": 64,
        "max_num_batched_tokens": 8}
PARITY_LENGTHS = (7, 1, 13, 20, 3, 9, 17, 5, 11, 19, 2, 15)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(lengths=(7, 1, 13, 20, 3, 9), seed=0, vocab=2048) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab - 1) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def one():
    with ops.use_backend("torch"):
        yield Engine.from_pretrained(None, **ARGS)


@pytest.fixture(scope="module")
def dp():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATOM_CORE_BACKEND", "torch")  # the replicas read it at import
        patch.setenv("OMP_NUM_THREADS", "1")
        children = _live_children()
        engine = DataParallelEngine(None, data_parallel_size=2, step_timeout=60, **ARGS)
        yield engine
        engine.shutdown()
    assert all(p.returncode == 0 for p in engine.processes), "the replicas left on shutdown, not by being killed"
    assert _live_children() <= children


def test_two_replicas_give_one_engines_greedy_tokens_and_both_do_work(dp, one):
    prompts = _prompts(PARITY_LENGTHS)
    with ops.use_backend("torch"):
        want = one.generate(prompts, GREEDY, use_tqdm=False)
    before = dp.requests_per_replica
    got = dp.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [(o.request_id, o.finish_reason, o.prompt_token_ids) for o in got] == \
        [(o.request_id, "length", p) for o, p in zip(got, prompts)]
    assert len({o.request_id for o in got}) == len(prompts)
    routed = [a - b for a, b in zip(dp.requests_per_replica, before)]
    assert sum(routed) == len(prompts) and min(routed) >= 4, routed
    assert [r.outstanding for r in dp._replicas] == [0, 0]  # the routing counts went back to nothing
    stats = dp.replica_stats()
    assert [s["unfinished"] for s in stats] == [0, 0]
    assert all(s["free_blocks"] == s["num_blocks"] for s in stats)  # every block back (or in the prefix cache)
    assert sum(s["num_preemptions"] for s in stats) > 0, "the tiny pools are meant to preempt"


def test_text_stop_strings_logprobs_n_and_seeds_as_one_engine(dp, one):
    prompts = ["The function returns", "Return the value of", "This module provides"]
    params = [SamplingParams(temperature=0, max_tokens=16, stop=[" the"], logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, logprobs=0, prompt_logprobs=0),
              SamplingParams(temperature=0, max_tokens=8, include_stop_str_in_output=True, stop=["."])]
    with ops.use_backend("torch"):
        want = one.generate(prompts, params, use_tqdm=False)
    got = dp.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert [(o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in g.outputs] == \
            [(o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in w.outputs]
    assert got[0].stop_reason == " the"
    np.testing.assert_allclose(got[0].logprobs, want[0].logprobs, rtol=1e-4, atol=1e-5)
    assert [list(d) for d in got[0].top_logprobs] == [list(d) for d in want[0].top_logprobs]
    np.testing.assert_allclose(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:], rtol=1e-4, atol=1e-5)
    # ranks: greedy (with top N) and sampled (the draw's fused log-probs), n sequences sharing the prompt's
    for g, w in zip(got[:2], want[:2]):
        assert [(o.logprob_ranks, o.prompt_logprob_ranks) for o in g.outputs] == \
            [(o.logprob_ranks, o.prompt_logprob_ranks) for o in w.outputs]
    assert got[0].logprob_ranks == [1] * len(got[0].token_ids) and got[2].logprob_ranks is None
    assert any(rank > 1 for o in got[1].outputs for rank in o.logprob_ranks)
    # chat: Engine's own, over the front
    chat = dp.chat([{"role": "user", "content": "Return the value"}], GREEDY, use_tqdm=False) \
        if dp.tokenizer.chat_templates else None
    assert chat is None or len(chat[0].token_ids) == GREEDY.max_tokens


def test_max_tokens_none_runs_to_max_model_len_over_the_front(dp):
    out = dp.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == ARGS["max_model_len"] - 3 and out.finish_reason == "length"
    assert all(replica.outstanding == 0 for replica in dp._replicas)


def test_routing_takes_the_replica_with_the_fewest_outstanding_tokens(dp):
    big = dp.add_request([5] * 20, SamplingParams(max_tokens=20, ignore_eos=True))  # 40 outstanding
    small = [dp.add_request([6, 7], SamplingParams(max_tokens=4, ignore_eos=True)) for _ in range(7)]  # 6 each
    first = dp.replica_of(big)
    # 6, 12, .., 36 < 40 on the other replica; the seventh (42 > 40 would not be the fewest at 36 vs 40) too
    assert [dp.replica_of(i) for i in small] == [1 - first] * 7
    third = dp.add_request([6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert dp.replica_of(third) == first  # 42 against 40
    while dp.has_unfinished_requests():
        dp.step()


def test_step_streams_every_token_and_abort_goes_to_the_replica_running_the_request(dp):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    ids = [dp.add_request(p, params) for p in _prompts(lengths=(4, 5, 6, 7))]
    replicas = {i: dp.replica_of(i) for i in ids}
    assert set(replicas.values()) == {0, 1}
    streamed = {i: [] for i in ids}
    while not all(streamed.values()):
        for out in dp.step():
            streamed[out.request_id] += out.new_token_ids
            assert out.token_ids == streamed[out.request_id]
    victim = ids[0]
    with pytest.raises(TypeError, match="request_id must be an int"):
        dp.abort(str(victim))  # a vLLM-style string id names no request here
    dp.abort([victim])  # an iterable of ids, as vLLM's abort_request takes
    assert dp.replica_of(victim) is None and not dp.is_unfinished(victim) and dp.is_unfinished(ids[1])
    stats = dp.replica_stats()  # answered between the replicas' steps, after the abort
    assert victim not in stats[replicas[victim]]["unfinished_ids"]
    others = [i for i in ids[1:] if replicas[i] == replicas[victim]]
    assert set(stats[replicas[victim]]["unfinished_ids"]) <= set(others)
    finished = {}
    while dp.has_unfinished_requests():
        for out in dp.step():
            assert out.request_id != victim, "an aborted request's outputs are dropped"
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.token_ids
    assert sorted(finished) == ids[1:]
    assert all(finished[i] == streamed[i] and len(finished[i]) == 50 for i in ids[1:])
    assert [s["unfinished"] for s in dp.replica_stats()] == [0, 0]
    assert len(dp.step()) == 0 and not dp.has_unfinished_requests()


def test_reset_prefix_cache_asks_every_replica_refused_while_they_run_and_forgets_cached_prompts(dp):
    prompt = _prompts(lengths=(13,), seed=5)[0]
    dp.generate([prompt], GREEDY, use_tqdm=False)
    assert dp.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 12  # (an idle front: replica 0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [dp.add_request(p, params) for p in _prompts(lengths=(4, 5))]
    assert {dp.replica_of(i) for i in ids} == {0, 1}
    streamed = set()
    while streamed != set(ids):  # both admitted: each replica holds blocks
        streamed |= {out.request_id for out in dp.step()}
    assert dp.reset_prefix_cache() is False
    while dp.has_unfinished_requests():
        dp.step()
    assert dp.reset_prefix_cache() is True
    assert dp.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_async_engine_streams_over_the_front(dp):
    """AsyncEngine's step thread drives the front as it drives an Engine (its statistics read the replicas'
    pools summed)."""
    import asyncio

    from atom_core.engine import AsyncEngine

    async def collect(server, prompt):
        return [out async for out in server.generate(prompt, GREEDY)]

    async def run():
        async with AsyncEngine(dp) as server:
            outs = await asyncio.gather(*(collect(server, p) for p in _prompts(lengths=(3, 8, 5))))
            return outs, server.stats()

    outs, stats = asyncio.run(run())
    assert [len(o[-1].token_ids) for o in outs] == [GREEDY.max_tokens] * 3
    assert all(o[-1].finished and sum(len(x.new_token_ids) for x in o) == GREEDY.max_tokens for o in outs)
    assert stats.num_kv_blocks == 2 * ARGS["num_kv_blocks"]
    assert dp.block_manager.num_free_blocks == dp.block_manager.num_blocks


def test_a_step_that_raises_in_a_replica_fails_its_requests_only(dp):
    """What the front does with a replica's step error (injected as the replica would send it): raise
    ReplicaStepError naming the replica, finish that step's requests with "error", keep serving the rest."""
    from atom_core.engine import ReplicaStepError
    from atom_core.engine.data_parallel import ABORT, STEP_ERROR

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [dp.add_request(p, params) for p in _prompts(lengths=(4, 5))]
    failed = ids[0]
    owner = dp.replica_of(failed)
    dp._inbox.put((owner, (STEP_ERROR, [failed], "RuntimeError: boom")))
    with pytest.raises(ReplicaStepError, match=f"replica {owner}: a step raised RuntimeError: boom"):
        for _ in range(100):
            dp.step()
    dp._replicas[owner].conn.send((ABORT, failed))  # (the replica itself never failed: stop its copy)
    assert dp.failed_request_ids == [failed] and dp.replica_of(failed) is None
    done = {}
    while dp.has_unfinished_requests():
        for out in dp.step():
            assert out.request_id != failed
            done[out.request_id] = out
    assert list(done) == [ids[1]] and len(done[ids[1]].token_ids) == 20
    assert [r.outstanding for r in dp._replicas] == [0, 0]


def test_requests_are_checked_in_the_front_as_one_engine_checks_them(dp, one):
    for prompt, params in [([], None), ([1, 5000], None), ([1] * 64, SamplingParams(max_tokens=9)),
                           ("text", SamplingParams(logprobs=50)), ([1], SamplingParams(stop_token_ids=[5000]))]:
        with pytest.raises((ValueError, TypeError)) as ours:
            dp.add_request(prompt, params)
        with pytest.raises(type(ours.value)) as theirs:
            one.add_request(prompt, params)
        assert str(ours.value) == str(theirs.value)
    assert not dp.has_unfinished_requests()
    # the checkpoint's defaults, as the server reads them (generation_config.json's fields apart)
    assert (dp.default_sampling_params, dp.generation_defaults) == (one.default_sampling_params,
                                                                   one.generation_defaults)
    assert dp.generation_defaults == {"temperature": 0.8, "top_p": 0.9, "top_k": 0}


def test_shutdown_stops_every_replica_and_the_front_refuses_afterwards(dp):
    dp.add_request([1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
    dp.step()
    dp.shutdown()
    assert all(p.poll() == 0 for p in dp.processes)
    with pytest.raises(DistributedEngineError, match="shut down"):
        dp.step()
    dp.shutdown()  # idempotent


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_replicas_on_two_gpus_give_one_engines_greedy_tokens(tiny_qwen3, monkeypatch):
    """Replica i on GPU i (its CUDA_VISIBLE_DEVICES), each with its CUDA graphs; fp32 and a model with large
    logit margins (tiny_qwen3) so that the tokens compare exactly with one engine's on GPU 0."""
    monkeypatch.delenv("ATOM_CORE_BACKEND", raising=False)
    folder, hf_model = tiny_qwen3
    args = ARGS | {"device": "cuda"}
    prompts = _prompts(PARITY_LENGTHS, vocab=hf_model.config.vocab_size) * 2
    one_gpu = Engine.from_pretrained(folder, **args)
    want = [o.token_ids for o in one_gpu.generate(prompts, GREEDY, use_tqdm=False)]
    del one_gpu
    children = _live_children()
    with Engine.from_pretrained(folder, data_parallel_size=2, step_timeout=120, **args) as engine:
        got = [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
        stats = engine.replica_stats()
        assert min(engine.requests_per_replica) >= len(prompts) // 4
    assert got == want
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")
    assert [s["visible_gpus"] for s in stats] == visible[:2] and all(s["device"].startswith("cuda") for s in stats)
    assert _live_children() <= children


def test_bad_arguments_are_refused_before_any_replica_starts(monkeypatch):
    children = _live_children()
    for kwargs, error in [({"data_parallel_size": 0}, "data_parallel_size must be"),
                          ({"data_parallel_size": 2, "tensor_parallel_size": 0}, "tensor_parallel_size must be"),
                          ({"data_parallel_size": 2, "expert_parallel": "bogus"}, "expert_parallel must be"),
                          ({"data_parallel_size": 2, "device": "cuda:1"}, "CUDA_VISIBLE_DEVICES"),
                          ({"data_parallel_size": 2, "step_timeout": 0}, "step_timeout must be")]:
        with pytest.raises(ValueError, match=error):
            DataParallelEngine(None, **{"device": "cpu"} | kwargs)
    if torch.cuda.device_count() < 4:
        with pytest.raises(ValueError, match="needs 4 GPUs"):
            Engine.from_pretrained(None, data_parallel_size=2, tensor_parallel_size=2, device="cuda")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="torchrun"):
        Engine.from_pretrained(None, data_parallel_size=2, device="cpu")
    assert _live_children() <= children


def test_sizes_a_replicas_ranks_cannot_split_are_refused_before_any_replica_starts(monkeypatch):
    import atom_core.engine.data_parallel as dp_module

    monkeypatch.setattr(dp_module, "start_replica", lambda *_: pytest.fail("a replica was started"))
    with pytest.raises(ValueError, match="num_attention_heads.*is not divisible by tp_size=3"):
        Engine.from_pretrained(None, data_parallel_size=2, tensor_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has no experts to split"):
        Engine.from_pretrained(None, data_parallel_size=3, dp_attention=True, expert_parallel="all_to_all",
                               device="cpu")


def test_a_missing_checkpoint_is_named_in_the_front_and_a_replicas_load_error_reaches_it(tmp_path, monkeypatch):
    """A folder that is not there, or has no config.json, is refused before any replica starts, as load_model
    words it. A replica whose load fails on a file (here no *.safetensors) reports that error, not only its exit."""
    import shutil

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    children = _live_children()
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        Engine.from_pretrained(tmp_path / "none", data_parallel_size=2, device="cpu")
    with pytest.raises(FileNotFoundError, match="no config.json in model folder"):
        Engine.from_pretrained(tmp_path, data_parallel_size=2, device="cpu")
    shutil.copytree(DEMO_MODEL, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ReplicaFailedError, match=r"FileNotFoundError: no \*\.safetensors"):
        Engine.from_pretrained(tmp_path / "m", data_parallel_size=2, device="cpu", dtype=torch.float32)
    assert _live_children() <= children


# ---- failures -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_replica_that_dies_or_hangs_gives_a_named_error_and_leaves_no_process(how, monkeypatch):
    """SIGKILL: its socket closes, the front names it at once. SIGSTOP: it hangs; the front gives up after
    step_timeout (3 s here, the bound stated for the test). Either way every replica is stopped."""
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    children = _live_children()
    engine = Engine.from_pretrained(None, data_parallel_size=2, device="cpu", dtype=torch.float32, step_timeout=3)
    assert isinstance(engine, DataParallelEngine)
    ids = [engine.add_request(p, SamplingParams(max_tokens=400, ignore_eos=True)) for p in _prompts((5, 9, 3))]
    engine.step()
    on_victim = {i for i in ids if engine.replica_of(i) == 1}
    assert on_victim
    victim = engine.processes[1]
    engine.check_health()  # passes while every replica runs
    os.kill(victim.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    if how == "killed":  # before any step finds it, the health check (a server's /health) names it
        victim.wait(30)
        with pytest.raises(ReplicaFailedError, match=rf"replica 1 \(pid {victim.pid}\) was killed by SIGKILL"):
            engine.check_health()
    t0 = time.monotonic()
    with pytest.raises(ReplicaFailedError) as failure:
        for _ in range(2000):  # bounded: a step that never fails ends the loop (and the test fails)
            engine.step()
    assert time.monotonic() - t0 < 30
    assert isinstance(failure.value, WorkerFailedError)
    assert "replica 1" in str(failure.value) and str(victim.pid) in str(failure.value)
    if how == "killed":
        assert "SIGKILL" in str(failure.value)
    else:
        assert "step_timeout=3" in str(failure.value)
    # (replica 0's requests may have finished meanwhile: the failed ones are those unfinished at the failure)
    assert on_victim <= set(engine.failed_request_ids) <= set(ids) and not engine.has_unfinished_requests()
    with pytest.raises(DistributedEngineError, match="can no longer run"):
        engine.step()
    with pytest.raises(DistributedEngineError):
        engine.add_request([1, 2], None)
    pids = [p.pid for p in engine.processes]
    engine.shutdown()  # (already stopped by the failure: idempotent)
    del engine
    gc.collect()
    assert _live_children() <= children and not any(map(_pid_exists, pids))


def test_an_idle_replica_whose_worker_rank_dies_fails_the_front_health_check_naming_the_rank(monkeypatch):
    """Two replicas of two tensor-parallel ranks each; replica 1's second rank is killed while nothing runs. The
    replica finds it (it checks every HEALTH_EVERY_S while idle) and leaves, and the front's health check names
    the replica, the rank and the signal before any request goes there. Nothing is left running."""
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    children = _live_children()
    engine = Engine.from_pretrained(None, data_parallel_size=2, tensor_parallel_size=2, device="cpu",
                                    dtype=torch.float32, step_timeout=30)
    engine.check_health()  # passes while every process runs
    replica = engine.processes[1]
    (worker,) = _live_children(replica.pid)  # the replica's rank 1
    os.kill(worker, signal.SIGKILL)
    failure, deadline = None, time.monotonic() + 30
    while failure is None and time.monotonic() < deadline:
        try:
            engine.check_health()
            time.sleep(0.05)
        except ReplicaFailedError as error:
            failure = error
    assert failure is not None, "the health check still passed 30 s after a replica's worker rank was killed"
    assert f"replica 1 (pid {replica.pid})" in str(failure)
    assert f"worker rank 1 (pid {worker}) was killed by SIGKILL" in str(failure)
    with pytest.raises(ReplicaFailedError, match="replica 1"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    pids = [p.pid for p in engine.processes]
    engine.shutdown()
    del engine
    gc.collect()
    assert _live_children() <= children and not any(map(_pid_exists, [*pids, worker]))


def test_a_caller_that_steps_later_than_step_timeout_gets_the_finished_outputs(monkeypatch):
    """The replica finished and went quiet; its outputs wait in the front's inbox: not a hang."""
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with Engine.from_pretrained(None, data_parallel_size=2, device="cpu", dtype=torch.float32,
                                step_timeout=1) as engine:
        rid = engine.add_request("Return the number of", SamplingParams(max_tokens=4, ignore_eos=True))
        deadline = time.monotonic() + 60
        while engine._inbox.qsize() < 4 and time.monotonic() < deadline:  # the replica's four steps arrived
            time.sleep(0.05)
        time.sleep(1.5)  # past step_timeout since the replica's last message
        outs = [o for _ in range(4) for o in engine.step()]
        assert [(o.request_id, o.finish_reason) for o in outs][-1] == (rid, "length")
        assert all(p.poll() is None for p in engine.processes)


def test_no_dict_of_a_replica_holds_a_request_it_aborted(one):
    """The replica's loop (``dp_replica._serve``, driven in this process by a scripted connection): once a
    request with log-probs is aborted after its first steps and the engine is idle, no dict refers to it
    (the engine's tables dropped it; the loop's own table of sequences to report must too)."""
    from atom_core.engine.dp_replica import ABORT, ADD, OUTPUTS, SHUTDOWN, _serve

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    group_id = one._next_id + 100

    class Script:
        def __init__(self):
            self.commands = [(ADD, group_id, np.arange(1, 6, dtype=np.int64), params)]
            self.steps = 0
            self.aborted = []  # the aborted request (a list: not a dict)
            self.dicts_holding_it = None

        def poll(self, timeout=0.0):
            if self.steps == 3 and not self.aborted:  # abort after three steps
                self.aborted.append(one._requests[group_id][0])
                self.commands.append((ABORT, group_id))
            return bool(self.commands) or timeout > 0  # the idle loop's wait: recv() comes next

        def recv(self):
            if not self.commands:  # idle after the abort: what still refers to the request?
                gc.collect()
                self.dicts_holding_it = sum(isinstance(r, dict) for r in gc.get_referrers(self.aborted[0]))
                return (SHUTDOWN,)
            return self.commands.pop(0)

        def send(self, message):
            self.steps += message[0] == OUTPUTS

    script = Script()
    with ops.use_backend("torch"):
        assert _serve(one, script)
    assert script.aborted and script.dicts_holding_it == 0


def test_replica_stats_of_an_idle_replica_that_hangs_raises_after_step_timeout(monkeypatch):
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    engine = Engine.from_pretrained(None, data_parallel_size=2, device="cpu", dtype=torch.float32, step_timeout=2)
    try:
        victim = engine.processes[1]
        os.kill(victim.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ReplicaFailedError, match=r"replica 1 .*did not answer within step_timeout=2"):
            engine.replica_stats()
        assert time.monotonic() - t0 < 20
    finally:
        engine.shutdown()


def test_engine_arguments_that_cannot_go_to_a_replica_are_refused_before_any_starts(monkeypatch):
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")
    children = _live_children()
    with pytest.raises(TypeError, match="must be picklable"):
        Engine.from_pretrained(None, data_parallel_size=2, device="cpu", kv_cache_dtype=lambda: 0)
    gc.collect()
    assert _live_children() <= children


def test_with_an_engine_seed_replica_i_draws_as_one_engine_of_seed_plus_i(monkeypatch):
    """The same unseeded prompt twice, one on each replica (routing: the second goes to the idle one): each
    draws what one engine of the seed plus the replica's index draws for its first request."""
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    prompt = "Return the number of"
    with Engine.from_pretrained(None, data_parallel_size=2, device="cpu", dtype=torch.float32, seed=3) as engine:
        ids = [engine.add_request(prompt, params) for _ in range(2)]
        assert [engine.replica_of(i) for i in ids] == [0, 1]
        outs = {}
        while engine.has_unfinished_requests():
            outs |= {o.request_id: o.token_ids for o in engine.step().finished()}
    with ops.use_backend("torch"):
        alone = [Engine.from_pretrained(None, device="cpu", dtype=torch.float32, seed=3 + i).generate(
            prompt, params, use_tqdm=False)[0].token_ids for i in range(2)]
    assert [outs[i] for i in ids] == alone and alone[0] != alone[1]
