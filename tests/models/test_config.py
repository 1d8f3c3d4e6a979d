"""ModelConfig parsing: rope spellings, defaults, eos lists, extra keys, clear errors on bad files."""

import copy
import json
import logging

import pytest
import torch

from atom_core.models.config import ModelConfig

BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=64,
            intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)

LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def parse(**overrides):
    return ModelConfig.from_dict({**BASE, **overrides})


@pytest.mark.parametrize(
    "old,new",
    [
        (dict(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING}),
         dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3_SCALING})),
        (dict(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}),  # old "type" key
         dict(rope_parameters={"type": "linear", "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})),
        (dict(rope_theta=1e6), dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        (dict(rope_theta=1e4, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
         dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "rope_theta": 1e4})),
    ],
)
def test_both_rope_spellings_normalise_alike(old, new):
    a, b = parse(**old), parse(**new)
    assert (a.rope_theta, a.rope_scaling) == (b.rope_theta, b.rope_scaling)
    assert isinstance(a.rope_theta, float)
    old_scaling = old.get("rope_scaling")
    if old_scaling is None:
        assert a.rope_scaling is None
    else:
        assert "type" not in a.rope_scaling and "rope_theta" not in a.rope_scaling
        assert a.rope_scaling["rope_type"] == old_scaling.get("rope_type", old_scaling.get("type"))


def test_rope_parameters_per_layer_type_keeps_both():
    cfg = parse(model_type="gemma3_text", rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    })
    assert cfg.rope_params("sliding_attention") == (1e4, None)
    assert cfg.rope_params("full_attention") == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})  # global = full


def test_partial_rotary_factor_moves_out_of_the_rope_dict():
    new = parse(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    old = parse(rope_theta=1e4, partial_rotary_factor=0.5)
    assert new.rope_scaling is None and old.rope_scaling is None
    assert new.partial_rotary_factor == old.partial_rotary_factor == 0.5


def test_partial_rotary_factor_in_the_rope_dict_beats_a_stale_top_level_copy():
    # transformers 5.17 saves GLM-4-MoE configs with both; its model reads the dict's value.
    cfg = parse(partial_rotary_factor=0.5,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    assert cfg.partial_rotary_factor == 0.25



def test_defaults_per_architecture():
    llama = parse()
    qwen3 = parse(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    assert llama.rope_theta == 10000.0 and qwen3.rope_theta == 10000.0  # transformers' defaults (files say 1e6)
    assert llama.num_key_value_heads == 4  # = num_attention_heads
    assert llama.head_dim == 16            # 64 hidden / 4 heads
    assert llama.tie_word_embeddings is False and llama.attention_bias is False
    assert llama.layer_types == ["full_attention"] * 3
    assert llama.sliding_window is None and llama.torch_dtype is None


def test_architecture_inferred_from_model_type_when_absent():
    d = {k: v for k, v in BASE.items() if k != "architectures"}
    assert ModelConfig.from_dict({**d, "model_type": "qwen3"}).architectures == ["Qwen3ForCausalLM"]


@pytest.mark.parametrize("eos,expected", [(2, [2]), ([1, 7], [1, 7]), (None, [])])
def test_eos_token_id_is_a_list(eos, expected):
    assert parse(eos_token_id=eos).eos_token_id == expected


@pytest.mark.parametrize("key,value,bad", [("eos_token_id", 128, 128), ("eos_token_id", [1, 500], 500),
                                           ("eos_token_id", -1, -1), ("bos_token_id", 128, 128)])
def test_special_token_id_outside_the_vocabulary_is_refused_by_name(key, value, bad):
    # BASE has vocab_size=128: ids 0..127
    with pytest.raises(ValueError, match=rf"{key} {bad} is outside the vocabulary.*vocab_size=128"):
        parse(**{key: value})
    assert parse(**{key: 127}).get(key) in (127, [127])  # the last row is inside


def test_eos_outside_the_vocabulary_in_a_file_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": [2, 151645]}))
    with pytest.raises(ValueError, match=r"config.json: eos_token_id 151645 is outside the vocabulary"):
        ModelConfig.from_file(tmp_path)


@pytest.mark.parametrize("key,value,expected", [("torch_dtype", "bfloat16", torch.bfloat16),
                                                ("dtype", "float16", torch.float16),
                                                ("torch_dtype", "torch.float32", torch.float32)])
def test_dtype_spellings(key, value, expected):
    assert parse(**{key: value}).torch_dtype == expected


def test_extra_keys_readable_as_attributes_and_copyable():
    cfg = parse(moe_intermediate_size=32, num_experts=8)
    assert cfg.extra == {"moe_intermediate_size": 32, "num_experts": 8}
    assert cfg.moe_intermediate_size == 32 and cfg.get("num_experts") == 8 and cfg.get("nothing", 5) == 5
    with pytest.raises(AttributeError, match="nothing"):
        cfg.nothing
    clone = copy.deepcopy(cfg)
    assert clone == cfg and clone.num_experts == 8


def test_sliding_window_rules():
    assert parse(sliding_window=4096, use_sliding_window=False).sliding_window is None
    assert parse(model_type="mixtral", sliding_window=16).layer_types == ["sliding_attention"] * 3
    assert parse(sliding_window=16).layer_types == ["full_attention"] * 3  # Llama has no window
    qwen2 = parse(model_type="qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1)
    assert qwen2.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    given = ["sliding_attention", "full_attention", "sliding_attention"]
    assert parse(model_type="gpt_oss", sliding_window=8, layer_types=given).layer_types == given


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"hidden_size": None}, "missing required key 'hidden_size'"),
        ({"vocab_size": "big"}, "vocab_size must be an int"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"hidden_size": 66}, "head_dim is absent"),
        ({"torch_dtype": "float13"}, "unsupported dtype 'float13'"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"rope_scaling": [1, 2]}, "rope_scaling must be a dict"),
        ({"rope_theta": "fast"}, "rope_theta must be a finite number"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ],
)
def test_bad_values_raise_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        parse(**overrides)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model config not found"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{\x00")  # not UTF-8 text (a binary file saved under that name)
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "num_hidden_layers": 0}))
    with pytest.raises(ValueError, match=r"config.json: num_hidden_layers must be an int >= 1"):
        ModelConfig.from_file(tmp_path)


