"""Bad input is refused at the API edge, naming the problem, and nothing is queued or leaked; a
step that raises finishes its requests with reason "error" and the engine keeps working."""

import dataclasses

import numpy as np
import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_qwen3):
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        yield Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4)


def assert_idle_and_clean(engine):
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.batch.num_rows == 0


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 1e300), ("temperature", -0.5),
    ("temperature", True), ("temperature", "0.5"), ("top_k", 2.0), ("top_k", -2), ("top_k", True),
    ("top_p", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("min_p", float("nan")), ("min_p", -0.1),
    ("max_tokens", 0), ("max_tokens", 3.0), ("max_tokens", True), ("seed", 2**64), ("seed", -2), ("seed", 1.0),
    ("seed", True), ("logprobs", -2), ("logprobs", True), ("stop", [""]), ("stop", 5), ("stop_token_ids", [-1]),
    ("stop_token_ids", [True]), ("stop_token_ids", 7), ("ignore_eos", "yes"),
])
def test_sampling_params_refuse_values_a_step_could_not_run(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_extreme_valid_params_run(engine):
    params = [SamplingParams(seed=2**64 - 1, max_tokens=4, ignore_eos=True),
              SamplingParams(top_k=2**40, temperature=3e38, max_tokens=4, ignore_eos=True),
              SamplingParams(top_k=np.int64(3), seed=np.uint64(2**63 + 5), max_tokens=4, ignore_eos=True)]
    with ops.use_backend("torch"):
        outs = engine.generate([[1, 2, 3]] * 3, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [4, 4, 4]
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("prompt", [np.array([True, False]), [True, 2], [1.0, 2.0], np.array([1.5, 2.0]),
                                    np.array([[1, 2]]), [[1, 2]], torch.tensor([1.0]), {1, 2}, 7, None, b"ab"])
def test_prompts_of_other_kinds_are_refused_by_name(engine, prompt):
    with pytest.raises(TypeError, match="prompt"):
        engine.add_request(prompt)
    assert_idle_and_clean(engine)


def test_numpy_and_tensor_token_ids_are_prompts(engine):
    ids = [5, 6, 7, 8]
    with ops.use_backend("torch"):
        want = engine.generate([ids], GREEDY, use_tqdm=False)[0].token_ids
        for prompt in (np.array(ids), np.array(ids, dtype=np.int32), [np.int64(t) for t in ids], torch.tensor(ids),
                       tuple(ids)):
            assert engine.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == want
        assert engine.generate(np.array(ids), GREEDY, use_tqdm=False)[0].token_ids == want  # one bare prompt


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_as_vllm(engine):
    """``truncate_prompt_tokens=k`` runs the prompt's last k tokens (-1: the last max_model_len), the same tokens
    as a prompt of those k; a prompt too long for max_model_len runs once cut to fit."""
    prompt = list(range(5, 25))
    with ops.use_backend("torch"):
        cut = engine.generate([prompt], dataclasses.replace(GREEDY, truncate_prompt_tokens=7), use_tqdm=False)[0]
        plain = engine.generate([prompt[-7:]], GREEDY, use_tqdm=False)[0]
        assert cut.prompt_token_ids == prompt[-7:] and cut.token_ids == plain.token_ids
        long = [5 + i % 80 for i in range(engine.max_model_len + 10)]
        with pytest.raises(ValueError, match="leaves no room for output"):
            engine.generate([long], GREEDY, use_tqdm=False)
        keep = engine.max_model_len - GREEDY.max_tokens
        fitted = engine.generate([long], dataclasses.replace(GREEDY, truncate_prompt_tokens=keep), use_tqdm=False)[0]
    assert fitted.prompt_token_ids == long[-keep:] and len(fitted.token_ids) == GREEDY.max_tokens
    assert engine.get_tokenizer() is engine.tokenizer
    assert_idle_and_clean(engine)


def test_a_bare_string_is_one_prompt():
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(device="cpu", dtype=torch.float32)  # the demo model has a tokenizer
        outs = engine.generate("Return the number of", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(outs) == 1


def test_generate_checks_every_prompt_before_queueing_any(engine):
    with pytest.raises(ValueError, match="prompt 2: prompt token ids must be in"):
        engine.generate([[1, 2], [3], [1, 10**6], [4]], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="prompt 1: "):
        engine.generate([[1, 2], [True]], GREEDY, use_tqdm=False)
    assert_idle_and_clean(engine)


def test_generate_refuses_while_added_requests_are_unfinished(engine):
    rid = engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="1 requests added with add_request are unfinished"):
        engine.generate([[4, 5]], GREEDY, use_tqdm=False)
    with ops.use_backend("torch"):
        done = []
        while engine.has_unfinished_requests():
            done += [o.request_id for o in engine.step() if o.finished]
        assert done == [rid]  # its output was not consumed by anyone else
        assert len(engine.generate([[4, 5]], GREEDY, use_tqdm=False)) == 1


@pytest.mark.parametrize("max_model_len", [0, -1, 1.5, True, "64"])
def test_max_model_len_must_be_a_positive_int(tiny_qwen3, max_model_len):
    folder, _ = tiny_qwen3
    with pytest.raises(ValueError, match="max_model_len must be None"):
        Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, max_model_len=max_model_len)


@pytest.mark.parametrize("utilization", [0.0, 1.5, -0.1, True, "0.9"])
def test_gpu_memory_utilization_outside_0_1_is_refused_on_every_device(tiny_qwen3, utilization):
    folder, _ = tiny_qwen3
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in"):
        Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, gpu_memory_utilization=utilization)


