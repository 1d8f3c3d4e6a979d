"""The four MoE architectures in bf16 with the Triton backend on a GPU, on the configs of their
parity files, against HF in fp32; every op call must be served by Triton.

- Every expert chosen (K = E, all groups kept; ``moe_parity.every_expert_case`` says why): the
  routing is then fixed and the whole parity suite holds within the bf16 tolerance.
- The real top-k: routing is free, and the positions it flips are counted against HF's own model
  cast to bf16: at most twice HF's count, or 5% of the positions if that is more
  (``moe_parity.check_real_top_k_bf16`` says why).
"""

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
from tests.models.moe_parity import (  # noqa: E402
    assert_triton_served,
    build_moe_pair,
    check_bf16_triton_matches_hf_fp32,
    check_real_top_k_bf16,
    every_expert_case,
)

CASES = [case for module in (test_parity_qwen3_moe, test_parity_mixtral, test_parity_glm4_moe, test_parity_gpt_oss)
         for case in module.CASES]
IDS = [f"{c.hf_family}-{c.name}" for c in CASES]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bf16_triton_serves_every_op_and_with_every_expert_matches_hf_fp32(case, tmp_path):
    check_bf16_triton_matches_hf_fp32(build_moe_pair(every_expert_case(case), tmp_path),
                                      {"fused_experts", "paged_attention"})


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bf16_triton_with_real_top_k_is_off_at_no_more_positions_than_twice_hf_bf16_or_5_percent(case, tmp_path):
    """Every op served by Triton; the bound and why it is that: ``moe_parity.check_real_top_k_bf16``."""
    pair = build_moe_pair(case, tmp_path)
    model = pair.load_atom(dtype=torch.bfloat16, device="cuda")

    def run():
        with ops.use_backend("triton"):
            check_real_top_k_bf16(pair, model)

    assert_triton_served(run, {"fused_experts", "paged_attention"})
