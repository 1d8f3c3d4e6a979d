"""DP attention over two gloo ranks (CPU): each rank holds the whole attention and half of every MoE layer's
experts, runs its own sequences, and the MoE layers send each rank's tokens to their experts' ranks and back.
Every rank's logits must equal a one-rank model's on the same sequences, for a Qwen3-MoE (a dense layer and
sparse ones), a GLM-4-MoE (shared experts, which stay whole on every rank) and a DeepSeek-V3 (MLA), with the
ranks' token counts different at every step (ragged prefills, then decodes of 3 and 1 rows)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from atom_core.models import ParallelContext, load_model  # noqa: E402
from atom_core.models.layers.moe import FusedMoE  # noqa: E402
from tests.models import test_parity_deepseek, test_parity_glm4_moe, test_parity_qwen3_moe  # noqa: E402
from tests.models.moe_parity import build_moe_pair  # noqa: E402
from tests.models.parity_harness import PagedRunner, random_tokens  # noqa: E402

RANKS = 2
CASES = [test_parity_qwen3_moe.CASES[1], test_parity_glm4_moe.CASES[1],
         test_parity_deepseek.CASES[2]]  # DeepSeek-V3: MLA attention, shared experts, dense first layers
# each rank's own prompts: the ranks differ in rows and tokens
PROMPT_LENGTHS = {0: (9, 3, 14), 1: (5,)}


def _logits(model, rank: int) -> torch.Tensor:
    """A ragged prefill of the rank's prompts, then two decode steps of all of them (one tensor)."""
    runner = PagedRunner(model, block_size=4, num_blocks=48, seed=1)
    prompts = [random_tokens(n, 101, seed=10 * rank + i) for i, n in enumerate(PROMPT_LENGTHS[rank])]
    with ops.use_backend("torch"):
        outs = runner.step([(f"s{i}", p) for i, p in enumerate(prompts)])
        for step in range(2):
            outs += runner.step([(f"s{i}", [7 + step + i]) for i in range(len(prompts))])
    return torch.cat(outs)


def _rank(rank: int, init_file: str, path, expected: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=120))
    try:
        parallel = ParallelContext.from_world(expert_parallel="all_to_all", dp_attention=True)
        assert (parallel.dp_rank, parallel.dp_size, parallel.tp_size, parallel.ep_size) == (rank, RANKS, 1, RANKS)
        model = load_model(path, dtype=torch.float32, device="cpu", parallel=parallel)
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert experts and all(e.ep_size == RANKS and e.ep_rank == rank and not e.tokens_replicated
                               and e.shard.num_local_experts * RANKS == e.num_experts for e in experts)
        got = _logits(model, rank)
        torch.testing.assert_close(got, expected[rank], rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
@pytest.mark.parametrize("case", CASES, ids=[f"{c.hf_family}-{c.name}" for c in CASES])
def test_each_dp_rank_with_half_the_experts_matches_the_one_rank_model_on_its_own_sequences(case, tmp_path):
    pair = build_moe_pair(case, tmp_path / "ckpt")
    single = load_model(pair.path, dtype=torch.float32, device="cpu")
    expected = {rank: _logits(single, rank) for rank in range(RANKS)}
    mp.start_processes(_rank, args=(os.path.join(tmp_path, "init"), pair.path, expected), nprocs=RANKS, join=True,
                       start_method="fork")


def test_dp_attention_needs_the_all_to_all_exchange_and_one_rank_of_attention():
    with pytest.raises(ValueError, match="needs expert_parallel='all_to_all'"):
        ParallelContext(dp_rank=0, dp_size=2, expert_parallel=True, dp_attention=True)
    with pytest.raises(ValueError, match="tp_size=2\\) is not built"):
        ParallelContext(tp_rank=0, tp_size=2, dp_size=2, expert_parallel="all_to_all", dp_attention=True)
    ctx = ParallelContext(dp_rank=1, dp_size=2, expert_parallel="all_to_all", dp_attention=True)
    assert (ctx.ep_rank, ctx.ep_size, ctx.ep_group) == (1, 2, None)
    with pytest.raises(ValueError, match="tokens_replicated=False"):
        FusedMoE(4, 8, 8, ep_rank=0, ep_size=2, ep_comm="all_reduce", tokens_replicated=False)


def test_a_model_without_experts_is_refused_by_name_under_dp_attention(tmp_path):
    from tests.models import test_parity_qwen3

    pair = build_moe_pair(test_parity_qwen3.CASES[0], tmp_path / "dense")
    shard = ParallelContext(dp_rank=0, dp_size=2, expert_parallel="all_to_all", dp_attention=True)
    with pytest.raises(ValueError, match="dp_attention=True .* has no experts to split"):
        load_model(pair.path, device="cpu", parallel=shard)