def test_shipped_benchmark_config_parses():
    cfg = ModelConfig.from_file("benchmarks/configs/qwen3-0.6b.json")
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta, cfg.eos_token_id) == (8, 128, 1e6, [151645])
    assert cfg.tie_word_embeddings and cfg.torch_dtype == torch.bfloat16


# --- configs written by transformers (test-only dependency) --------------------------------

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "qwen2-sliding"])
def test_transformers_saved_config_parses(tmp_path, kind):
    small = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama3":
        hf = transformers.LlamaConfig(**small, max_position_embeddings=16384, rope_theta=5e5,
                                      rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING}, eos_token_id=[5, 6])
    elif kind == "qwen3":
        hf = transformers.Qwen3Config(**small, head_dim=16, rope_theta=1e6, tie_word_embeddings=True)
    else:
        hf = transformers.Qwen2Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    for key in small:
        assert getattr(cfg, key) == getattr(hf, key)
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.layer_types == list(getattr(hf, "layer_types", None) or ["full_attention"] * 3)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    if kind == "llama3":
        assert cfg.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
        assert cfg.eos_token_id == [5, 6]
    else:
        assert cfg.rope_scaling is None
    if kind == "qwen2-sliding":
        assert cfg.sliding_window == 8


# --- defaults and derived fields against transformers' config classes --------------------------------------------

_MINIMAL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4)
_MOE_KEYS = dict(moe_intermediate_size=16, n_routed_experts=8, num_experts=8, num_local_experts=8, kv_lora_rank=16,
                 q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_head_dim=8,
                 index_n_heads=2)
_DEFAULTED = ["max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "head_dim",
              "sliding_window"]
_DEFAULTED_EXTRA = ["n_shared_experts", "routed_scaling_factor", "first_k_dense_replace", "norm_topk_prob", "n_group",
                    "topk_group", "use_qk_norm", "num_experts_per_tok", "topk_method", "rope_interleave",
                    "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"]


def _hf_rope(hf) -> tuple[float, dict | None]:
    """(rope_theta, scaling without theta or None) of a transformers config (the full-attention entry)."""
    params = hf.rope_parameters
    if all(isinstance(v, dict) for v in params.values()):
        params = params["full_attention"]
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return params["rope_theta"], None if scaling == {"rope_type": "default"} else scaling


# Every family of config.ARCH_DEFAULTS but those HF has no config class of its own for
# (tests/models/test_every_family_is_covered.py holds this list to that).
DEFAULTS_PINNED_TO_HF = ["llama", "qwen2", "qwen3", "gemma2", "phi3", "qwen3_moe", "mixtral", "glm4_moe", "gpt_oss",
                         "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa"]


@pytest.mark.parametrize("model_type", DEFAULTS_PINNED_TO_HF)
def test_a_config_of_the_required_keys_only_takes_transformers_defaults(model_type):
    transformers = pytest.importorskip("transformers")
    d = {**_MINIMAL, **(_MOE_KEYS if model_type not in ("llama", "qwen2", "qwen3", "gemma2", "phi3") else {})}
    hf = transformers.AutoConfig.for_model(model_type, **d)
    ours = ModelConfig.from_dict({**d, "model_type": model_type})
    assert (ours.rope_theta, ours.rope_scaling) == _hf_rope(hf)
    for key in _DEFAULTED:
        want = getattr(hf, key, None)
        if key == "head_dim" and want is None:
            want = hf.hidden_size // hf.num_attention_heads
        if key == "sliding_window" and not getattr(hf, "use_sliding_window", True):
            want = None  # (Qwen: the window applies only with use_sliding_window)
        if hasattr(hf, key) or key == "head_dim":
            assert getattr(ours, key) == want, key
    for key in _DEFAULTED_EXTRA:
        if getattr(hf, key, None) is not None:
            assert ours.get(key) == getattr(hf, key), key
    if "partial_rotary_factor" in hf.rope_parameters:
        assert ours.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]
    # transformers names DSA's layers (which our config calls full attention: the indexer is the model's own
    # business) "indexed_attention" (5.25) or "deepseek_sparse_attention" (5.17)
    hf_types = getattr(hf, "layer_types", None)
    if hf_types is not None and not {"indexed_attention", "deepseek_sparse_attention"} & set(hf_types):
        assert ours.layer_types == list(hf_types)


