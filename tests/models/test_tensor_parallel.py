"""Whole models split over two real ranks (two processes, gloo): each rank loads its shard of the
HF checkpoint with ``load_model(tp_rank=, tp_size=2)`` and both must give HF's logits. The MoE
models also run with ``expert_parallel=True`` (each rank holds half the experts, whole).

One config per architecture family, chosen so the split is not trivial: KV heads split and
replicated (MQA), a vocabulary that does not divide (padded), an odd dense intermediate size
split in halves, expert intermediate sizes split, shared experts, tied heads, attention sinks.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from atom_core.models import load_model  # noqa: E402
from tests.models import (  # noqa: E402
    test_parity_glm4_moe,
    test_parity_gpt_oss,
    test_parity_llama,
    test_parity_mixtral,
    test_parity_qwen3,
    test_parity_qwen3_moe,
)
from tests.models.moe_parity import build_moe_pair  # noqa: E402
from tests.models.parity_harness import check_decode, check_ragged_prefill  # noqa: E402

TP = 2
DENSE_CASES = [
    test_parity_llama.CASES[0],
    test_parity_qwen3.CASES[0],          # 2 KV heads: one per rank
    test_parity_qwen3.CASES[2],          # MQA (a replicated KV head), intermediate 100, hidden 48
]
MOE_CASES = [
    test_parity_qwen3_moe.CASES[1],      # a dense layer and sparse ones, tied head
    test_parity_mixtral.CASES[0],
    test_parity_glm4_moe.CASES[1],       # shared experts, QK norm, partial rotary, tied head
    test_parity_gpt_oss.CASES[0],        # sinks split with the heads, sliding layers, expert biases
]
RUNS = [(case, False) for case in DENSE_CASES + MOE_CASES] + [(case, True) for case in MOE_CASES]


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _rank(rank: int, init_file: str, pair, full_numel: int, expert_parallel: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP,
                            timeout=datetime.timedelta(seconds=120))
    try:
        model = load_model(pair.path, dtype=torch.float32, device="cpu", tp_rank=rank, tp_size=TP,
                           expert_parallel=expert_parallel)
        assert _numel(model) < 0.75 * full_numel, "this rank holds most of the model: nothing was split"
        with ops.use_backend("torch"):
            check_ragged_prefill(pair, model)
            check_decode(pair, model, 4, num_decode_steps=3)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
@pytest.mark.parametrize("case, expert_parallel", RUNS,
                         ids=[f"{c.hf_family}-{c.name}{'-ep' if ep else ''}" for c, ep in RUNS])
def test_two_ranks_match_hf(case, expert_parallel, tmp_path):
    pair = build_moe_pair(case, tmp_path / "ckpt")
    full_numel = _numel(pair.load_atom())
    # fork: the ranks inherit the HF reference model; a failing check in either rank raises here
    mp.start_processes(_rank, args=(os.path.join(tmp_path, "init"), pair, full_numel, expert_parallel), nprocs=TP, join=True,
                       start_method="fork")


def test_expert_parallel_splits_whole_experts_and_needs_experts(tmp_path):
    """(No collectives: construction only.) EP rank 1 of 2 holds experts 2..3 of 4 with the full
    intermediate size; a dense model refuses the flag."""
    pair = build_moe_pair(test_parity_mixtral.CASES[0], tmp_path / "moe")
    model = load_model(pair.path, device="cpu", tp_rank=1, tp_size=2, expert_parallel=True)
    experts = model.model.layers[0].mlp.experts
    hf_experts = pair.hf_model.model.layers[0].mlp.experts
    assert experts.shard.expert_start == 2 and experts.w13_weight.shape[0] == 2
    assert torch.equal(experts.w2_weight, hf_experts.down_proj[2:4])
    dense = build_moe_pair(test_parity_llama.CASES[0], tmp_path / "dense")
    with pytest.raises(ValueError, match="no experts to split"):
        load_model(dense.path, device="cpu", tp_rank=0, tp_size=2, expert_parallel=True)
