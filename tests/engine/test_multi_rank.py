"""The engine over two ranks (CPU, gloo): the same greedy tokens as one rank, failures turned into
named errors within a bound, and no process left behind.

Each 2-rank engine here starts a real worker process (``Engine.from_pretrained(tensor_parallel_size=2)``)
or two launcher processes (``torch.distributed.run --nnodes 2``, one rank each, rendezvous over
loopback: the multi-node path on one machine). The bounds below (``step_timeout``, the subprocess
timeouts) are there so that a broken build fails instead of hanging; they claim nothing about speed.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from atom_core.engine.cuda_graphs import DECODE, MIXED, Bucket
from atom_core.engine.distributed import (
    CONFIG,
    HEADER_BYTES,
    INLINE_BYTES,
    STEP,
    DistributedEngineError,
    StepInputs,
    WorkerFailedError,
    decode,
    encode,
)
from atom_core.ops.validation import debug_checks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("multi_rank_script.py")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Chunked prefill (prompts of 13 and 20 tokens, 8 per step) and preemption (24 blocks of 2 slots for five
# requests of up to 32 tokens), with async scheduling (the default) on.
TIGHT = dict(block_size=2, num_kv_blocks=24, max_model_len=48, max_num_batched_tokens=8)
PROCESS_BOUND_S = 120  # a launcher run that takes longer has hung


# "cuda": NCCL between two GPUs (the next GPU session runs these; skipped without two GPUs).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                reason="needs two GPUs"))]


@pytest.fixture(autouse=True)
def _workers_prefer_the_torch_ops(monkeypatch):
    """The worker processes read ATOM_CORE_BACKEND at import (rank 0 runs inside use_backend("torch"))."""
    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")


def _backend(device: str, monkeypatch):
    """The reference ops on the CPU (the workers too); on GPUs the default choice on every rank."""
    if device == "cuda":
        monkeypatch.delenv("ATOM_CORE_BACKEND")
        return ops.use_backend(None)
    return ops.use_backend("torch")


def _prompts(vocab: int, lengths=(7, 1, 13, 20, 3), seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab - 1) for _ in range(n)] for n in lengths]


def _live_children(parent: int | None = None) -> set[int]:
    """Pids of the children of ``parent`` (default: this process) that still exist (zombies included: not
    reaped is left behind)."""
    parent = os.getpid() if parent is None else parent
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                children.add(int(entry))
    return children


def _worker_pids(engine) -> list[int]:
    return [p.pid for p in engine.workers.processes.values()]


def _pid_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _generate(engine, prompts, params=GREEDY):
    outs = engine.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs]


# ---- what crosses to the workers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_extras", [False, True])
@pytest.mark.parametrize("rows, pages", [(3, 2), (300, 128)])  # the second is over INLINE_BYTES: two broadcasts
def test_step_message_decodes_to_the_inputs_it_encodes(rows, pages, with_extras):
    rng = np.random.default_rng(rows)
    tokens = rows * 2
    inputs = StepInputs(rng.integers(0, 1000, tokens), np.full(rows, 2), rng.integers(0, 50, rows),
                        rng.integers(-1, 99, (rows, pages)).astype(np.int32),
                        np.arange(2) if with_extras else None, np.array([1, 0]) if with_extras else None,
                        rng.integers(0, tokens, 5) if with_extras else None,
                        Bucket(MIXED, 1024, 257) if with_extras else None)
    message = encode(STEP, inputs)
    assert (len(message) > INLINE_BYTES) == (rows == 300)
    kind, got = _roundtrip(message)
    assert kind == STEP
    for name in ("input_ids", "query_lens", "cached_lens", "block_tables", "pending_positions", "pending_sources",
                 "prompt_logprob_indices"):
        want, have = getattr(inputs, name), getattr(got, name)
        assert (want is None) == (have is None), name
        if want is not None:
            np.testing.assert_array_equal(have, want, err_msg=name)
    assert got.bucket == inputs.bucket and got.block_tables.dtype == np.int32 and not got.is_decode
    decode_step = StepInputs(np.arange(4), np.ones(4), np.arange(4), np.zeros((4, 1), np.int32),
                             bucket=Bucket(DECODE, 4, 4))
    assert _roundtrip(encode(STEP, decode_step))[1].bucket == Bucket(DECODE, 4, 4)
    assert _roundtrip(encode(CONFIG, payload=b"xyz")) == (CONFIG, b"xyz")


def _roundtrip(message: np.ndarray):
    return decode(message[:HEADER_BYTES].view(np.int64), message[HEADER_BYTES:])


# ---- two ranks give one rank's tokens ---------------------------------------------------------------------------------

CASES = {
    "qwen3-tp": ("tiny_qwen3", False),
    "qwen3_moe-tp": ("tiny_qwen3_moe", False),
    "qwen3_moe-ep": ("tiny_qwen3_moe", True),
    "qwen3_moe-ep-a2a": ("tiny_qwen3_moe", "all_to_all"),  # tokens sent to their experts' rank and back
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_greedy_tokens_of_one_rank_with_chunked_prefill_and_preemption(request, case, device,
                                                                                          monkeypatch):
    fixture, expert_parallel = CASES[case]
    folder, hf_model = request.getfixturevalue(fixture)
    prompts = _prompts(hf_model.config.vocab_size)
    children = _live_children()
    with _backend(device, monkeypatch):
        one = Engine.from_pretrained(folder, device=device, dtype=torch.float32, **TIGHT)
        want = _generate(one, prompts)
        with Engine.from_pretrained(folder, device=device, dtype=torch.float32, tensor_parallel_size=2,
                                    expert_parallel=expert_parallel, step_timeout=60, **TIGHT) as two:
            assert two.model.parallel.tp_size == 2 and two.model.parallel.expert_parallel == expert_parallel
            assert not two._channel.one_shot_all_reduce  # NCCL unless ATOM_CORE_ONE_SHOT_ALL_REDUCE=1 (ops.comm)
            got = _generate(two, prompts)
            assert two.num_preemptions > 0, "the tiny pool is meant to preempt"
            assert two.block_manager.num_blocks == one.block_manager.num_blocks
            # a second round on the same engine: its prefix cache hits, the workers' pools hold the blocks
            again = _generate(two, prompts[:2])
            pids = _worker_pids(two)
    assert one.num_preemptions > 0
    assert got == want
    assert again == want[:2]
    assert _live_children() <= children and not any(map(_pid_exists, pids))


def test_two_ranks_serve_prompt_logprobs_penalties_and_seeded_sampling_as_one_rank_does(tiny_qwen3):
    """Steps whose extra LM-head calls are collectives too (prompt log-probs) and whose sampling state lives
    on rank 0 only (penalties, seeds, top-N log-probs)."""
    folder, hf_model = tiny_qwen3
    prompts = _prompts(hf_model.config.vocab_size, lengths=(9, 4))
    params = [SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.5, presence_penalty=0.5,
                             ignore_eos=True)]
    with ops.use_backend("torch"):
        one = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
        want = one.generate(prompts, params, use_tqdm=False)
        with Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, tensor_parallel_size=2,
                                    step_timeout=60) as two:
            got = two.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    np.testing.assert_allclose([lp for lp in got[0].prompt_logprobs[1:]],
                               [lp for lp in want[0].prompt_logprobs[1:]], rtol=1e-4, atol=1e-4)


# ---- failures and lifetime --------------------------------------------------------------------------------------------

def _running_engine(folder, device="cpu", **kwargs):
    # (A pool sized by the free memory of an H200 would hold tens of millions of this tiny model's blocks.)
    engine = Engine.from_pretrained(folder, device=device, dtype=torch.float32, tensor_parallel_size=2,
                                    num_kv_blocks=2048, **kwargs)
    for prompt in _prompts(96, lengths=(5, 9, 3)):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.step()
    engine.step()
    return engine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_worker_that_dies_or_hangs_gives_a_named_error_and_leaves_no_process(tiny_qwen3, how, device,
                                                                               monkeypatch):
    """SIGKILL: the worker's sockets close, rank 0 names it at once. SIGSTOP: it hangs; rank 0 gives up after
    step_timeout (3 s here, the bound stated for the test), and shutdown kills it."""
    folder, _ = tiny_qwen3
    children = _live_children()
    # On GPUs the ops' debug checks read values on the host, which would wait for the dead rank's collectives.
    with _backend(device, monkeypatch), debug_checks(device == "cpu"):
        engine = _running_engine(folder, device, step_timeout=3)
        (worker,) = engine.workers.processes.values()
        os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        with pytest.raises(WorkerFailedError) as failure:
            for _ in range(200):  # bounded: a step that never fails ends the loop (and the test fails)
                engine.step()
        with pytest.raises(DistributedEngineError, match="can no longer run"):
            engine.step()
    if how == "killed":
        assert "worker rank 1" in str(failure.value) and "SIGKILL" in str(failure.value)
    else:  # (gloo: the collective's own timeout; NCCL: rank 0's poll of the step's event)
        assert "did not answer in time" in str(failure.value) or "step_timeout=3" in str(failure.value)
    assert not engine.has_unfinished_requests() or all(r.finished for g in engine._requests.values() for r in g)
    engine.shutdown()  # (already stopped by the failure: idempotent)
    assert worker.poll() is not None and _live_children() <= children


def test_after_a_worker_dies_the_health_check_names_it_every_request_ends_with_an_error_and_new_ones_are_refused(
        tiny_qwen3):
    """With one request running at a time the others wait: no step will run them, so they end with the failure
    too (a streaming caller, AsyncEngine, learns it from failed_request_ids), and add_request refuses."""
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, tensor_parallel_size=2,
                                        max_num_seqs=1, step_timeout=60)
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
               for p in _prompts(96, lengths=(5, 9, 3))]
        engine.step()
        engine.check_health()  # passes while every rank runs
        (worker,) = engine.workers.processes.values()
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(30)
        with pytest.raises(WorkerFailedError, match=rf"worker rank 1 \(pid {worker.pid}\) was killed by SIGKILL"):
            engine.check_health()  # before any step finds it: what a server's /health reports
        with pytest.raises(WorkerFailedError):
            for _ in range(200):
                engine.step()
        assert engine.failed_request_ids == ids and not engine.has_unfinished_requests()
        with pytest.raises(DistributedEngineError, match="can no longer run"):
            engine.add_request([1, 2, 3])
        engine.shutdown()


def test_an_async_engine_over_a_dead_worker_ends_its_streams_and_refuses_new_requests(tiny_qwen3):
    from atom_core.engine.async_engine import AsyncEngine, EngineStepError

    folder, _ = tiny_qwen3

    async def main(engine):
        async with AsyncEngine(engine) as async_engine:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            streams = [await async_engine.add_request(p, params) for p in _prompts(96, lengths=(5, 9, 3))]
            await streams[0].__anext__()  # the first request runs
            (worker,) = engine.workers.processes.values()
            os.kill(worker.pid, signal.SIGKILL)
            ends = []
            for stream in streams:
                try:
                    async for _ in stream:
                        pass
                    ends.append("finished")
                except EngineStepError:
                    ends.append("error")
            with pytest.raises(DistributedEngineError):
                await async_engine.add_request([1, 2, 3], params)
            return ends

    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, tensor_parallel_size=2,
                                        max_num_seqs=1, step_timeout=60)
        assert asyncio.run(asyncio.wait_for(main(engine), 60)) == ["error"] * 3
        engine.shutdown()


def test_a_teardown_that_blocks_is_left_behind_after_its_bound_and_one_that_raises_is_logged(caplog):
    """The process group's destroy / abort run through ``workers.bounded``: shutdown cannot hang on them."""
    from atom_core.engine.workers import bounded

    release = threading.Event()
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="atom_core.engine.workers"):
        assert bounded(release.wait, "a blocked teardown", timeout=0.2) is False
        waited = time.monotonic() - t0
        assert bounded(lambda: 1 / 0, "a failing teardown", timeout=5) is True
    release.set()
    assert 0.2 <= waited < 2
    assert "a blocked teardown did not finish within 0.2 s" in caplog.text
    assert "a failing teardown: division by zero" in caplog.text


