"""The parallel context (``atom_core.models.parallel``): models split over a process group that is passed in.

The central test: a four-process gloo world split into two tensor-parallel groups of two (``dist.new_group``),
each group loading a DIFFERENT checkpoint of the same Qwen3-MoE config (another seed), one group tensor-
parallel, the other expert-parallel; each rank's logits must equal HF's for its group's checkpoint. Every
collective has the same shape in both groups, so a layer that reduced or gathered over the default group
(all four ranks) would add the other model's partial sums and fail the logits, not hang.

Also: one process builds, loads and runs a model without ever initializing torch.distributed; a shard built
without a group refuses to reduce, naming the layer; the context's checks and constructors.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from atom_core.models import (  # noqa: E402
    MissingProcessGroupError,
    ParallelContext,
    build_model,
    load_model,
)
from atom_core.models.layers.linear import RowParallelLinear  # noqa: E402
from tests.models import test_parity_llama, test_parity_qwen3_moe  # noqa: E402
from tests.models.moe_parity import build_moe_pair  # noqa: E402
from tests.models.parity_harness import (  # noqa: E402
    BASE_CONFIG,
    PagedRunner,
    check_decode,
    check_ragged_prefill,
    random_tokens,
)

WORLD = 4
PAIRS = ([0, 1], [2, 3])
MOE_CASE = test_parity_qwen3_moe.CASES[1]   # a dense layer and sparse ones, tied head
DENSE_CASE = test_parity_llama.CASES[0]
DENSE_CONFIG = {**BASE_CONFIG, **DENSE_CASE.overrides, "architectures": [DENSE_CASE.architecture]}


# ---- one process ----------------------------------------------------------------------------------------------

def test_a_single_process_loads_and_runs_a_model_without_initializing_or_calling_torch_distributed(
        tmp_path, monkeypatch):
    pair = build_moe_pair(MOE_CASE, tmp_path / "ckpt")

    def called(*args, **kwargs):
        raise AssertionError("a single-process model called torch.distributed")

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single",
                 "get_rank", "get_world_size", "new_group", "init_process_group"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, called)
    model = load_model(pair.path, dtype=torch.float32, device="cpu")
    assert model.parallel == ParallelContext.single() and model.tp_group is None
    with ops.use_backend("torch"):
        check_ragged_prefill(pair, model)
        check_decode(pair, model, 4, num_decode_steps=2)
    assert not dist.is_initialized()


def test_a_shard_built_without_a_group_refuses_to_reduce_naming_the_layer():
    """tp_rank / tp_size with no process group: rank 1's weights and sizes (to inspect), no forward."""
    config = DENSE_CONFIG
    model = build_model(config, device="cpu", dtype=torch.float32, load_format="dummy", tp_rank=1, tp_size=2)
    assert model.parallel == ParallelContext(tp_rank=1, tp_size=2)
    runner = PagedRunner(model, block_size=4, num_blocks=8)
    with pytest.raises(MissingProcessGroupError, match=r"VocabParallelEmbedding is split over 2 ranks but was built "
                                                       r"without a process group.*ParallelContext"):
        runner.step([("s", random_tokens(3, config["vocab_size"], seed=0))])
    layer = RowParallelLinear(4, 3, tp_rank=0, tp_size=2, prefix="model.layers.0.mlp.down_proj")
    with pytest.raises(MissingProcessGroupError, match=r"RowParallelLinear \(model.layers.0.mlp.down_proj\)"):
        layer(torch.zeros(1, 2))
    assert not dist.is_initialized()


def test_context_and_convenience_arguments_together_are_refused(tmp_path):
    config = DENSE_CONFIG
    with pytest.raises(ValueError, match="either parallel= or tp_rank"):
        build_model(config, device="cpu", parallel=ParallelContext(tp_rank=0, tp_size=2), tp_rank=0, tp_size=2)
    with pytest.raises(TypeError, match="parallel must be a ParallelContext"):
        build_model(config, device="cpu", parallel={"tp_size": 2})


