"""Weight updates for RL (vLLM's ``model.load_weights(pairs)`` + ``reset_prefix_cache()``): an engine loaded
from checkpoint A and given checkpoint B's ``state_dict`` generates as an engine loaded from B, keeps its
parameter objects, forgets its prefix cache, and refuses what it cannot do, by name.

A and B are tiny random HF models of one config (conftest's checkpoints are A; B is the same class with
another seed), fp32 on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from tests.engine.test_engine_parity import prompts_for

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ARGS = dict(device="cpu", dtype=torch.float32, block_size=4, max_model_len=64)
LENGTHS = (7, 1, 13, 20)


@pytest.fixture(autouse=True)
def _torch_ops():
    with ops.use_backend("torch"):
        yield


def _greedy(engine, prompts):
    return [out.token_ids for out in engine.generate(prompts, GREEDY, use_tqdm=False)]


def _fp8_aware_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1 and a.is_floating_point():  # float8: compare the bits
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("pair", ["tiny_qwen3", "tiny_llama", "tiny_qwen3_moe"], indirect=True)
def test_engine_updated_with_b_state_dict_generates_as_an_engine_loaded_from_b(pair):
    folder_a, folder_b, hf_b = pair
    prompts = prompts_for(hf_b.config.vocab_size, LENGTHS)
    engine = Engine.from_pretrained(folder_a, **ARGS)
    want_a = _greedy(engine, prompts)
    want_b = _greedy(Engine.from_pretrained(folder_b, **ARGS), prompts)
    assert want_a != want_b, "A and B must generate differently for the test to mean anything"

    report = engine.load_weights(hf_b.state_dict().items(), strict=True)
    assert report.missing == [] and report.unused == []
    assert _greedy(engine, prompts) == want_b
    fresh_b = Engine.from_pretrained(folder_b, **ARGS)
    for (name, got), (_, want) in zip(engine.model.named_parameters(), fresh_b.model.named_parameters()):
        assert torch.equal(got, want), name


def test_parameters_and_buffers_stay_the_same_objects_at_the_same_addresses(pair):
    folder_a, _, hf_b = pair
    engine = Engine.from_pretrained(folder_a, **ARGS)
    before = {name: (p, p.data_ptr()) for name, p in engine.model.named_parameters()}
    buffers = {name: b.data_ptr() for name, b in engine.model.named_buffers()}
    engine.load_weights(hf_b.state_dict().items())
    after = dict(engine.model.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, address) in before.items():
        assert after[name] is param and param.data_ptr() == address, name
    assert {name: b.data_ptr() for name, b in engine.model.named_buffers()} == buffers


def test_a_prompt_cached_before_the_update_is_not_a_prefix_hit_after_it(pair):
    folder_a, folder_b, hf_b = pair
    prompt = prompts_for(hf_b.config.vocab_size, [13])[0]
    engine = Engine.from_pretrained(folder_a, **ARGS)
    engine.generate([prompt], GREEDY, use_tqdm=False)
    assert engine.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 12  # the cache works
    engine.load_weights(hf_b.state_dict().items())
    assert engine.block_manager.num_cached_blocks == 0
    out = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == _greedy(Engine.from_pretrained(folder_b, **ARGS), [prompt])[0]


def test_reset_prefix_cache_is_refused_while_a_request_holds_blocks_and_done_once_it_finished(pair):
    folder_a, _, hf_b = pair
    prompt = prompts_for(hf_b.config.vocab_size, [13])[0]
    engine = Engine.from_pretrained(folder_a, **ARGS)
    engine.generate([prompt], GREEDY, use_tqdm=False)
    engine.add_request(prompt, GREEDY)
    engine.step()  # admitted: it holds blocks (and took 12 prompt tokens from the cache)
    assert engine.reset_prefix_cache() is False
    assert engine.block_manager.num_cached_blocks > 0  # nothing changed
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True
    assert engine.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_load_weights_refuses_while_requests_are_unfinished_naming_the_count_and_loads_nothing(pair):
    folder_a, _, hf_b = pair
    engine = Engine.from_pretrained(folder_a, **ARGS)
    for prompt in prompts_for(hf_b.config.vocab_size, [5, 6]):
        engine.add_request(prompt, GREEDY)
    before = {name: p.clone() for name, p in engine.model.named_parameters()}
    with pytest.raises(RuntimeError, match="2 requests are unfinished"):
        engine.load_weights(hf_b.state_dict().items())
    assert all(torch.equal(p, before[name]) for name, p in engine.model.named_parameters())


def test_strict_load_names_a_tensor_that_matches_no_parameter(pair):
    folder_a, _, _ = pair
    engine = Engine.from_pretrained(folder_a, **ARGS)
    unknown = "model.layers.0.mlp.not_a_projection.weight"
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.not_a_projection\.weight' matches no parameter"):
        engine.load_weights([(unknown, torch.zeros(4))], strict=True)
    norm = ("model.norm.weight", torch.ones(engine.model.config.hidden_size))
    assert engine.load_weights([norm, (unknown, torch.zeros(4))]).unused == [unknown]  # not strict: listed
    with pytest.raises(ValueError, match="none of the tensors matches"):  # ... unless nothing loads at all
        engine.load_weights([(unknown, torch.zeros(4))])


def test_a_tensor_of_the_wrong_shape_is_refused_naming_it_and_its_parameter(pair):
    folder_a, _, _ = pair
    engine = Engine.from_pretrained(folder_a, **ARGS)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.q_proj\.weight'.*"
                                         r"'model\.layers\.1\.self_attn\.qkv_proj\.weight'.*shape \(3, 5\)"):
        engine.load_weights([("model.layers.1.self_attn.q_proj.weight", torch.zeros(3, 5))])


def test_a_partial_update_of_q_proj_fills_only_the_q_rows_of_the_fused_qkv(pair):
    folder_a, folder_b, hf_b = pair
    engine = Engine.from_pretrained(folder_a, **ARGS)
    qkv = engine.model.model.layers[0].self_attn.qkv_proj.weight
    old = qkv.detach().clone()
    new_q = hf_b.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    report = engine.load_weights([("model.layers.0.self_attn.q_proj.weight", new_q)])
    rows = new_q.shape[0]
    assert torch.equal(qkv[:rows], new_q) and torch.equal(qkv[rows:], old[rows:])
    assert "model.layers.0.self_attn.qkv_proj.weight (shards ['k', 'v'] missing)" in report.missing


def test_a_generator_of_pairs_is_read_one_at_a_time(pair):
    folder_a, folder_b, hf_b = pair
    engine = Engine.from_pretrained(folder_a, **ARGS)
    state = hf_b.state_dict()
    taken = []

    def pairs():
        for name, tensor in state.items():
            taken.append(name)
            yield name, tensor.to(torch.bfloat16).float()  # made on the fly, as a gathering trainer does

    report = engine.load_weights(pairs())
    assert taken == list(state) and report.missing == []


def test_fp8_online_quantized_engine_updated_from_b_equals_an_fp8_engine_loaded_from_b(pair):
    folder_a, folder_b, hf_b = pair
    prompts = prompts_for(hf_b.config.vocab_size, LENGTHS)
    engine = Engine.from_pretrained(folder_a, quantization="fp8", **ARGS)
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn  # online-quantized indeed
    want_a = _greedy(engine, prompts)
    fresh_b = Engine.from_pretrained(folder_b, quantization="fp8", **ARGS)
    want_b = _greedy(fresh_b, prompts)
    assert want_a != want_b

    engine.load_weights(hf_b.state_dict().items(), strict=True)
    for (name, got), (_, want) in zip(engine.model.named_parameters(), fresh_b.model.named_parameters()):
        assert _fp8_aware_equal(got, want), name
    for (name, got), (_, want) in zip(engine.model.named_buffers(), fresh_b.model.named_buffers()):
        assert _fp8_aware_equal(got, want), name  # (the scales the GEMMs read, derived after loading)
    assert _greedy(engine, prompts) == want_b


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pair", ["tiny_qwen3", "tiny_qwen3_moe"], indirect=True)
def test_on_a_gpu_captured_cuda_graphs_replay_the_new_weights(pair):
    """The engine's CUDA graphs (captured at construction, Triton kernels) read the parameters where they
    are: after the update, a graph replay gives the tokens of an engine built from B."""
    folder_a, folder_b, hf_b = pair
    prompts = prompts_for(hf_b.config.vocab_size, LENGTHS)
    # (two engines in one process: a small pool each, not 90% of the GPU each)
    args = dict(device="cuda", dtype=torch.float32, block_size=16, max_model_len=64, num_kv_blocks=64)
    with ops.use_backend(None):
        engine = Engine.from_pretrained(folder_a, **args)
        assert engine.runner.graphs is not None, "the engine must run its steps as CUDA graphs here"
        want_b = _greedy(Engine.from_pretrained(folder_b, **args), prompts)
        assert _greedy(engine, prompts) != want_b
        engine.load_weights(hf_b.state_dict().items(), strict=True)
        assert _greedy(engine, prompts) == want_b