def test_shutdown_and_the_context_manager_stop_every_worker(tiny_qwen3):
    folder, _ = tiny_qwen3
    children = _live_children()
    with ops.use_backend("torch"):
        engine = _running_engine(folder, step_timeout=60)
        (worker,) = engine.workers.processes.values()
        engine.shutdown()
        assert worker.returncode == 0, "the worker left on the shutdown message, not by being killed"
        assert _live_children() <= children
        with pytest.raises(DistributedEngineError, match="shut down"):
            engine.step()
        engine.shutdown()  # idempotent

        with Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, tensor_parallel_size=2) as engine:
            (worker,) = engine.workers.processes.values()
            assert _generate(engine, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
        assert worker.returncode == 0 and _live_children() <= children


def test_a_second_multi_rank_engine_while_the_first_runs_is_refused_and_one_after_it_starts(tiny_qwen3):
    """Its world is the first engine's, whose ranks serve that engine: joining it waited forever. Refused at
    once, naming the rule; once the first has shut down, the next one starts."""
    folder, _ = tiny_qwen3
    children = _live_children()
    with ops.use_backend("torch"):
        first = _running_engine(folder, step_timeout=60)
        with pytest.raises(RuntimeError, match="one multi-rank engine per process at a time"):
            Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, tensor_parallel_size=2)
        first.step()  # the first still serves
        first.shutdown()
        with Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, tensor_parallel_size=2) as second:
            assert _generate(second, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
    assert _live_children() <= children


def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_refused_before_any_rank_starts(tiny_qwen3,
                                                                                                 monkeypatch):
    """Every rank used to start, join its group and then fail on the same division; now the front refuses it."""
    import atom_core.engine.engine as engine_module

    folder, _ = tiny_qwen3
    monkeypatch.setattr(engine_module, "start_ranks", lambda **_: pytest.fail("a rank was started"))
    with pytest.raises(ValueError, match="num_attention_heads.*is not divisible by tp_size=3"):
        Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, tensor_parallel_size=3)


