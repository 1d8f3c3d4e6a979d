"""Absurd sizes are refused by name before anything is allocated: build_model / load_model compare
estimate_model_bytes with the memory of the device, RotaryEmbedding its table with the memory left."""

import json

import pytest
import torch
from torch import nn

import atom_core.models.config as config_module
import atom_core.models.layers.rotary as rotary_module
from atom_core.models import (
    InsufficientMemoryError,
    ModelConfig,
    build_model,
    estimate_model_bytes,
    load_model,
    register_model,
)
from atom_core.models.config import available_memory_bytes
from atom_core.models.layers.rotary import RotaryEmbedding
from tests.models.test_loader import hf_tensors, write_single

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
ARCHITECTURES = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen3_tied": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True),
    "gemma2_tied_by_default": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2"),
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3"),
    "qwen3_moe_step2_mlp_only": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8,
                                     num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
                                     mlp_only_layers=[3]),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                    num_experts_per_tok=2),
    "glm4_moe_dense_first_shared": dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
                                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        first_k_dense_replace=1, n_shared_experts=1),
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_local_experts=4,
                    num_experts_per_tok=2),
    "deepseek_v2_mla_no_q_lora": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                                      kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                      n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                      n_shared_experts=1, first_k_dense_replace=1),
    "deepseek_v3_mla_q_lora": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                                   kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                   v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1),
    "deepseek_v32_dsa_indexer": dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                                     kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                     v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                     n_group=2, topk_group=1, index_n_heads=4, index_head_dim=16, index_topk=8),
    "glm_moe_dsa": dict(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa",
                        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1, index_n_heads=4, index_head_dim=16,
                        index_topk=8),
    "qwen2_qkv_bias": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
}
LLAMA = {**BASE, **ARCHITECTURES["llama"]}
GIB = 1 << 30