def test_abort_takes_an_id_or_an_iterable_of_ids_and_refuses_a_string(tiny_qwen3):
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
        ids = [engine.add_request([1, 2, 3], GREEDY) for _ in range(3)]
        with pytest.raises(TypeError, match="request_id must be an int that add_request returned"):
            engine.abort(str(ids[0]))
        assert all(engine.is_unfinished(i) for i in ids)
        engine.abort(ids[:2])
        assert [engine.is_unfinished(i) for i in ids] == [False, False, True]
        engine.abort(np.int64(ids[2]))
        engine.abort(ids)  # finished ids: ignored
        assert not engine.has_unfinished_requests()
    assert_idle_and_clean(engine)


def test_a_device_this_machine_cannot_use_is_refused_by_name(tiny_qwen3):
    folder, _ = tiny_qwen3
    with pytest.raises(ValueError, match="device 'mps:0': the engine runs on 'cuda' or 'cpu'"):
        Engine.from_pretrained(folder, device="mps:0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda': this machine has no usable CUDA"):
            Engine.from_pretrained(folder, device="cuda")


class RaisesOnCall:
    """Wraps a model; its forward raises on the ``fail_at``-th call (counting from 1)."""

    def __init__(self, model, fail_at):
        self.model, self.fail_at, self.calls = model, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return type(self.model).forward(self.model, *args, **kwargs)  # (self.model.forward is this wrapper)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_step_that_raises_finishes_its_requests_names_them_and_the_engine_keeps_working(
        tiny_qwen3, async_scheduling, fail_at):
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4,
                                        async_scheduling=async_scheduling)
        want = engine.generate([[9, 8, 7]], GREEDY, use_tqdm=False)[0].token_ids
        ids = [engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in ([1, 2, 3], [4, 5])]
        engine.model.forward = RaisesOnCall(engine.model, fail_at)
        with pytest.raises(RuntimeError, match="injected failure"):
            while engine.has_unfinished_requests():
                engine.step()
        del engine.model.forward  # the model's own forward again
        assert_idle_and_clean(engine)
        assert engine.failed_request_ids == sorted(ids)  # both were in the step that raised
        for rid in ids:
            engine.abort(rid)  # finished ids are ignored
        assert engine.generate([[9, 8, 7]], GREEDY, use_tqdm=False)[0].token_ids == want
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_finishes_every_sequence_of_an_n_request_even_those_it_did_not_run(tiny_qwen3,
                                                                                        async_scheduling):
    """Sequences 1.. wait for sequence 0's prompt; the step that fails runs only sequence 0. They used to run on
    after the request was reported failed, with prompt_logprobs never filled."""
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4,
                                        async_scheduling=async_scheduling)
        rid = engine.add_request([1, 2, 3, 4, 5], SamplingParams(n=3, seed=0, max_tokens=4, prompt_logprobs=1))
        engine.model.forward = RaisesOnCall(engine.model, 1)
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.step()
        del engine.model.forward
        assert engine.failed_request_ids == [rid] and not engine.has_unfinished_requests()
        assert len(engine.step()) == 0
    assert_idle_and_clean(engine)


