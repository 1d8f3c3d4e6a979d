"""The four MoE architectures in bf16 on a GPU with their real top-k (the parity files' GPU tests
choose every expert to keep routing fixed; here routing is free and flips are counted against
HF's own bf16 model: ``moe_parity.check_real_top_k_bf16``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from tests.models import (  # noqa: E402
    test_parity_glm4_moe,
    test_parity_gpt_oss,
    test_parity_mixtral,
    test_parity_qwen3_moe,
)
from tests.models.moe_parity import build_moe_pair, check_real_top_k_bf16  # noqa: E402

CASES = [case for module in (test_parity_qwen3_moe, test_parity_mixtral, test_parity_glm4_moe, test_parity_gpt_oss)
         for case in module.CASES]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=[f"{c.hf_family}-{c.name}" for c in CASES])
def test_bf16_triton_with_real_top_k_flips_no_more_than_hf_bf16(case, tmp_path):
    pair = build_moe_pair(case, tmp_path)
    model = pair.load_atom(dtype=torch.bfloat16, device="cuda")
    with ops.use_backend("triton"):
        check_real_top_k_bf16(pair, model)