def model_bytes(model: nn.Module) -> int:
    """Parameters plus the rotary tables (buffers named cos_sin_cache), each shared tensor once."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tables = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith("cos_sin_cache"))
    return params + tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_estimate_is_a_lower_bound_within_3_percent_of_the_built_model(arch, dtype):
    config = ModelConfig.from_dict({**BASE, **ARCHITECTURES[arch]})
    actual = model_bytes(build_model(config, device="cpu", dtype=dtype, load_format="zeros"))
    estimate, _ = estimate_model_bytes(config, dtype)
    assert 0.97 * actual <= estimate <= actual


def test_estimate_of_one_tensor_parallel_rank_is_a_lower_bound_of_its_shard():
    config = ModelConfig.from_dict(LLAMA)
    rank = build_model(config, device="cpu", load_format="zeros", tp_rank=1, tp_size=2)
    estimate, _ = estimate_model_bytes(config, torch.float32, tp_size=2)
    assert 0.9 * model_bytes(rank) <= estimate <= model_bytes(rank)


@register_model("AtomNeverBuiltForCausalLM")
class NeverBuilt(nn.Module):
    """A model whose construction fails the test: a refusal must come before it."""

    def __init__(self, config, **kwargs):
        raise AssertionError("the model was constructed before the memory check refused it")


ABSURD = [
    (dict(vocab_size=10**12), "embedding"),
    (dict(num_hidden_layers=10**6, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
          num_key_value_heads=8, head_dim=128), "1000000 layers' attention"),
    (dict(max_position_embeddings=2**40), "rotary table"),
    (dict(num_local_experts=10**7, moe_intermediate_size=1024), "4 x 10000000 experts"),
]


@pytest.mark.parametrize("overrides,part", ABSURD)
def test_build_model_refuses_absurd_sizes_by_name_in_gib_before_constructing(overrides, part):
    config = {**LLAMA, "architectures": ["AtomNeverBuiltForCausalLM"], **overrides}
    with pytest.raises(InsufficientMemoryError) as err:
        build_model(config, device="cpu")
    msg = str(err.value)
    assert "AtomNeverBuiltForCausalLM of this config needs an estimated" in msg
    assert part in msg and "GiB of host memory available" in msg


@pytest.mark.parametrize("overrides,part", ABSURD)
def test_load_model_refuses_absurd_sizes_naming_the_config_before_reading_shards(tmp_path, overrides, part):
    folder = write_single(tmp_path / "m", hf_tensors())
    (folder / "model.safetensors").write_bytes(b"not read")  # a refusal must come before any shard is opened
    (folder / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["AtomNeverBuiltForCausalLM"],
                                                    **overrides}))
    with pytest.raises(InsufficientMemoryError, match=part) as err:
        load_model(folder, device="cpu")
    assert f"of {folder / 'config.json'} needs an estimated" in str(err.value)


def test_device_memory_is_what_a_cuda_build_is_checked_against(monkeypatch):
    # No GPU is needed: the refusal comes before anything touches the device.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB, 80 * GIB))
    assert available_memory_bytes("cuda:0") == GIB
    with pytest.raises(InsufficientMemoryError, match=r"more than the 1.00 GiB of cuda:0 memory available"):
        build_model({**LLAMA, "vocab_size": 10**7, "hidden_size": 64}, device="cuda:0", dtype="bfloat16")


def test_a_dropped_models_blocks_in_the_cuda_allocators_cache_count_as_free(cuda_caching_dropped_tensors):
    cuda_caching_dropped_tensors(cached=70 * GIB, total=80 * GIB)
    assert available_memory_bytes("cuda:0") == 80 * GIB


def test_model_that_fits_the_memory_left_is_built(monkeypatch):
    config = ModelConfig.from_dict(LLAMA)
    estimate, _ = estimate_model_bytes(config, torch.float32)
    monkeypatch.setattr(config_module, "host_memory_available_bytes", lambda: estimate)
    assert build_model(config, device="cpu") is not None
    monkeypatch.setattr(config_module, "host_memory_available_bytes", lambda: estimate - 1)
    with pytest.raises(InsufficientMemoryError):
        build_model(config, device="cpu")


def test_available_memory_is_host_memory_for_cpu_and_unknown_for_meta(monkeypatch):
    monkeypatch.setattr(config_module, "host_memory_available_bytes", lambda: 123)
    assert available_memory_bytes("cpu") == available_memory_bytes(None) == 123
    assert available_memory_bytes("meta") is None


def test_rotary_table_of_2_pow_40_positions_is_refused_naming_max_position_embeddings():
    with pytest.raises(InsufficientMemoryError) as err:
        RotaryEmbedding(128, 128, 2**40, 1e4)
    msg = str(err.value)
    assert "rotary cos/sin table of max_position_embeddings=1099511627776 x rotary_dim=128" in msg
    assert "GiB of host memory available" in msg and "lower max_position_embeddings" in msg


def test_rotary_table_is_checked_against_its_fp32_build_on_the_host(monkeypatch):
    positions, rotary_dim = 1000, 64  # build: ~10 bytes an entry = 640 000 bytes; the table 256 000
    monkeypatch.setattr(rotary_module, "host_memory_available_bytes", lambda: 600_000)
    with pytest.raises(InsufficientMemoryError, match="max_position_embeddings=1000"):
        RotaryEmbedding(rotary_dim, rotary_dim, positions, 1e4)
    monkeypatch.setattr(rotary_module, "host_memory_available_bytes", lambda: 700_000)
    assert RotaryEmbedding(rotary_dim, rotary_dim, positions, 1e4).cos_sin_cache.shape == (positions, rotary_dim)


def test_rotary_table_on_a_gpu_is_checked_against_its_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 80 * GIB))
    with pytest.raises(InsufficientMemoryError, match="of cuda:0 memory available"):
        RotaryEmbedding(64, 64, 1000, 1e4, device="cuda:0")