def _qwen3_06b_shapes_model():
    import json
    from pathlib import Path

    from atom_core.models import build_model

    cfg = json.loads((Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-0.6b.json").read_text())
    # The real attention shapes, few layers and a small vocabulary (its special ids within it): cheap to build.
    cfg |= {"num_hidden_layers": 2, "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 1}
    return build_model(cfg, dtype=torch.float32, device="cpu")


def test_on_cpu_max_model_len_is_capped_and_the_pool_fits_the_memory_available(monkeypatch, caplog):
    from atom_core.engine import engine as engine_module
    from atom_core.engine import kv_pool

    model = _qwen3_06b_shapes_model()
    assert model.config.max_position_embeddings == 40960
    monkeypatch.setattr(kv_pool, "host_memory_available_bytes", lambda: 8 << 30)
    with caplog.at_level("WARNING"):
        engine = Engine(model, device="cpu", warmup=False)
    assert engine.max_model_len == engine_module.CPU_MAX_MODEL_LEN and "max_model_len set to 4096 on CPU" in caplog.text
    pool_bytes = engine.runner.kv_pool.numel() * engine.runner.kv_pool.element_size()
    assert pool_bytes <= kv_pool.CPU_POOL_MEMORY_SHARE * (8 << 30)
    explicit = Engine(model, device="cpu", max_model_len=8192, warmup=False)  # asked for: not capped
    assert explicit.max_model_len == 8192


def test_on_cpu_a_pool_that_cannot_hold_one_request_in_the_memory_available_is_refused_with_the_numbers(
        monkeypatch):
    from atom_core.engine import kv_pool

    model = _qwen3_06b_shapes_model()
    monkeypatch.setattr(kv_pool, "host_memory_available_bytes", lambda: 1 << 20)  # 1 MiB: 256 KiB for the pool
    with pytest.raises(ValueError, match="smallest budget that works"):
        Engine(model, device="cpu", max_model_len=256, warmup=False)


def test_an_explicit_pool_larger_than_the_memory_available_is_refused_before_allocating(monkeypatch):
    from atom_core.engine import kv_pool
    from atom_core.models import InsufficientMemoryError

    model = _qwen3_06b_shapes_model()
    monkeypatch.setattr(kv_pool, "host_memory_available_bytes", lambda: 1 << 30)
    with pytest.raises(InsufficientMemoryError, match="a KV pool of num_kv_blocks=100000 needs an estimated"):
        Engine(model, device="cpu", max_model_len=256, num_kv_blocks=100_000, warmup=False)


def test_a_gpu_pool_is_sized_with_a_dropped_engines_cached_memory_counted_as_free(cuda_caching_dropped_tensors):
    from atom_core.engine import kv_pool

    model = _qwen3_06b_shapes_model()
    sizing = dict(block_size=16, num_kv_blocks=None, gpu_memory_utilization=0.9, max_num_seqs=8,
                  max_num_batched_tokens=256, max_model_len=1024, kv_cache_dtype="auto")
    cuda_caching_dropped_tensors(cached=0)
    fresh = kv_pool.plan_pool(model, torch.device("cuda:0"), **sizing)[2].num_blocks
    cuda_caching_dropped_tensors(cached=70 << 30)
    assert kv_pool.plan_pool(model, torch.device("cuda:0"), **sizing)[2].num_blocks == fresh
    cuda_caching_dropped_tensors(cached=70 << 30)  # and an explicit pool is not refused
    assert kv_pool.plan_pool(model, torch.device("cuda:0"), **sizing | {"num_kv_blocks": fresh})[2].num_blocks == fresh


def test_a_gpu_pool_takes_its_share_whatever_a_trainer_beside_it_holds_and_refuses_a_share_not_free(monkeypatch):
    """vLLM V1's gpu_memory_utilization: the engine's own share of the device (TRL's colocated layout: a trainer
    holds memory in the same process or another). No GPU is needed (mem_get_info is replaced)."""
    from atom_core.engine import kv_pool

    model = _qwen3_06b_shapes_model()
    sizing = dict(block_size=16, num_kv_blocks=None, gpu_memory_utilization=0.3, max_num_seqs=8,
                  max_num_batched_tokens=256, max_model_len=1024, kv_cache_dtype="auto")
    total = 80 << 30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def blocks(trainer_bytes: int) -> int:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - trainer_bytes, total))
        return kv_pool.plan_pool(model, torch.device("cuda:0"), **sizing)[2].num_blocks

    assert blocks(30 << 30) == blocks(0) > 0
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.3 gives this engine 24.00 GiB.*only 20.00 GiB "
                                         "are free"):
        blocks(60 << 30)


