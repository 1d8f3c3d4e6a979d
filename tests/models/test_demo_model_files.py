"""The demo model shipped in ``atom_core/demo_model/``: files, config, weights and tokenizer agree.

Expected tensor names and shapes are derived here from the config fields by the Qwen3 layout
(q/k/v/o projections, per-head q/k RMSNorm, gated MLP, tied output projection), not read back
from the weights file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import Tokenizer

import atom_core

DEMO_DIR = Path(atom_core.__file__).resolve().parent / "demo_model"
EOS_TOKEN = "<|endoftext|>"
MAX_TOTAL_BYTES = 6 * 1024 * 1024

ROUND_TRIP_TEXTS = [
    "Return the number of items in the list.",
    "  leading spaces,\ttabs\nand\n\nblank lines  ",
    "def f(x: int) -> dict[str, int]:\n    return {'x': x ** 2}  # squared",
    "naïve café, Grüße, 東京, emoji 🙂, math ∑ ≤ ∞",
    "",
]


def _config() -> dict:
    return json.loads((DEMO_DIR / "config.json").read_text())


def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Qwen3 checkpoint with tied embeddings (no ``lm_head.weight``)."""
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_out = cfg["num_attention_heads"] * head_dim
    kv_out = cfg["num_key_value_heads"] * head_dim
    shapes = {
        "model.embed_tokens.weight": (cfg["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    return shapes


def test_shipped_files_exist_and_fit_the_size_budget():
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (DEMO_DIR / name).is_file(), f"missing {DEMO_DIR / name}"
    total = sum(p.stat().st_size for p in DEMO_DIR.iterdir() if p.is_file())
    assert total <= MAX_TOTAL_BYTES, f"demo model is {total:,} bytes, budget {MAX_TOTAL_BYTES:,}"


def test_config_is_a_tied_gqa_qwen3_config():
    cfg = _config()
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["tie_word_embeddings"] is True
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # grouped-query attention
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert cfg["max_position_embeddings"] >= 128
    for key in ("bos_token_id", "eos_token_id"):
        assert isinstance(cfg[key], int) and 0 <= cfg[key] < cfg["vocab_size"], key


def test_generation_config_uses_the_same_eos():
    cfg = _config()
    gen = json.loads((DEMO_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    assert gen["bos_token_id"] == cfg["bos_token_id"]


def test_weight_names_shapes_and_dtype_follow_the_config():
    cfg = _config()
    expected = _expected_shapes(cfg)
    with safe_open(str(DEMO_DIR / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(expected), (
            f"unexpected {sorted(names - set(expected))}, missing {sorted(set(expected) - names)}")
        for name in sorted(names):
            tensor = f.get_tensor(name)
            assert tuple(tensor.shape) == expected[name], name
            assert tensor.dtype == torch.bfloat16, name
            assert torch.isfinite(tensor.float()).all(), name


def test_tokenizer_vocab_and_special_tokens_match_the_config():
    cfg = _config()
    tok = _tokenizer()
    assert tok.get_vocab_size() == cfg["vocab_size"]
    eos_id = tok.token_to_id(EOS_TOKEN)
    assert eos_id == cfg["eos_token_id"] == cfg["bos_token_id"]
    tok_cfg = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == tok_cfg["bos_token"] == EOS_TOKEN
    # The special token is one id, not spelled out in bytes.
    assert tok.encode(f"a{EOS_TOKEN}b").ids.count(eos_id) == 1


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(text):
    tok = _tokenizer()
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=60))
def test_tokenizer_round_trips_any_text(text):
    tok = _tokenizer()
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_tokenizer_packs_english_into_whole_word_tokens():
    # A trained BPE of this size holds the commonest docstring words as single tokens
    # (" the" with its leading space); an untrained byte-level tokenizer would need one token
    # per byte, i.e. len(text) tokens.
    tok = _tokenizer()
    text = "Return the number of items in the list."
    assert len(tok.encode(text).ids) <= len(text) // 3
    assert tok.token_to_id("Ġthe") is not None


def test_model_predicts_docstring_text_far_better_than_chance():
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(DEMO_DIR), dtype=torch.float32)
    model.eval()
    cfg = _config()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = _tokenizer()
    text = ("Return a list of the words in the string, using sep as the delimiter string. "
            "If sep is not specified or is None, any whitespace string is a separator.")
    ids = torch.tensor([[cfg["bos_token_id"]] + tok.encode(text).ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()
    # A uniform guess costs ln(vocab_size) nats per token: ln(4096) = 8.32. Half of that means
    # the model puts on average e^(8.32/2) ~ 64x the uniform probability on the right token.
    assert nll < 0.5 * math.log(cfg["vocab_size"]), nll
