"""``load_named_tensors``: (checkpoint name, tensor) pairs in memory go where the same tensors read from the
checkpoint's files go, in place; what it refuses, by name. (Through an engine: tests/engine/test_weight_update.py.)"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import atom_core
from atom_core.models import build_model, load_model, load_named_tensors

DEMO = Path(atom_core.__file__).parent / "demo_model"


def _demo_tensors() -> dict[str, torch.Tensor]:
    return load_file(DEMO / "model.safetensors")


def test_named_tensors_of_a_checkpoint_fill_a_model_exactly_as_loading_its_folder():
    want = load_model(DEMO, device="cpu", dtype=torch.float32)
    model = load_model(DEMO, device="cpu", dtype=torch.float32, load_format="zeros")
    report = load_named_tensors(model, _demo_tensors().items(), strict=True)
    assert report.missing == [] and report.unused == [] and report.files_read == []
    for (name, got), (_, expected) in zip(model.named_parameters(), want.named_parameters()):
        assert torch.equal(got, expected), name


def test_named_tensors_are_copied_into_the_existing_parameters():
    model = load_model(DEMO, device="cpu", dtype=torch.float32, load_format="zeros")
    before = {name: (param, param.data_ptr()) for name, param in model.named_parameters()}
    load_named_tensors(model, _demo_tensors().items())
    for name, param in model.named_parameters():
        assert before[name][0] is param and before[name][1] == param.data_ptr(), name


def test_a_model_built_from_a_quantized_checkpoint_is_refused_naming_why():
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": 64, "max_position_embeddings": 64,
              "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "weight_block_size": [128, 128]}}
    model = build_model(config, device="cpu", dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="built from a quantized checkpoint"):
        load_named_tensors(model, [("model.norm.weight", torch.ones(128))])


def test_something_other_than_name_tensor_pairs_is_refused_naming_what_it_got():
    model = load_model(DEMO, device="cpu", dtype=torch.float32, load_format="zeros")
    with pytest.raises(TypeError, match=r"\(name, tensor\) pairs, got a tuple of 2: \(str, list\)"):
        load_named_tensors(model, [("model.norm.weight", [1.0])])


def test_a_nan_is_refused_naming_the_tensor_unless_check_finite_is_off():
    model = load_model(DEMO, device="cpu", dtype=torch.float32, load_format="zeros")
    norm = dict(model.named_parameters())["model.norm.weight"]
    bad = torch.ones_like(norm)
    bad[3] = float("nan")
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' given to load_named_tensors: 1 of"):
        load_named_tensors(model, [("model.norm.weight", bad)])
    load_named_tensors(model, [("model.norm.weight", bad)], check_finite=False)
    assert norm.isnan().sum() == 1


def test_kv_cache_scales_and_rotary_caches_are_skipped_with_a_reason():
    model = load_model(DEMO, device="cpu", dtype=torch.float32, load_format="zeros")
    report = load_named_tensors(model, [("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
                                        ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4))], strict=True)
    assert set(report.skipped) == {"model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.rotary_emb.inv_freq"}
    assert "KV-cache scale" in report.skipped["model.layers.0.self_attn.k_scale"]


_BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             max_position_embeddings=64)
_MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=24, num_local_experts=4,
                                                             num_experts_per_tok=2)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(intermediate_size=24, moe_intermediate_size=8,
                                                              n_routed_experts=4, num_experts_per_tok=2,
                                                              first_k_dense_replace=1, n_group=1, topk_group=1,
                                                              head_dim=16)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=24, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8)),
}


@pytest.mark.parametrize("family", list(_MOE))
def test_an_in_memory_moe_state_dict_with_stacked_experts_fills_the_model_as_its_saved_checkpoint(family, tmp_path):
    # transformers 5 keeps the experts stacked in memory (experts.gate_up_proj / down_proj) and writes one
    # tensor per expert to its files: both must fill the same parameters.
    transformers = pytest.importorskip("transformers")
    config_name, model_name, extra = _MOE[family]
    torch.manual_seed(0)
    hf = getattr(transformers, model_name)(getattr(transformers, config_name)(**_BASE, **extra))
    state = hf.state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state), "not the stacked in-memory layout"
    hf.save_pretrained(tmp_path)
    want = load_model(tmp_path, device="cpu", dtype=torch.float32)
    model = load_model(tmp_path, device="cpu", dtype=torch.float32, load_format="zeros")
    report = load_named_tensors(model, state.items(), strict=True)
    assert report.missing == []
    for (name, got), (_, expected) in zip(model.named_parameters(), want.named_parameters()):
        assert torch.equal(got, expected), name


class _Derived(torch.nn.Module):
    """A parameter and a buffer its process_weights_after_loading derives anew each time (a new tensor)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        self.register_buffer("doubled", None, persistent=False)

    def process_weights_after_loading(self):
        self.doubled = self.weight.data * 2


def test_a_buffer_derived_after_loading_keeps_its_tensor_and_address_and_gets_the_new_values():
    model = _Derived()
    model.process_weights_after_loading()  # (as load_model does once)
    buffer, address = model.doubled, model.doubled.data_ptr()
    load_named_tensors(model, [("weight", torch.tensor([1.0, 2.0, 3.0]))], strict=True)
    assert model.doubled is buffer and buffer.data_ptr() == address
    assert buffer.tolist() == [2.0, 4.0, 6.0]


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "base_model.model.", "module._orig_mod."])
def test_names_under_a_training_wrappers_prefix_load_nothing_and_raise_naming_the_prefix(prefix):
    model = load_model(DEMO, device="cpu", dtype=torch.float32, load_format="zeros")
    wrapped = [(prefix + name, tensor) for name, tensor in _demo_tensors().items()]
    with pytest.raises(ValueError, match=rf"none of the tensors matches.*without its {prefix!r} prefix"):
        load_named_tensors(model, wrapped)
    assert all(not param.any() for param in model.parameters())  # nothing was loaded
    with pytest.raises(ValueError, match=rf"strict=True.*without its {prefix!r} prefix"):
        load_named_tensors(model, wrapped, strict=True)


def test_some_unknown_names_beside_known_ones_are_listed_as_unused_not_refused():
    model = load_model(DEMO, device="cpu", dtype=torch.float32, load_format="zeros")
    report = load_named_tensors(model, [("model.norm.weight", torch.ones(model.config.hidden_size)),
                                        ("no.such.tensor", torch.ones(3))])
    assert report.unused == ["no.such.tensor"] and bool(model.model.norm.weight.eq(1).all())