def test_an_engine_dropped_without_shutdown_stops_its_workers(tiny_qwen3):
    folder, _ = tiny_qwen3
    children = _live_children()
    with ops.use_backend("torch"):
        engine = _running_engine(folder, step_timeout=60)
        pids = _worker_pids(engine)
        del engine
        gc.collect()
    assert _live_children() <= children and not any(map(_pid_exists, pids))


def test_an_engine_left_running_at_interpreter_exit_leaves_no_process(tiny_qwen3, tmp_path):
    folder, _ = tiny_qwen3
    code = (f"import torch, atom_core.engine as e\n"
            f"engine = e.Engine.from_pretrained({str(folder)!r}, device='cpu', dtype=torch.float32, "
            f"tensor_parallel_size=2)\n"
            f"engine.generate([[1, 2, 3]], e.SamplingParams(max_tokens=2), use_tqdm=False)\n"
            f"print(*[p.pid for p in engine.workers.processes.values()])\n")  # and exit, engine still alive
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=PROCESS_BOUND_S, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 10  # (an orphan would be reparented, not gone)
    while any(map(_pid_exists, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_pid_exists, pids))


# ---- launched by torchrun: every rank runs the same script ------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode, per_node", [("from_pretrained", 2), ("own-world", 1)])
def test_two_launcher_invocations_as_two_nodes_give_one_ranks_tokens(tiny_qwen3_moe, tmp_path, mode, per_node):
    """``torch.distributed.run --nnodes 2 --node-rank {0,1}``: two separate launchers meeting over loopback (the
    multi-node path on one machine); the script is the one a user writes. ``from_pretrained``: two ranks per
    node, TP 4 across the nodes (KV heads replicated, 4 experts per rank; measured on 2 shared cores: 7 s, 3 s
    more than one rank per node); ``own-world``: one rank per node."""
    folder, _ = tiny_qwen3_moe
    out = tmp_path / "tokens.json"
    port = _free_port()
    extra = ["--own-world"] if mode == "own-world" else []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    launchers = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                   str(node), "--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1",
                                   "--master-port", str(port), str(SCRIPT), str(folder), str(out), "--expert-parallel",
                                   *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
                 for node in (0, 1)]
    try:
        logs = [launcher.communicate(timeout=PROCESS_BOUND_S)[0] for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
    assert [launcher.returncode for launcher in launchers] == [0, 0], "\n".join(log[-3000:] for log in logs)
    from tests.engine import multi_rank_script as script

    with ops.use_backend("torch"):
        one = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, **script.ENGINE_ARGS)
        want = _generate(one, script.PROMPTS, script.PARAMS)
    assert json.loads(out.read_text()) == want


