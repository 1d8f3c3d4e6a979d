"""DeepseekV2ForCausalLM / DeepseekV3ForCausalLM (and Kimi-K2's ``kimi_k2`` model_type) against
transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM, fp32 on CPU with the torch backend.

Tiny random configs with the structure of the released ones (../shared/reference/configs):

- ``v2_lite_like``: no ``q_lora_rank`` (q_proj), greedy softmax routing over all experts, no
  renormalisation, two shared experts, first layer dense, YaRN with mscale = mscale_all_dim = 0.707
  (table factor 1, softmax scale corrected);
- ``v2_group_limited_bias``: DeepSeek-V2's q_lora path and group-limited greedy routing (2 of 4
  groups), routed scaling 2, attention biases (q_a_proj, kv_a_proj_with_mqa, o_proj);
- ``v3_like``: q_lora, noaux_tc (sigmoid + correction bias, 2 of 4 groups, renormalised, scaling 2.5),
  a shared expert, first layer dense, 3 layers, YaRN with mscale 1.0 != mscale_all_dim 0.8 (the table
  carries their ratio, the softmax scale the square of the latter), interleaved rope;
- ``v3_neox_rope_tied``: transformers' ``rope_interleave: false`` (rotate-half pairs), plain rope,
  no renormalisation, tied embeddings, every layer sparse;
- ``kimi_k2_like``: a V3 checkpoint relabelled as the released Kimi-K2 ``config.json`` spells it
  (``model_type: kimi_k2``, ``rope_theta`` + ``rope_scaling.type: yarn``, no ``head_dim`` /
  ``rope_interleave`` keys), one expert group, scaling 2.827, and an MTP layer's tensors after the
  last layer (``num_nextn_predict_layers``) that loading must skip.

Each runs the harness's checks (ragged prefill, paged decode at block sizes 1 / 4 / 16 with shuffled
blocks and a late joiner, chunked prefill, prefix-cache resumption) through an MLA latent pool
(one ``[NB, BS, L + R]`` tensor per layer). Steps with at most 8 queries per row run the absorbed
(decode) form, longer ones the expanded (prefill) form; both forms are also forced on one case.
Through ``Engine`` (whose runner allocates the pool from ``kv_cache_spec()``): greedy tokens equal
HF ``generate``, and an fp8 latent pool costs one byte per latent number. Over two gloo ranks (tensor
parallel, and expert parallel): the same logits as HF.
"""

# T tokens, E hidden, H heads, L kv_lora_rank, R qk_rope_head_dim, X experts, K top-k

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from atom_core.models.layers.mla import MultiHeadLatentAttention  # noqa: E402
from atom_core.models.layers.mlp import GatedMLP  # noqa: E402
from tests.models import parity_harness  # noqa: E402
from tests.models.moe_parity import build_moe_pair, check_engine_greedy, checkpoint_tensor_names  # noqa: E402
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    HFParityChecks,
    ModelPair,
    ParityCase,
    check_chunked_and_prefix,
    check_decode,
    parity_pair_fixture,
    single_thread_torch,
)

