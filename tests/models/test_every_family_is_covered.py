"""The cross-family tests list their families by hand: each registered architecture must appear in them, or be
left out below with the reason, so a new architecture is not silently untested (docs/models.md, "Adding an
architecture", step 6)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from atom_core.models.config import ARCH_DEFAULTS  # noqa: E402
from atom_core.models.registry import MODEL_MODULES  # noqa: E402

SAME_CLASS_AS_LLAMA = "loads as LlamaForCausalLM (the same class under another name)"
NOT_IN_MEMORY_TEST = {"MistralForCausalLM": SAME_CLASS_AS_LLAMA}
NOT_IN_MULTI_RANK_TESTS = {
    "MistralForCausalLM": SAME_CLASS_AS_LLAMA,
    "DeepseekV32ForCausalLM": "no multi-rank test of the DSA indexer yet (replicated on every rank)",
    "GlmMoeDsaForCausalLM": "no multi-rank test of the DSA indexer yet (replicated on every rank)",
}
NO_HF_CONFIG_CLASS = {"mistral": "HF's MistralConfig defaults are Llama's but for the window, pinned by "
                                 "test_parity_mistral.py", "kimi_k2": "HF has no Kimi-K2 config class"}


def test_every_architecture_is_in_the_memory_estimate_test():
    from tests.models.test_model_memory import ARCHITECTURES

    covered = {a for entry in ARCHITECTURES.values() for a in entry["architectures"]}
    assert set(MODEL_MODULES) - covered - set(NOT_IN_MEMORY_TEST) == set()


def test_every_architecture_is_in_a_multi_rank_test():
    from tests.models import test_parity_deepseek, test_tensor_parallel

    cases = (test_tensor_parallel.DENSE_CASES + test_tensor_parallel.MOE_CASES
             + [test_parity_deepseek.CASES[0], test_parity_deepseek.V3_LIKE])  # its two-rank test's cases
    covered = {case.architecture for case in cases}
    assert set(MODEL_MODULES) - covered - set(NOT_IN_MULTI_RANK_TESTS) == set()


def test_every_family_default_is_pinned_to_transformers():
    from tests.models.test_config import DEFAULTS_PINNED_TO_HF

    assert set(ARCH_DEFAULTS) - set(DEFAULTS_PINNED_TO_HF) - set(NO_HF_CONFIG_CLASS) == set()
