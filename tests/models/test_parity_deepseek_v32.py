"""DeepSeek-V3.2 and GLM-5 (DSA: MLA restricted to each query's indexer top-k) against HF transformers,
fp32 on CPU: ragged prefill, paged decode at block sizes 1 / 4 / 16 with shuffled blocks and a late joiner,
chunked prefill and prefix-cache resumption, through the latent pool plus the indexer-key pool the harness
allocates from ``extra_kv_cache_specs()``.

Tiny configs keep the real configs' structure (q LoRA, a dense first layer, noaux_tc routing, DeepSeek YaRN
with unequal mscales for V3.2, GLM-5's interleaved indexer rope and a "shared" layer reusing the previous
layer's top-k). ``index_topk`` 8 (GLM: 6) is below most contexts here (up to 40 tokens), so the indexer
really drops tokens (checked: HF's own logits move when top-k covers everything); one V3.2 case has
``index_topk`` 64, above every context, where DSA is dense MLA.

Index heads are 8: a query's score for a token is exactly 0 only when all 8 heads' relu clip (2^-8 of the
tokens), so exact ties at the k-th place, which HF and atom_core may break differently, stay out of reach.
"""

# T tokens, E hidden, H heads, L kv_lora_rank, R qk_rope_head_dim, Hi index heads, Di index head dim, K top-k

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from atom_core.models.layers.mla import LightningIndexer  # noqa: E402
from tests.models import parity_harness  # noqa: E402
from tests.models.moe_parity import build_moe_pair, check_engine_greedy, checkpoint_tensor_names  # noqa: E402
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    HFParityChecks,
    ModelPair,
    ParityCase,
    check_decode,
    check_ragged_prefill,
    parity_pair_fixture,
    random_tokens,
    single_thread_torch,
)
from tests.models.test_parity_deepseek import _RENAMES, MLA, yarn  # noqa: E402

for _family, _classes in {"deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
                          "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")}.items():
    parity_harness._HF_CLASSES.setdefault(_family, _classes)

V32, GLM = "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"
DSA = {**MLA, "q_lora_rank": 24, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 8,
       "norm_topk_prob": True}
V32_SPARSE = ParityCase("v32_sparse", "deepseek_v32", V32,
                        {**DSA, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                         "rope_parameters": yarn(4.0, 1.0, 0.8)})