for _family, _classes in {"deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
                          "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}.items():
    parity_harness._HF_CLASSES.setdefault(_family, _classes)

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
MLA = {"num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
       "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
       "n_shared_experts": 1, "first_k_dense_replace": 1}


def yarn(factor: float, mscale: float, mscale_all_dim: float, theta: float = 10000.0, **extra) -> dict:
    return {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": int(
        128 / factor), "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim, **extra}


KIMI = ParityCase("kimi_k2_like", "deepseek_v3", V3,
                  {**MLA, "q_lora_rank": 24, "n_routed_experts": 12, "num_experts_per_tok": 3, "n_group": 1,
                   "topk_group": 1, "routed_scaling_factor": 2.827, "norm_topk_prob": True,
                   "rope_parameters": yarn(32.0, 1.0, 1.0, theta=50000.0, beta_fast=1.0, beta_slow=1.0)})
CASES = [
    ParityCase("v2_lite_like", "deepseek_v2", V2,
               {**MLA, "q_lora_rank": None, "n_shared_experts": 2, "num_experts_per_tok": 3, "n_group": 1,
                "topk_group": 1, "topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                "rope_parameters": yarn(4.0, 0.707, 0.707)}),
    ParityCase("v2_group_limited_bias", "deepseek_v2", V2,
               {**MLA, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "topk_method": "group_limited_greedy",
                "norm_topk_prob": False, "routed_scaling_factor": 2.0, "attention_bias": True}),
    ParityCase("v3_like", "deepseek_v3", V3,
               {**MLA, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                "routed_scaling_factor": 2.5, "num_hidden_layers": 3, "rope_parameters": yarn(4.0, 1.0, 0.8)}),
    ParityCase("v3_neox_rope_tied", "deepseek_v3", V3,
               {**MLA, "q_lora_rank": 24, "n_group": 2, "topk_group": 1, "norm_topk_prob": False,
                "first_k_dense_replace": 0, "rope_interleave": False, "tie_word_embeddings": True}),
    KIMI,
]
MTP_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def build_deepseek_pair(case: ParityCase, folder: Path, *, seed: int = 0) -> ModelPair:
    """``build_moe_pair`` (HF model, random weights, random correction bias); the Kimi case's config.json is
    then rewritten in the released Kimi-K2 spelling and an MTP layer's tensors are added after the last layer."""
    pair = build_moe_pair(case, folder, seed=seed)
    if case.name != KIMI.name:
        return pair
    from safetensors.torch import save_file

    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config.update({"model_type": "kimi_k2", "rope_theta": rope.pop("rope_theta"),
                   "rope_scaling": {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "yarn"},
                   "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 1})
    for key in ("head_dim", "rope_interleave", "qk_head_dim"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2))
    hidden, mtp = config["hidden_size"], config["num_hidden_layers"]
    save_file({f"model.layers.{mtp}.{name}": torch.ones(hidden, 2 * hidden) if "proj" in name else torch.ones(hidden)
               for name in MTP_TENSORS}, str(Path(folder) / "mtp.safetensors"))
    return pair


pair = parity_pair_fixture(CASES, build_deepseek_pair)
V3_LIKE = CASES[2]


@pytest.fixture(scope="module")
def v3_pair(tmp_path_factory) -> ModelPair:
    """The ``v3_like`` case alone, for the checks one case is enough for."""
    return build_deepseek_pair(V3_LIKE, tmp_path_factory.mktemp("v3_alone"))


@pytest.fixture(scope="module")
def kimi_pair(tmp_path_factory) -> ModelPair:
    return build_deepseek_pair(KIMI, tmp_path_factory.mktemp("kimi_alone"))

# Checkpoint name -> parameter name: experts stacked, gate/up fused (dense MLPs and shared experts).
_RENAMES = [
    (r"\.experts\.\d+\.(gate_proj|up_proj)\.weight$", ".experts.w13_weight"),
    (r"\.experts\.\d+\.down_proj\.weight$", ".experts.w2_weight"),
    (r"\.(gate_proj|up_proj)\.", ".gate_up_proj."),
]


class TestHFParity(HFParityChecks):
    """Ragged prefill, paged decode (block sizes 1 / 4 / 16), chunked prefill and prefix resumption against HF;
    parameter names; greedy tokens through ``Engine``."""

    def test_engine_greedy_equals_hf_generate(self, pair):
        check_engine_greedy(pair)

    def test_parameter_names_are_the_checkpoints_after_stacking_and_fusing(self, pair, model):
        num_layers = pair.hf_model.config.num_hidden_layers
        expected = set()
        for name in checkpoint_tensor_names(pair.path):
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if layer and int(layer.group(1)) >= num_layers:
                continue  # the MTP layer: not part of this model
            for pattern, replacement in _RENAMES:
                name = re.sub(pattern, replacement, name)
            expected.add(name)
        if pair.hf_model.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
        actual = {name for name, _ in model.named_parameters()}
        assert actual == expected, (f"only in atom_core: {sorted(actual - expected)}; "
                                    f"only in the checkpoint: {sorted(expected - actual)}")


def test_structure_follows_the_config(pair, model):
    """q path, dense layers, rope layout, YaRN scales and the correction bias are really there (else the
    parity would be vacuous); the softmax scale is HF's own module attribute."""
    hf_config = pair.hf_model.config
    for i, (layer, hf_layer) in enumerate(zip(model.model.layers, pair.hf_model.model.layers)):
        attn = layer.self_attn
        assert isinstance(attn, MultiHeadLatentAttention)
        assert hasattr(attn, "q_proj") == (hf_config.q_lora_rank is None)
        assert isinstance(layer.mlp, GatedMLP) == (i < hf_config.first_k_dense_replace)
        assert attn.attn.scale == pytest.approx(hf_layer.self_attn.scaling, rel=1e-12)
        interleaved = pair.case.hf_family == "deepseek_v2" or hf_config.rope_interleave
        assert attn.rotary_emb.is_neox == (not interleaved)
        assert attn.rotary_emb.attention_scale == pytest.approx(pair.hf_model.model.rotary_emb.attention_scaling)
    sparse = model.model.layers[hf_config.first_k_dense_replace].mlp
    bias = sparse.gate.e_score_correction_bias
    assert (bias is not None) == (pair.case.hf_family == "deepseek_v3")
    if bias is not None:
        assert bias.abs().max() > 0  # loaded from the checkpoint, randomised by build_moe_pair


def test_kv_cache_spec_is_one_latent_row_per_token_per_layer(pair, model):
    hf_config = pair.hf_model.config
    spec = model.kv_cache_spec()
    row = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
    assert spec.is_mla and spec.num_kv_tensors_per_layer == 1
    assert spec.kv_shape(7, 4) == (7, 4, row)
    assert spec.bytes_per_token == hf_config.num_hidden_layers * row * 4  # fp32, no separate V
    assert model.kv_cache_spec(torch.float8_e4m3fn).bytes_per_token == hf_config.num_hidden_layers * row
    assert model.kv_cache_scales() == [(None,)] * hf_config.num_hidden_layers


def test_bind_kv_cache_refuses_a_k_v_pair_and_a_wrong_row_size(model):
    layers = len(model.model.layers)
    spec = model.kv_cache_spec()
    latent = torch.zeros(spec.kv_shape(2, 4))
    with pytest.raises(ValueError, match="no separate K and V"):
        model.bind_kv_cache([(latent, latent, latent)] * layers)
    with pytest.raises(ValueError, match="kv_lora_rank \\+ qk_rope_head_dim"):
        model.bind_kv_cache([(torch.zeros(2, 4, spec.head_dim + 1),)] * layers)
    model.bind_kv_cache([latent] * layers)  # a bare tensor per layer is accepted too
    assert model.bound_kv_caches[0] is latent


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_each_attention_form_alone_matches_hf(v3_pair, form):
    """Every step through one form, whatever its query lengths (the auto choice mixes them)."""
    pair, model = v3_pair, v3_pair.load_atom()
    attentions = [layer.self_attn.attn for layer in model.model.layers]
    try:
        for attn in attentions:
            attn.form = form
        with ops.use_backend("torch"):
            check_decode(pair, model, 4, num_decode_steps=3)
            check_chunked_and_prefix(pair, model, chunks=(9, 1, 6))
    finally:
        for attn in attentions:
            attn.form = "auto"


def test_kimi_k2_model_type_loads_as_deepseek_v3_with_the_mtp_layer_skipped(kimi_pair):
    pair, model = kimi_pair, kimi_pair.load_atom()
    assert model.config.model_type == "kimi_k2" and type(model).__name__ == V3
    assert model.config.rope_scaling["rope_type"] == "yarn" and model.config.rope_theta == 50000.0
    assert {f"model.layers.2.{name}" for name in MTP_TENSORS} <= checkpoint_tensor_names(pair.path)


def test_an_unknown_model_type_under_deepseek_v3_is_refused_by_name(v3_pair):
    pair = v3_pair
    from atom_core.models import ModelConfig, build_model

    config = json.loads((pair.path / "config.json").read_text())
    config["model_type"] = "deepseek_v32"
    with pytest.raises(ValueError, match="serves model_type 'deepseek_v3' or 'kimi_k2', got 'deepseek_v32'"):
        build_model(ModelConfig.from_dict(config), device="cpu", dtype=torch.float32)



@pytest.mark.parametrize("edit, message", [
    ({"scoring_func": "softmax"}, "topk_method 'noaux_tc' routes on sigmoid scores.*scoring_func 'softmax'"),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
     "num_experts_per_tok=3 exceeds the 2 experts its topk_group=1 of n_group=4 groups hold"),
    ({"topk_method": "group_limited_greedy", "scoring_func": "softmax", "norm_topk_prob": True,
      "routed_scaling_factor": 2.0}, r"norm_topk_prob true \(routed_scaling_factor 2.0\): the references disagree"),
    # transformers' V2 never renormalises, even with a factor of 1 (it gave logits 0.56 off DeepSeek's rule)
    ({"topk_method": "greedy", "scoring_func": "softmax", "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
      "routed_scaling_factor": 1.0}, r"norm_topk_prob true \(routed_scaling_factor 1.0\): the references disagree"),
])
def test_a_routing_config_the_references_do_not_define_is_refused_by_name(v3_pair, edit, message):
    from atom_core.models import ModelConfig, build_model

    config = {**json.loads((v3_pair.path / "config.json").read_text()), "n_routed_experts": 8, **edit}
    with pytest.raises(ValueError, match=message):
        build_model(ModelConfig.from_dict(config), device="cpu", dtype=torch.float32)


def test_engine_with_an_fp8_latent_pool_allocates_one_byte_per_latent_number_and_generates(v3_pair):
    pair = v3_pair
    from atom_core.engine import Engine, SamplingParams

    config = pair.hf_model.config
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(pair.path, device="cpu", dtype=torch.float32, block_size=4,
                                        kv_cache_dtype="fp8", max_num_batched_tokens=8)
        (out,) = engine.generate([[5, 9, 2, 7, 1]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                 use_tqdm=False)
    layer = engine.model.model.layers[0].self_attn.attn
    assert layer.mla_cache.dtype == torch.float8_e4m3fn and layer.kv_scale is not None
    assert layer.mla_cache.shape[2] == config.kv_lora_rank + config.qk_rope_head_dim
    assert engine.model.kv_cache_spec(torch.float8_e4m3fn).bytes_per_token == (
        config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim))
    assert len(out.token_ids) == 4


def test_moe_layer_freq_makes_every_freq_th_layer_from_first_k_dense_replace_sparse():
    """The original DeepSeek rule (transformers ignores moe_layer_freq; every release has 1): layer i is sparse
    when i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    from atom_core.models import build_model
    from atom_core.models.deepseek_v2 import DeepseekMoE

    config = {**parity_harness.BASE_CONFIG, **MLA, "architectures": [V3], "model_type": "deepseek_v3",
              "q_lora_rank": 24, "num_hidden_layers": 6, "moe_layer_freq": 2, "first_k_dense_replace": 1}
    model = build_model(config, device="cpu", dtype=torch.float32, load_format="zeros")
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, DeepseekMoE)]
    assert sparse == [2, 4]


def _tensor_parallel_rank(rank: int, init_file: str, pair: ModelPair, full_numel: int, expert_parallel: bool) -> None:
    import datetime

    import torch.distributed as dist

    from atom_core.models import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        model = load_model(pair.path, dtype=torch.float32, device="cpu", tp_rank=rank, tp_size=2,
                           expert_parallel=expert_parallel)
        assert sum(p.numel() for p in model.parameters()) < 0.75 * full_numel, "nothing was split"
        assert model.model.layers[0].self_attn.num_heads == pair.hf_model.config.num_attention_heads // 2
        with ops.use_backend("torch"):
            parity_harness.check_ragged_prefill(pair, model)
            check_decode(pair, model, 4, num_decode_steps=3)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case, expert_parallel", [(CASES[0], False), (V3_LIKE, True)],
                         ids=["v2_lite_like-tp2", "v3_like-tp2-ep"])
def test_two_ranks_split_heads_and_experts_and_match_hf(case, expert_parallel, tmp_path):
    """Heads split over two gloo ranks (q / q_b / kv_b column-parallel, o_proj row-parallel; the latent
    projections replicated, so both ranks cache the same rows), experts split by intermediate dim or whole."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    pair = build_deepseek_pair(case, tmp_path / "ckpt")
    full_numel = sum(p.numel() for p in pair.load_atom().parameters())
    mp.start_processes(_tensor_parallel_rank, args=(str(tmp_path / "init"), pair, full_numel, expert_parallel),
                       nprocs=2, join=True, start_method="fork")