def test_the_context_checks_its_ranks_and_is_frozen():
    single = ParallelContext.single()
    assert (single.tp_rank, single.tp_size, single.tp_group, single.ep_size, single.is_single) == (0, 1, None, 1, True)
    ep = ParallelContext(tp_rank=1, tp_size=2, expert_parallel=True, dp_rank=1, dp_size=3)
    assert (ep.ep_rank, ep.ep_size, ep.ep_group, ep.is_single) == (1, 2, None, False)
    assert ep.describe() == "tp 1/2, experts split over the tp ranks, dp 1/3, no process group"
    for bad in ({"tp_rank": 2, "tp_size": 2}, {"tp_size": 0}, {"dp_rank": 1}, {"dp_size": 1.5}):
        with pytest.raises(ValueError, match="tp_|dp_"):
            ParallelContext(**bad)
    with pytest.raises(TypeError, match="expert_parallel must be a bool"):
        ParallelContext(expert_parallel=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        single.tp_size = 2
    with pytest.raises(RuntimeError, match="needs an initialized default process group"):
        ParallelContext.from_world()


# ---- four processes, two tensor-parallel groups -------------------------------------------------------------

def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _check_context_constructors(rank: int, groups) -> None:
    # from_world(tensor_parallel_size=2): TP groups {0, 1}, {2, 3}; DP groups {0, 2}, {1, 3}
    ctx = ParallelContext.from_world(tensor_parallel_size=2)
    assert (ctx.tp_rank, ctx.tp_size, ctx.dp_rank, ctx.dp_size) == (rank % 2, 2, rank // 2, 2)
    assert dist.get_process_group_ranks(ctx.tp_group) == PAIRS[rank // 2]
    assert dist.get_process_group_ranks(ctx.dp_group) == [rank % 2, rank % 2 + 2]
    whole = ParallelContext.from_world()
    assert (whole.tp_rank, whole.tp_size, whole.dp_size) == (rank, WORLD, 1)
    mine = groups[rank // 2]
    with pytest.raises(ValueError, match="has 2 ranks, but it is split over 4"):
        ParallelContext(tp_rank=rank, tp_size=4, tp_group=mine)
    with pytest.raises(ValueError, match=f"this process is rank {rank % 2} of its process group"):
        ParallelContext(tp_rank=1 - rank % 2, tp_size=2, tp_group=mine)
    with pytest.raises(ValueError, match="not a member of its process group"):  # a group this process is not in
        RowParallelLinear(4, 2, tp_rank=0, tp_size=2, tp_group=groups[1 - rank // 2])
    # the convenience arguments split over the whole default group only
    with pytest.raises(ValueError, match=f"this process is rank {rank} of 4 there"):
        build_model(DENSE_CONFIG, device="cpu", load_format="zeros", tp_rank=rank % 2, tp_size=2)


def _subgroup_rank(rank: int, init_file: str, pairs, full_numel: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        groups = [dist.new_group(ranks) for ranks in PAIRS]  # every rank creates every group, in order
        index = rank // 2
        ctx = ParallelContext.from_group(groups[index], expert_parallel=index == 1)
        assert (ctx.tp_rank, ctx.tp_size) == (rank % 2, 2)
        pair = pairs[index]
        model = load_model(pair.path, dtype=torch.float32, device="cpu", parallel=ctx)
        assert model.parallel is ctx and _numel(model) < 0.75 * full_numel, "nothing was split"
        experts = model.model.layers[1].mlp.experts
        assert (experts.ep_size, experts.tp_size) == ((2, 1) if ctx.expert_parallel else (1, 2))
        assert experts.group is groups[index] and model.lm_head.tp_group is groups[index]
        with ops.use_backend("torch"):
            check_ragged_prefill(pair, model)
            check_decode(pair, model, 4, num_decode_steps=3)
        _check_context_constructors(rank, groups)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_tensor_parallel_subgroups_of_a_four_rank_world_each_match_hf_for_their_own_checkpoint(tmp_path):
    pairs = [build_moe_pair(MOE_CASE, tmp_path / f"ckpt{seed}", seed=seed) for seed in (0, 1)]
    full_numel = _numel(pairs[0].load_atom())
    # the two checkpoints differ (else a mixed-up reduction could still give the right logits)
    tokens = random_tokens(6, MOE_CASE.hf_config_kwargs()["vocab_size"], seed=3)
    assert not torch.allclose(pairs[0].hf_logits(tokens), pairs[1].hf_logits(tokens), atol=1e-2)
    # fork: the ranks inherit the HF references; a failing check in any rank raises here (and ends the others)
    mp.start_processes(_subgroup_rank, args=(os.path.join(tmp_path, "init"), pairs, full_numel), nprocs=WORLD,
                       join=True, start_method="fork")