# ---- four and eight ranks: KV heads replicated, a quarter (an eighth) of the experts each ------------------------------

# 8 query heads over 2 KV heads: at 4 ranks each rank holds 2 query heads and one KV head, replicated on 2 ranks
# (at 8 ranks: 1 query head, each KV head on 4 ranks). 16 experts: 4 (2) whole experts per rank under EP.
WIDE_HEADS = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
              "initializer_range": 0.3, "eos_token_id": 95, "bos_token_id": 0}
WIDE_CASES = {"qwen3-tp": ("dense", False), "qwen3_moe-ep": ("moe", "all_reduce"),
              "qwen3_moe-ep-a2a": ("moe", "all_to_all")}
# CPU: 4 ranks (8 processes on CI's 2 cores would take ~25 s per engine: 8 ranks run at model level on the CPU,
# tests/models/test_tensor_parallel.py). GPU (NCCL, benchmarks/run_h200x8.sh): 4 and 8 ranks where there are as
# many GPUs.
WIDE_RANKS = [("cpu", 4)] + [pytest.param("cuda", n, id=f"cuda-{n}", marks=pytest.mark.skipif(
    torch.cuda.device_count() < n, reason=f"needs {n} GPUs")) for n in (4, 8)]


@pytest.fixture(scope="module")
def wide_head_checkpoints(tmp_path_factory):
    from transformers import (
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from tests.engine.conftest import _save

    dense = Qwen3Config(**WIDE_HEADS, tie_word_embeddings=True)
    moe = Qwen3MoeConfig(**WIDE_HEADS, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                         norm_topk_prob=True, tie_word_embeddings=False)
    return {"dense": _save(tmp_path_factory, "qwen3_wide", Qwen3ForCausalLM, dense)[0],
            "moe": _save(tmp_path_factory, "qwen3_moe_wide", Qwen3MoeForCausalLM, moe)[0]}


@pytest.mark.parametrize("device, ranks", WIDE_RANKS)
@pytest.mark.parametrize("case", list(WIDE_CASES))
def test_four_and_eight_ranks_give_the_greedy_tokens_of_one_rank(wide_head_checkpoints, case, device, ranks,
                                                                 monkeypatch):
    """A 4-rank engine (three worker processes; on GPUs also 8). Few tokens, one prefill step: chunking,
    preemption and the rest are the 2-rank tests' (the same code for any N). Measured on 2 shared cores:
    4 - 6 s each (8 - 14 s with other work on the cores), most of it the workers' start."""
    kind, expert_parallel = WIDE_CASES[case]
    folder = wide_head_checkpoints[kind]
    prompts = _prompts(96, lengths=(7, 1, 13))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    children = _live_children()
    with _backend(device, monkeypatch):
        want = _generate(Engine.from_pretrained(folder, device=device, dtype=torch.float32), prompts, params)
        with Engine.from_pretrained(folder, device=device, dtype=torch.float32, tensor_parallel_size=ranks,
                                    expert_parallel=expert_parallel, step_timeout=60) as engine:
            parallel = engine.model.parallel
            assert (parallel.tp_size, parallel.tp_rank, parallel.ep_comm if expert_parallel else None) == (
                ranks, 0, expert_parallel or None)
            got = _generate(engine, prompts, params)
            pids = _worker_pids(engine)
    assert len(pids) == ranks - 1
    assert got == want
    assert _live_children() <= children and not any(map(_pid_exists, pids))
