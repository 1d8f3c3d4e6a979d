"""The activation headroom the engine reserves before sizing the KV pool on a GPU."""

import json
from pathlib import Path

from atom_core.engine.engine import step_activation_bytes
from atom_core.models.config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def config(name: str, **overrides) -> ModelConfig:
    return ModelConfig.from_dict({**json.loads((CONFIGS / f"{name}.json").read_text()), **overrides})


def test_dense_model_counts_hidden_mlp_and_logits():
    cfg = config("qwen3-0.6b")
    tokens, rows = 100, 3
    per_token = 8 * cfg.hidden_size + 3 * cfg.intermediate_size
    assert step_activation_bytes(cfg, tokens, rows) == 4 * (tokens * per_token + rows * cfg.vocab_size * 4)


def test_moe_counts_every_chosen_expert_when_that_is_wider():
    # GLM-4.5-Air-like: small experts, many of them per token; dense layers are wider per token
    # than one expert but narrower than the eight chosen ones with their down outputs.
    cfg = config("qwen3-30b-a3b", intermediate_size=10944, moe_intermediate_size=1408, hidden_size=4096)
    dense_only = config("qwen3-0.6b", intermediate_size=10944, hidden_size=4096, vocab_size=cfg.vocab_size)
    moe_width = cfg.num_experts_per_tok * (3 * 1408 + 4096)
    assert moe_width > 3 * 10944
    gap = step_activation_bytes(cfg, 64, 1) - step_activation_bytes(dense_only, 64, 1)
    assert gap == 4 * 64 * (moe_width - 3 * 10944)


def test_qwen3_30b_a3b_width_is_its_eight_experts():
    # 8 x (3 x 768 + 2048) = 34816 > 3 x 6144 = 18432
    cfg = config("qwen3-30b-a3b")
    per_token = 8 * cfg.hidden_size + 8 * (3 * 768 + 2048)
    assert step_activation_bytes(cfg, 10, 0) == 4 * 10 * per_token


def test_moe_without_moe_intermediate_size_uses_intermediate_size():
    # Mixtral / GPT-OSS name the expert width intermediate_size.
    cfg = config("qwen3-30b-a3b", intermediate_size=14336, moe_intermediate_size=None, num_experts_per_tok=2,
                 hidden_size=4096)
    per_token = 8 * 4096 + 2 * (3 * 14336 + 4096)
    assert step_activation_bytes(cfg, 5, 0) == 4 * 5 * per_token