@pytest.mark.parametrize("model_type, extra", [
    ("llama", dict(sliding_window=16)),                                  # transformers' Llama has no window
    ("qwen3", dict(use_sliding_window=True, sliding_window=16)),         # from max_window_layers' default (28)
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=16)),
    # no use_sliding_window key: transformers reads it as False, whatever the window and max_window_layers
    ("qwen2", dict(sliding_window=16, max_window_layers=2)),
    ("qwen3", dict(sliding_window=16)),
    ("qwen3_moe", dict(sliding_window=16, max_window_layers=2, **_MOE_KEYS)),
    ("mixtral", dict(sliding_window=16, **_MOE_KEYS)),                    # every layer
    ("gpt_oss", dict(sliding_window=16, **_MOE_KEYS)),                    # every other layer, from the first
    ("gemma2", dict(sliding_window=16)),                                   # every other layer, from the first
    ("gemma2", {}),                                                        # the same, with the default window
])
def test_layer_types_without_the_key_are_what_transformers_derives(model_type, extra):
    transformers = pytest.importorskip("transformers")
    d = {**_MINIMAL, "num_hidden_layers": 30, **extra}
    hf = transformers.AutoConfig.for_model(model_type, **d)
    ours = ModelConfig.from_dict({**d, "model_type": model_type})
    want = list(getattr(hf, "layer_types", None) or [])
    if not want:  # no layer_types attribute: a window applies to every layer when the config keeps one
        want = ["sliding_attention" if hf.sliding_window is not None else "full_attention"] * 30
        if model_type == "llama":
            want = ["full_attention"] * 30
    assert ours.layer_types == want


@pytest.mark.parametrize("file", [
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_theta=5e5,
         rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
    dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}, max_position_embeddings=4096),  # length: max_pos
    dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
         original_max_position_embeddings=2048),  # a top-level pretraining length wins over the dict's
    dict(rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING}, original_max_position_embeddings=512),
])
@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_models_read_it(file, model_type):
    """As the model reads them: building its rotary embedding re-reads the config's rope parameters, and then a
    top-level original_max_position_embeddings replaces the dict's (the config object alone still shows the
    dict's)."""
    transformers = pytest.importorskip("transformers")
    import importlib

    hf = transformers.AutoConfig.for_model(model_type, **_MINIMAL, **copy.deepcopy(file))  # (it edits the dicts)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    getattr(modeling, f"{'Qwen3' if model_type == 'qwen3' else 'Llama'}RotaryEmbedding")(hf)
    ours = ModelConfig.from_dict({**_MINIMAL, "model_type": model_type, **file})
    assert (ours.rope_theta, ours.rope_scaling) == _hf_rope(hf)


def test_a_family_without_known_defaults_is_warned_of_each_key_taken_from_llamas(caplog):
    """A config of a model_type not in ARCH_DEFAULTS that leaves keys out gets Llama's values: said, key by key
    (Gemma 3's hidden_act, tied head and windows on five layers of six would otherwise be lost silently)."""
    base = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "sliding_window": 4}
    with caplog.at_level(logging.WARNING, logger="atom_core.models.config"):
        ModelConfig.from_dict({**base, "model_type": "gemma3_text"})
    (record,) = caplog.records
    assert "model_type 'gemma3_text'" in record.getMessage()
    assert "layer_types=['sliding_attention', 'sliding_attention']" in record.getMessage()
    assert "hidden_act='silu'" in record.getMessage() and "tie_word_embeddings=False" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="atom_core.models.config"):
        ModelConfig.from_dict({**base, "model_type": "qwen2"})  # a known family: its defaults apply, unsaid
        ModelConfig.from_dict({**base, "model_type": "gemma3_text", "hidden_act": "gelu_pytorch_tanh",
                               "tie_word_embeddings": True, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                               "attention_bias": False, "mlp_bias": False,
                               "layer_types": ["sliding_attention", "full_attention"]})  # all written out
        # an architecture atom_core does not load: the load refuses it, so no warning about defaults first
        ModelConfig.from_dict({**base, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]})
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger="atom_core.models.config"):
        ModelConfig.from_dict({**base, "model_type": "my_llama", "architectures": ["LlamaForCausalLM"]})
    assert "model_type 'my_llama'" in caplog.text  # one it loads: warned