def test_a_launch_that_raises_while_a_step_is_in_flight_publishes_nothing_it_did_not_read(tiny_qwen3):
    """Found by test_hostile_inputs: with a 1-token prompt, the third launch raising (the second still
    in flight, its token unread) made the error path publish more tokens than the request held."""
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=2)
        engine.add_request([1], SamplingParams(max_tokens=20, ignore_eos=True))
        engine.model.forward = RaisesOnCall(engine.model, 3)
        with pytest.raises(RuntimeError, match="injected failure"):
            while engine.has_unfinished_requests():
                engine.step()
        del engine.model.forward
    assert_idle_and_clean(engine)
    assert engine.block_manager.num_cached_blocks == 0  # nothing of the failed request was published


def test_warmups_sampling_part_runs_the_sampler_and_every_logits_processing_op(engine):
    # What a request can launch after warm-up must have run (and so compiled) in it: on a GPU the first
    # structured-output request would otherwise compile the mask kernel inside a served step. (On the CPU
    # warmup() returns at once: its sampling part is called directly.)
    with ops.trace_backends() as calls, torch.inference_mode():
        engine._warm_sampling()
    assert {"sample", "apply_penalties_", "apply_token_bias_", "apply_token_mask_"} <= {op for op, _ in calls}


def test_an_engine_seed_repeats_the_draws_of_unseeded_requests():
    """Two engines of the same seed give unseeded sampled requests the same tokens; another seed other tokens
    (16 tokens drawn at temperature 1 from 2,048: the same by chance has probability far below 1e-9)."""
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    prompts = ["Return the number of", "If the file"]

    def run(seed):
        with ops.use_backend("torch"):
            engine = Engine.from_pretrained(None, device="cpu", dtype=torch.float32, seed=seed)
            return [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]

    first = run(7)
    assert run(7) == first
    assert run(8) != first
    with pytest.raises(TypeError, match="seed must be an int"):
        Engine.from_pretrained(None, device="cpu", seed="7")


def test_max_tokens_none_generates_up_to_max_model_len(tiny_qwen3):
    """vLLM's max_tokens=None: the output runs until prompt + output fill max_model_len ("length")."""
    folder, _ = tiny_qwen3
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, block_size=4, max_model_len=24)
        params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        outs = engine.generate([[1, 2, 3], list(range(1, 21))], params, use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [21, 4] and {o.finish_reason for o in outs} == {"length"}
        rid = engine.add_request([1, 2, 3, 4, 5], params)
        assert engine._requests[rid][0].params.max_tokens == 19 and params.max_tokens is None
        engine.abort(rid)
        with pytest.raises(ValueError, match="prompt of 24 tokens leaves no room for output under max_model_len=24"):
            engine.add_request(list(range(1, 25)), params)
        # min_tokens past the room cannot be met: capped with max_tokens (vLLM stops at max_model_len)
        rid = engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=None, min_tokens=10))
        capped = engine._requests[rid][0].params
        assert (capped.max_tokens, capped.min_tokens) == (4, 4)
        engine.abort(rid)
