"""``check_buildable``: what rank 0's build would raise for a config's sizes, raised from a meta-device build before
any rank or replica starts (``Engine.from_pretrained`` with several ranks or replicas calls it)."""

from __future__ import annotations

import json

import pytest
import torch

from atom_core.models import ModelConfig, ParallelContext, build_model, check_buildable
from tests.models.test_model_memory import ARCHITECTURES, BASE


def _folder(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error itself is compared
        return type(e), str(e)
    return None


@pytest.mark.parametrize("tp_size", [2, 3])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_raises_what_the_cpu_build_of_rank_0_raises(arch, tp_size, tmp_path):
    config = {**BASE, **ARCHITECTURES[arch]}
    folder = _folder(tmp_path, config)
    parallel = ParallelContext(tp_size=tp_size)
    built = _error_of(lambda: build_model(ModelConfig.from_dict(config), device="cpu", dtype=torch.bfloat16,
                                          parallel=parallel, load_format="zeros"))
    assert _error_of(lambda: check_buildable(folder, parallel)) == built
    if tp_size == 3:  # (BASE's 4 heads: 3 ranks cannot split them)
        assert built is not None and "tp_size=3" in built[1]


def test_an_expert_parallel_size_that_does_not_split_the_experts_is_refused(tmp_path):
    folder = _folder(tmp_path, {**BASE, **ARCHITECTURES["mixtral"], "num_attention_heads": 6,
                                "num_key_value_heads": 6, "head_dim": 16})  # 4 experts, 6 heads: 3 ranks split heads
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by ep_size=3"):
        check_buildable(folder, ParallelContext(tp_size=3, expert_parallel=True))
    check_buildable(folder, ParallelContext(tp_size=3))


def test_the_quantization_asked_for_is_checked_against_the_split(tmp_path):
    folder = _folder(tmp_path, {**BASE, **ARCHITECTURES["llama"]})
    check_buildable(folder, ParallelContext(tp_size=2), quantization="fp8")
    with pytest.raises(ValueError, match="quantization"):
        check_buildable(folder, ParallelContext(tp_size=2), quantization="int3")


def test_a_missing_folder_or_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        check_buildable(tmp_path / "none", ParallelContext(tp_size=2))
    with pytest.raises(FileNotFoundError, match="no config.json in model folder"):
        check_buildable(tmp_path, ParallelContext(tp_size=2))


@pytest.mark.parametrize("arch", ["llama", "qwen3_tied", "gemma2_tied_by_default", "mixtral", "gpt_oss"])
def test_partial_rotary_factor_is_refused_where_transformers_rotates_the_whole_head(arch):
    config = ModelConfig.from_dict({**BASE, **ARCHITECTURES[arch], "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5: transformers' \w+ForCausalLM rotates the "
                                         "whole head"):
        build_model(config, device="cpu", load_format="zeros")
    whole = ModelConfig.from_dict({**BASE, **ARCHITECTURES[arch], "partial_rotary_factor": 1.0})
    build_model(whole, device="cpu", load_format="zeros")


def test_partial_rotary_factor_rotates_part_of_the_head_for_phi3_and_glm4_moe():
    for arch in ("phi3", "glm4_moe_dense_first_shared"):
        model = build_model(ModelConfig.from_dict({**BASE, **ARCHITECTURES[arch], "partial_rotary_factor": 0.5}),
                            device="cpu", load_format="zeros")
        (rotary,) = {m for m in model.modules() if type(m).__name__ == "RotaryEmbedding"}
        assert rotary.rotary_dim == BASE["head_dim"] // 2