CASES = [
    V32_SPARSE,
    ParityCase("v32_topk_covers_context", "deepseek_v32", V32,
               {**DSA, "index_topk": 64, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5}),
    ParityCase("glm5_shared_topk", "glm_moe_dsa", GLM,
               {**DSA, "index_topk": 6, "num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"],
                "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
]

pair = parity_pair_fixture(CASES, build_moe_pair)


@pytest.fixture(scope="module")
def v32_pair(tmp_path_factory) -> ModelPair:
    return build_moe_pair(V32_SPARSE, tmp_path_factory.mktemp("v32_alone"))


class TestHFParity(HFParityChecks):
    """Ragged prefill, paged decode (block sizes 1 / 4 / 16), chunked prefill and prefix resumption against HF;
    parameter names."""

    def test_engine_greedy_equals_hf_generate_with_the_indexer_cache_allocated_by_the_runner(self, pair):
        check_engine_greedy(pair, lengths=(30, 1, 17), max_tokens=6)

    def test_long_contexts_with_most_tokens_dropped_match_hf(self, pair, model):
        with ops.use_backend("torch"):
            check_ragged_prefill(pair, model, lengths=(40, 23, 1, 9), block_size=4)

    def test_parameter_names_are_the_checkpoints_after_stacking_and_fusing(self, pair, model):
        expected = set()
        for name in checkpoint_tensor_names(pair.path):
            for pattern, replacement in _RENAMES:
                name = re.sub(pattern, replacement, name)
            expected.add(name)
        actual = {name for name, _ in model.named_parameters()}
        assert actual == expected, (f"only in atom_core: {sorted(actual - expected)}; "
                                    f"only in the checkpoint: {sorted(expected - actual)}")
        assert any(".indexer.k_norm.bias" in name for name in actual)


def test_the_indexer_really_drops_tokens_hf_logits_move_when_top_k_covers_everything(v32_pair):
    """Else the sparse parity would pass with a dense implementation."""
    prompt = random_tokens(40, 101, seed=7)
    indexers = [layer.self_attn.indexer for layer in v32_pair.hf_model.model.layers]
    sparse = v32_pair.hf_logits(prompt)
    try:
        for indexer in indexers:
            indexer.index_topk = 64
        dense = v32_pair.hf_logits(prompt)
    finally:
        for indexer in indexers:
            indexer.index_topk = 8
    assert torch.allclose(sparse[:8], dense[:8], atol=1e-5)   # positions 0..7 see at most 8 tokens: no drop
    assert (sparse[8:] - dense[8:]).abs().max() > 1e-2


def test_structure_follows_the_config(pair, model):
    """An indexer where indexer_types says full, none where shared; its rope layout per family; the indexer cache
    spec counts the indexer layers."""
    hf_config = pair.hf_model.config
    kinds = getattr(hf_config, "indexer_types", None) or ["full"] * hf_config.num_hidden_layers
    for kind, layer in zip(kinds, model.model.layers):
        attn = layer.self_attn
        assert (attn.indexer is not None) == (kind == "full")
        assert attn.rotary_emb.is_neox is False  # MLA's rope: interleaved in both families
        if attn.indexer is not None:
            assert attn.indexer.topk == hf_config.index_topk
            assert attn.indexer.rope_is_neox == (pair.case.hf_family == "deepseek_v32")
            assert attn.indexer.weights_proj.weight.dtype == torch.float32
    spec = model.extra_kv_cache_specs()["indexer"]
    assert spec.num_layers == kinds.count("full") and spec.kv_shape(7, 4) == (7, 4, hf_config.index_head_dim)
    assert spec.bytes_per_token == kinds.count("full") * hf_config.index_head_dim * 4
    assert model.kv_cache_spec().head_dim == hf_config.kv_lora_rank + hf_config.qk_rope_head_dim


def test_forward_without_an_indexer_cache_says_what_to_bind(v32_pair):
    from atom_core.cache import build_step_layout

    model = v32_pair.load_atom()
    spec = model.kv_cache_spec()
    model.bind_kv_cache([(torch.zeros(spec.kv_shape(2, 4)),)] * spec.num_layers)
    layout = build_step_layout([3], [0], [[0]], 4)
    with pytest.raises(RuntimeError, match="bind_extra_kv_caches"):
        model(torch.tensor([1, 2, 3]), layout.positions, layout)


def test_bind_extra_kv_caches_refuses_a_wrong_name_count_or_width(v32_pair):
    model = v32_pair.load_atom()
    spec = model.extra_kv_cache_specs()["indexer"]
    good = [torch.zeros(spec.kv_shape(2, 4)) for _ in range(spec.num_layers)]
    with pytest.raises(ValueError, match="exactly \\['indexer'\\]"):
        model.bind_extra_kv_caches({"keys": good})
    with pytest.raises(ValueError, match="indexer layers"):
        model.bind_extra_kv_caches({"indexer": good[:1]})
    with pytest.raises(ValueError, match="index_head_dim"):
        model.bind_extra_kv_caches({"indexer": [torch.zeros(2, 4, spec.head_dim + 1)] * spec.num_layers})
    model.bind_extra_kv_caches({"indexer": good})
    indexers = [m for m in model.modules() if isinstance(m, LightningIndexer)]
    assert [i.indexer_cache for i in indexers] == good


def test_an_fp8_pool_asks_for_fp8_indexer_keys_with_a_scale_each_and_binds_them(v32_pair):
    model = v32_pair.load_atom()
    specs = model.extra_kv_cache_specs(torch.float8_e4m3fn)
    keys, scales = specs["indexer"], specs["indexer_scale"]
    head_dim = v32_pair.hf_model.config.index_head_dim
    assert set(specs) == {"indexer", "indexer_scale"} and keys.dtype == torch.float8_e4m3fn
    assert keys.bytes_per_token + scales.bytes_per_token == keys.num_layers * (head_dim + 4)  # Di fp8 + one fp32
    assert scales.num_layers == keys.num_layers and scales.kv_shape(7, 4) == (7, 4, 1)
    caches = {"indexer": [torch.zeros(keys.kv_shape(2, 4), dtype=torch.float8_e4m3fn)] * keys.num_layers}
    with pytest.raises(ValueError, match="fp8 indexer keys need their per-key scales"):
        model.bind_extra_kv_caches(caches)
    caches["indexer_scale"] = [torch.ones(scales.kv_shape(2, 4)) for _ in range(keys.num_layers)]
    model.bind_extra_kv_caches(caches)
    indexers = [m for m in model.modules() if isinstance(m, LightningIndexer)]
    assert all(i.indexer_scale.shape == (2, 4) and i.indexer_scale.data_ptr() == t.data_ptr()
               for i, t in zip(indexers, caches["indexer_scale"]))
    assert model.extra_kv_cache_specs(torch.float32)["indexer"].dtype == model.extra_kv_cache_specs()["indexer"].dtype


def test_v2_and_v3_ask_for_no_extra_cache():
    from atom_core.models import build_model

    config = {**parity_harness.BASE_CONFIG, **MLA, "architectures": ["DeepseekV3ForCausalLM"],
              "model_type": "deepseek_v3", "q_lora_rank": 24}
    model = build_model(config, device="cpu", dtype=torch.float32, load_format="zeros")
    assert model.extra_kv_cache_specs() == {}
    model.bind_extra_kv_caches({})


def test_glm5_indexer_schedule_follows_transformers_from_pattern_or_freq_and_offset():
    from atom_core.models import build_model

    base = {**parity_harness.BASE_CONFIG, **DSA, "architectures": [GLM], "model_type": "glm_moe_dsa",
            "num_hidden_layers": 5, "first_k_dense_replace": 5}

    def kinds(**extra):
        model = build_model({**base, **extra}, device="cpu", dtype=torch.float32, load_format="zeros")
        return ["full" if layer.self_attn.indexer is not None else "shared" for layer in model.model.layers]

    from transformers import GlmMoeDsaConfig

    for extra in ({}, {"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
                  {"index_topk_pattern": "FSSFS"}):
        hf = GlmMoeDsaConfig(num_hidden_layers=5, **extra).indexer_types
        assert kinds(**extra) == hf, extra
    with pytest.raises(ValueError, match="first layer must run its indexer"):
        kinds(index_topk_pattern="SFFFF")


def test_a_v32_config_without_q_lora_rank_is_refused_by_name():
    from atom_core.models import build_model

    config = {**parity_harness.BASE_CONFIG, **DSA, "architectures": [V32], "model_type": "deepseek_v32",
              "q_lora_rank": None}
    with pytest.raises(ValueError, match="needs q_lora_rank"):
        build_model(config, device="cpu", dtype=torch.float32, load_format="zeros")


TINY_SIZES = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 100, "moe_intermediate_size": 24,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
              "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
              "head_dim": 8, "qk_head_dim": 24, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "index_n_heads": 8, "index_head_dim": 16, "index_topk": 8, "first_k_dense_replace": 1,
              "max_position_embeddings": 128, "eos_token_id": [1], "pad_token_id": 0}


@pytest.mark.parametrize("name, architecture, indexer_neox", [("glm-5.json", GLM, False),
                                                               ("deepseek-v3.2.json", V32, True)])
def test_the_released_configs_build_with_their_families_indexer_rope(name, architecture, indexer_neox):
    """The released config.json (shrunk to tiny sizes, every other key kept) builds as its architecture: GLM-5.1
    says indexer_rope_interleave true; V3.2's default is half-split; every layer has an indexer."""
    from atom_core.models import build_model

    path = Path("/work/shared/reference/configs") / name
    if not path.is_file():
        pytest.skip(f"{path} not available")
    config = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    config.update(TINY_SIZES)
    model = build_model(config, device="cpu", dtype=torch.float32, load_format="zeros")
    assert type(model).__name__ == architecture
    assert [layer.self_attn.indexer.rope_is_neox for layer in model.model.layers] == [indexer_neox] * 2


def test_a_decode_step_with_only_decode_rows_goes_through_the_sparse_op(v32_pair):
    model = v32_pair.load_atom()
    with ops.trace_backends() as calls, ops.use_backend("torch"):
        check_decode(v32_pair, model, 4, num_decode_steps=2)
    ops_used = {name for name, _ in calls}
    assert {"indexer_topk", "store_indexer_k_", "mla_sparse_attention"} <= ops_used
    assert not ops_used & {"mla_decode_attention", "mla_prefill_attention"}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_cpu_pool_sized_from_memory_holds_its_requests_with_the_indexer_keys_counted(v32_pair, monkeypatch,
                                                                                      kv_cache_dtype):
    """CPU_DEFAULT_POOL_SEQS requests of max_model_len, the indexer keys' blocks in the same budget (not taken
    out of the pool's share of it)."""
    from atom_core.engine import kv_pool

    monkeypatch.setattr(kv_pool, "host_memory_available_bytes", lambda: 1 << 40)
    sizing = dict(block_size=16, num_kv_blocks=None, gpu_memory_utilization=0.9, max_num_seqs=4,
                  max_num_batched_tokens=256, max_model_len=1000, kv_cache_dtype=kv_cache_dtype)
    _, extra_specs, plan = kv_pool.plan_pool(v32_pair.load_atom(), torch.device("cpu"), **sizing)
    assert extra_specs and plan.num_blocks == kv_pool.CPU_DEFAULT_POOL_SEQS * 63  # ceil(1000 / 16) blocks each
