"""The activation headroom the engine reserves before sizing the KV pool on a GPU
(``step_activation_bytes``): on a GPU it must bound the memory one step actually takes, measured;
on the CPU, properties any such bound has (none of them a copy of its formula).
"""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_core import ops
from atom_core.cache import build_step_layout
from atom_core.engine.kv_pool import step_activation_bytes
from atom_core.engine.runner import forward_logits
from atom_core.models.config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
CONFIG_NAMES = ["qwen3-0.6b", "llama-3-8b", "qwen3-30b-a3b"]


def config_dict(name: str, **overrides) -> dict:
    return {**json.loads((CONFIGS / f"{name}.json").read_text()), **overrides}


def config(name: str, **overrides) -> ModelConfig:
    return ModelConfig.from_dict(config_dict(name, **overrides))


def without_experts(name: str, **overrides) -> ModelConfig:
    """The config's dense twin: the same sizes with no expert routing (num_experts_per_tok null: an absent key
    would take the model type's default)."""
    return ModelConfig.from_dict(config_dict(name, **overrides, num_experts_per_tok=None))


# ---- properties, on the CPU ----------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(CONFIG_NAMES), tokens=st.integers(0, 65536), rows=st.integers(0, 1024))
def test_bound_grows_with_tokens_and_with_rows(name, tokens, rows):
    cfg = config(name)
    here = step_activation_bytes(cfg, tokens, rows)
    assert step_activation_bytes(cfg, tokens + 1, rows) > here
    assert step_activation_bytes(cfg, tokens, rows + 1) > here


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(CONFIG_NAMES), tokens=st.integers(0, 65536), rows=st.integers(0, 1024))
def test_bound_covers_the_fp32_logits_and_one_fp32_hidden_state_per_token(name, tokens, rows):
    # What a step surely holds at once: compute_logits' fp32 [rows, V] and the residual stream [tokens, E].
    cfg = config(name)
    assert step_activation_bytes(cfg, tokens, rows) >= 4 * (rows * cfg.vocab_size + tokens * cfg.hidden_size)


@pytest.mark.parametrize("overrides", [
    {},                                                                     # Qwen3-30B-A3B: 8 experts of 768
    {"intermediate_size": 10944, "moe_intermediate_size": 1408, "hidden_size": 4096},  # GLM-4.5-Air-like
], ids=["qwen3-30b-a3b", "glm-4.5-air-like"])
def test_many_expert_configs_reserve_more_than_their_dense_twin(overrides):
    # Eight small experts per token hold more than one dense MLP of intermediate_size: a bound
    # that counted only the dense MLP would be too small for these models.
    moe = config("qwen3-30b-a3b", **overrides)
    dense = without_experts("qwen3-30b-a3b", **overrides)
    for tokens in (1, 64, 8192):
        assert step_activation_bytes(moe, tokens, 1) > step_activation_bytes(dense, tokens, 1)


# ---- measured, on a GPU -----------------------------------------------------------------------------

def prepare_step(model, num_tokens: int, num_rows: int, device) -> dict:
    """Bind a KV pool and build the inputs of one engine-like step of ``num_tokens`` tokens in
    ``num_rows`` rows (``num_rows - 1`` decode rows with 32 cached tokens, one prefill row with the
    rest); returns the keyword arguments of :func:`run_step`."""
    block_size = 16
    query_lens = [1] * (num_rows - 1) + [num_tokens - (num_rows - 1)]
    cached_lens = [32] * (num_rows - 1) + [0]
    tables, next_block = [], 0
    for q, c in zip(query_lens, cached_lens):
        pages = -(-(q + c) // block_size)
        tables.append(list(range(next_block, next_block + pages)))
        next_block += pages
    spec = model.kv_cache_spec()
    shape = (next_block, block_size, spec.num_kv_heads, spec.head_dim)
    model.bind_kv_cache([(torch.zeros(shape, dtype=spec.dtype, device=device),
                          torch.zeros(shape, dtype=spec.dtype, device=device)) for _ in range(spec.num_layers)])
    input_ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    rows = torch.ones(num_rows, device=device)
    # Every filter on, and log-probs: the sampler's largest temporaries.
    sampling = dict(temperature=0.7 * rows, top_k=(50 * rows).int(), top_p=0.9 * rows, min_p=0.05 * rows,
                    seeds=torch.arange(num_rows, device=device),
                    offsets=torch.zeros(num_rows, dtype=torch.int64, device=device))
    return dict(input_ids=input_ids.to(device), layout=build_step_layout(query_lens, cached_lens, tables,
                                                                         block_size).to(device), sampling=sampling)


def run_step(model, input_ids, layout, sampling) -> None:
    """The step: forward, fp32 logits of each row's last token, ``ops.sample`` with log-probs."""
    with torch.inference_mode():
        logits = forward_logits(model, input_ids, layout)
        ops.sample(logits, **sampling, return_logprobs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, overrides", [
    ("qwen3-0.6b", {}),
    ("llama-3-8b", {"num_hidden_layers": 2}),       # activations are per layer: two layers show the peak
    ("qwen3-30b-a3b", {"num_hidden_layers": 2}),
], ids=["qwen3-0.6b", "llama-3-8b-2-layers", "qwen3-30b-a3b-2-layers"])
@pytest.mark.parametrize("num_rows", [1, 256])
def test_bound_covers_the_measured_peak_of_a_full_step(name, overrides, num_rows):
    """At the engine's defaults (8192 batched tokens, up to 256 rows), bf16 dummy weights: the peak
    CUDA allocation of one step above what the model, KV pool and inputs already hold is at most
    the reserved headroom. Measured on the second step: the first compiles the kernels."""
    from atom_core.models import build_model

    num_tokens, device = 8192, torch.device("cuda")
    model = build_model(config_dict(name, **overrides), dtype=torch.bfloat16, device=device)
    step = None
    try:
        step = prepare_step(model, num_tokens, num_rows, device)
        run_step(model, **step)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_step(model, **step)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - held
        bound = step_activation_bytes(model.config, num_tokens, num_rows)
        assert peak <= bound, f"a step took {peak / 2**20:.0f} MiB, the engine reserves {bound / 2**20:.0f} MiB"
    finally:
        model = step = None  # the model and its pool go before the next case builds its own
        torch.cuda.empty_cache()


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(["deepseek-v3", "deepseek-v2-lite"]), tokens=st.integers(1, 65536))
def test_mla_bound_covers_the_expanded_forms_k_and_v_at_its_slot_limit(name, tokens):
    # MLA's expanded form allocates K and V of [slots, H, max(Dn + R, Dv)] each (ops/triton/mla_prefill.py),
    # with at most EXPANDED_MAX_SLOTS_PER_TOKEN slots per query token (layers/mla.py's auto rule).
    from atom_core.models.layers.mla import EXPANDED_MAX_SLOTS_PER_TOKEN

    cfg = config(name)
    head_dim = max(cfg.get("qk_nope_head_dim") + cfg.get("qk_rope_head_dim"), cfg.get("v_head_dim"))
    k_and_v = 4 * 2 * EXPANDED_MAX_SLOTS_PER_TOKEN * tokens * cfg.num_attention_heads * head_dim
    assert step_activation_bytes(cfg, tokens, 1) - step_activation_bytes(cfg.__class__.from_dict(
        {k: v for k, v in config_dict(name).items() if k != "kv_lora_rank"}), tokens, 1) >= k_and_v
