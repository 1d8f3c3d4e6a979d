"""Whole models split over two real ranks (two processes, gloo): each rank loads its shard of the
HF checkpoint with ``load_model(parallel=ParallelContext.from_world())`` and both must give HF's logits.
The MoE models also run with ``expert_parallel=True`` (each rank holds half the experts, whole, and one
all-reduce combines them), and two families with ``expert_parallel="all_to_all"`` (tokens sent to the rank
holding their experts, both the padded and the exact exchange, ``layers.expert_exchange``). The FP8
tests load through the ``tp_rank=`` / ``tp_size=`` convenience (a context over the default group); the
same models over subgroups of a larger world: tests/models/test_parallel_context.py.

One config per architecture family, chosen so the split is not trivial: KV heads split and
replicated (MQA), a vocabulary that does not divide (padded), an odd dense intermediate size
split in halves, expert intermediate sizes split, shared experts, tied heads, attention sinks.

FP8 with 128 x 128 block scales (an HF ``fp8`` checkpoint, ``quant_checkpoints``): each rank's
logits match the single-rank quantized model's.
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
from atom_core.models import ParallelContext, load_model  # noqa: E402
from atom_core.models.layers.moe import FusedMoE
from tests.models import (  # noqa: E402
    test_parity_gemma2,
    test_parity_glm4_moe,
    test_parity_gpt_oss,
    test_parity_llama,
    test_parity_mixtral,
    test_parity_phi3,
    test_parity_qwen2,
    test_parity_qwen3,
    test_parity_qwen3_moe,
)
from tests.models.moe_parity import build_moe_pair  # noqa: E402
from tests.models.parity_harness import (
    PagedRunner,
    ParityCase,
    check_decode,
    check_ragged_prefill,
    random_tokens,
)

TP = 2
DENSE_CASES = [
    test_parity_llama.CASES[0],
    test_parity_qwen3.CASES[0],          # 2 KV heads: one per rank
    test_parity_qwen3.CASES[2],          # MQA (a replicated KV head), intermediate 100, hidden 48
    test_parity_gemma2.CASES[1],         # MQA, the embedding scale after the all-reduce, capped gathered logits
    test_parity_qwen2.CASES[0],          # q/k/v biases split with the heads, o_proj without one
    test_parity_phi3.CASES[0],           # fused qkv_proj / gate_up_proj checkpoint tensors cut per rank
    test_parity_phi3.CASES[2],           # MQA (the KV head replicated out of the fused qkv), partial rotary
]
MOE_CASES = [
    test_parity_qwen3_moe.CASES[1],      # a dense layer and sparse ones, tied head
    test_parity_mixtral.CASES[0],
    test_parity_glm4_moe.CASES[1],       # shared experts, QK norm, partial rotary, tied head
    test_parity_gpt_oss.CASES[0],        # sinks split with the heads, sliding layers, expert biases
]
ALL_TO_ALL_CASES = [
    test_parity_qwen3_moe.CASES[1],
    test_parity_gpt_oss.CASES[0],        # expert biases (added once per expert, by its owner), clamped SwiGLU
]
RUNS = ([(case, False) for case in DENSE_CASES + MOE_CASES] + [(case, True) for case in MOE_CASES]
        + [(case, "all_to_all") for case in ALL_TO_ALL_CASES])


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _rank(rank: int, init_file: str, pair, full_numel: int, expert_parallel: bool | str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP,
                            timeout=datetime.timedelta(seconds=120))
    try:
        parallel = ParallelContext.from_world(expert_parallel=expert_parallel)
        assert (parallel.tp_rank, parallel.tp_size, parallel.tp_group) == (rank, TP, dist.group.WORLD)
        model = load_model(pair.path, dtype=torch.float32, device="cpu", parallel=parallel)
        assert _numel(model) < 0.75 * full_numel, "this rank holds most of the model: nothing was split"
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        # all-to-all: the padded exchange for the prefill, the exact one for the decode steps
        checks = (("padded", lambda: check_ragged_prefill(pair, model)),
                  ("exact", lambda: check_decode(pair, model, 4, num_decode_steps=3)))
        for exchange, check in checks:
            if expert_parallel == "all_to_all":
                assert experts and all(e.ep_comm == "all_to_all" for e in experts)
                for e in experts:
                    e.ep_exchange = exchange
            with ops.use_backend("torch"):
                check()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
@pytest.mark.parametrize("case, expert_parallel", RUNS,
                         ids=[f"{c.hf_family}-{c.name}{'-ep' if ep is True else '-ep-a2a' if ep else ''}"
                              for c, ep in RUNS])
def test_two_ranks_match_hf(case, expert_parallel, tmp_path):
    pair = build_moe_pair(case, tmp_path / "ckpt")
    full_numel = _numel(pair.load_atom())
    # fork: the ranks inherit the HF reference model; a failing check in either rank raises here
    mp.start_processes(_rank, args=(os.path.join(tmp_path, "init"), pair, full_numel, expert_parallel), nprocs=TP, join=True,
                       start_method="fork")


def test_expert_parallel_splits_whole_experts_and_needs_experts(tmp_path):
    """(No collectives: construction only, a shard without a process group.) EP rank 1 of 2 holds experts
    2..3 of 4 with the full intermediate size; a dense model refuses the flag."""
    pair = build_moe_pair(test_parity_mixtral.CASES[0], tmp_path / "moe")
    model = load_model(pair.path, device="cpu", tp_rank=1, tp_size=2, expert_parallel=True)
    experts = model.model.layers[0].mlp.experts
    hf_experts = pair.hf_model.model.layers[0].mlp.experts
    assert experts.shard.expert_start == 2 and experts.w13_weight.shape[0] == 2
    assert torch.equal(experts.w2_weight, hf_experts.down_proj[2:4])
    dense = build_moe_pair(test_parity_llama.CASES[0], tmp_path / "dense")
    with pytest.raises(ValueError, match="no experts to split"):
        load_model(dense.path, device="cpu", tp_rank=0, tp_size=2, expert_parallel=True)


# --- FP8 block scales over two ranks ---------------------------------------------------------------------------

def _prefill_then_decode(model) -> torch.Tensor:
    """Logits of a ragged prefill of three prompts, then two decode steps of all three (one tensor)."""
    runner = PagedRunner(model, block_size=4, num_blocks=48, seed=1)
    prompts = [random_tokens(n, 101, seed=50 + i) for i, n in enumerate((9, 3, 14))]
    outs = runner.step([(f"s{i}", p) for i, p in enumerate(prompts)])
    for step in range(2):
        outs += runner.step([(f"s{i}", [7 + step + i]) for i in range(3)])
    return torch.cat(outs)


def _fp8_block_rank(rank: int, init_file: str, path, expected: torch.Tensor) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP,
                            timeout=datetime.timedelta(seconds=120))
    try:
        model = load_model(path, dtype=torch.float32, device="cpu", tp_rank=rank, tp_size=TP)
        layer = model.model.layers[0]
        # this rank's 128-blocks: qkv rows (512 + 2 * 256) / 2, o_proj columns 512 / 2, down_proj columns 256 / 2
        assert tuple(layer.self_attn.qkv_proj.weight_scale.shape) == (4, 2)
        assert tuple(layer.self_attn.o_proj.weight_scale.shape) == (2, 2)
        assert tuple(layer.mlp.down_proj.weight_scale.shape) == (2, 1)
        with ops.use_backend("torch"):
            actual = _prefill_then_decode(model)
        # The ranks quantize the same 1 x 128 activation groups with the same block scales as one rank,
        # so a row's logits differ by fp32 summation order (the all-reduce: ~1e-6) unless that order
        # flips one activation's FP8 rounding (a value within ~1e-7 of a rounding boundary): that
        # element then moves by one FP8 step (2**-3 of its value) and carries it through the later
        # layers. Measured: 31 of 32 rows within 1.4e-6, one row 1.3e-2 (0.3% of the logit scale).
        # Allowed: 7 rows in 8 at fp32 precision, every row within 2% of the logit scale (a wrong
        # block, scale or split moves logits by tens of percent).
        scale = expected.abs().max().item()
        row_diff = (actual - expected).abs().amax(dim=1)
        at_fp32 = row_diff <= 1e-4 * max(1.0, scale)
        assert at_fp32.float().mean() >= 7 / 8, f"rank {rank}: rows off by more than fp32 noise: {row_diff.tolist()}"
        assert (row_diff <= 0.02 * scale).all(), f"rank {rank}: a row off by more than one rounding flip: " \
                                                 f"{row_diff.max().item():.3g} of {scale:.3g}"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_ranks_with_fp8_block_scales_match_the_single_rank_quantized_model(tmp_path):
    pytest.importorskip("compressed_tensors")
    from tests.models import quant_checkpoints as qc

    path = qc.hf_fp8_block_checkpoint(qc.hf_model("qwen3", qc.ALIGNED), tmp_path / "ckpt",
                                      architecture="Qwen3ForCausalLM")
    with ops.use_backend("torch"):
        expected = _prefill_then_decode(load_model(path, dtype=torch.float32, device="cpu"))
    mp.start_processes(_fp8_block_rank, args=(os.path.join(tmp_path, "init"), path, expected), nprocs=TP, join=True,
                       start_method="fork")


# --- FP8 block experts over two ranks ----------------------------------------------------------------------------

# Layer 0 dense, layer 1 sparse: 4 experts of intermediate 256 = two 128-blocks, one per TP rank.
FP8_MOE = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 128, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
           "mlp_only_layers": [0], "norm_topk_prob": True}


def _fp8_block_moe_rank(rank: int, init_file: str, path, expected: torch.Tensor, expert_parallel: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP,
                            timeout=datetime.timedelta(seconds=120))
    try:
        model = load_model(path, dtype=torch.float32, device="cpu", tp_rank=rank, tp_size=TP,
                           expert_parallel=expert_parallel)
        experts = model.model.layers[1].mlp.experts
        assert experts.weight_format == "fp8_block"
        # TP: every expert, its 128 intermediate units (one row block of gate, one of up, over 2 column blocks
        # of H; one column block of down); EP: 2 whole experts, [gate; up] of 256 rows each = 4 row blocks,
        # down 2 x 2 blocks.
        w13_blocks, w2_blocks = ((4, 2, 2), (4, 2, 1)) if not expert_parallel else ((2, 4, 2), (2, 2, 2))
        assert tuple(experts.w13_weight_scale.shape) == w13_blocks and tuple(experts.w2_weight_scale.shape) == w2_blocks
        with ops.use_backend("torch"):
            actual = _prefill_then_decode(model)
        # The tolerance argument of _fp8_block_rank holds here too: same 1 x 128 activation groups (a TP rank's
        # 128 intermediate units are one group of the single rank's), same block scales.
        scale = expected.abs().max().item()
        row_diff = (actual - expected).abs().amax(dim=1)
        at_fp32 = row_diff <= 1e-4 * max(1.0, scale)
        assert at_fp32.float().mean() >= 7 / 8, f"rank {rank}: rows off by more than fp32 noise: {row_diff.tolist()}"
        assert (row_diff <= 0.02 * scale).all(), f"rank {rank}: a row off by more than one rounding flip: " \
                                                 f"{row_diff.max().item():.3g} of {scale:.3g}"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_ranks_with_fp8_block_experts_match_the_single_rank_quantized_model(tmp_path):
    """A Qwen3-MoE compressed-tensors FP8_BLOCK checkpoint (experts and dense layers) over TP 2, then EP 2:
    each rank's logits match the single-rank quantized model's."""
    pytest.importorskip("compressed_tensors")
    from tests.models import quant_checkpoints as qc
    from tests.models.parity_harness import ParityCase

    case = ParityCase("fp8_block_moe", "qwen3_moe", "Qwen3MoeForCausalLM", FP8_MOE)
    pair = build_moe_pair(case, tmp_path / "fp32")
    path = qc.ct_tree_checkpoint(pair.path, tmp_path / "ckpt", "FP8_BLOCK")
    with ops.use_backend("torch"):
        expected = _prefill_then_decode(load_model(path, dtype=torch.float32, device="cpu"))
    for expert_parallel in (False, True):
        mp.start_processes(_fp8_block_moe_rank, args=(os.path.join(tmp_path, f"init{int(expert_parallel)}"), path,
                                                      expected, expert_parallel),
                           nprocs=TP, join=True, start_method="fork")


# --- eight ranks: KV heads replicated 4 ways, a padded vocabulary, one expert pair each (one spawn) ---------------

# 8 query heads over 2 KV heads (each KV head on 4 ranks), vocabulary 101 padded to 104, intermediate 96 = 8 x 12;
# 16 experts of top-4: 2 whole experts per rank under EP.
WIDE = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 96}
EIGHT_RANK_RUNS = [
    (ParityCase("gqa4_wide", "qwen3", "Qwen3ForCausalLM", WIDE), False),
    (ParityCase("e16_k4_wide", "qwen3_moe", "Qwen3MoeForCausalLM",
                {**WIDE, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 24,
                 "norm_topk_prob": True}), "all_reduce"),
]


def _eight_rank(rank: int, init_file: str, pairs, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for pair, expert_parallel, full_numel in pairs:
            modes = ["all_reduce", "all_to_all"] if expert_parallel else [False]
            for mode in modes:
                parallel = ParallelContext.from_world(expert_parallel=mode)
                assert (parallel.tp_rank, parallel.tp_size) == (rank, world)
                model = load_model(pair.path, dtype=torch.float32, device="cpu", parallel=parallel)
                assert _numel(model) < 0.5 * full_numel, "this rank holds most of the model: nothing was split"
                attn = model.model.layers[0].self_attn
                assert attn.qkv_proj.shard.kv_replicas == world // 2, "each KV head on world / 2 ranks"
                experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
                assert all(e.w13_weight.shape[0] == 16 // world and e.ep_comm == mode for e in experts)
                for e in experts:  # all-to-all: the padded exchange for the prefill, the exact one for the decode
                    e.ep_exchange = "padded"
                with ops.use_backend("torch"):
                    check_ragged_prefill(pair, model, lengths=(1, 7, 4))
                    for e in experts:
                        e.ep_exchange = "exact"
                    check_decode(pair, model, 4, num_decode_steps=2)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_eight_ranks_match_hf_dense_and_moe_in_both_expert_exchanges(tmp_path):
    """One spawn of eight forked gloo ranks runs a dense Qwen3 (TP 8) and a Qwen3-MoE (EP 8, all-reduce, then
    all-to-all) against HF: ragged prefill and decode steps. (The engine over 4 ranks:
    tests/engine/test_multi_rank.py; the engine's code is the same for any N.) Measured on 2 shared cores:
    2.4 - 3.6 s (9 - 10 s with other work on the cores)."""
    world = 8
    pairs = []
    for case, expert_parallel in EIGHT_RANK_RUNS:
        pair = build_moe_pair(case, tmp_path / case.name)
        pairs.append((pair, expert_parallel, _numel(pair.load_atom())))
    mp.start_processes(_eight_rank, args=(os.path.join(tmp_path, "init"), pairs, world), nprocs=world, join=True,
                       start_method="fork")


# --- DeepSeek-V3 FP8 (128 x 128 blocks) over four ranks ----------------------------------------------------------

# The v3 case of test_quant_deepseek with 16 heads and 512-wide MLPs, so that each of 4 ranks holds whole 128-blocks:
# q_b_proj 16 x (32 + 32) / 4 = 256 rows, kv_b_proj 16 x (32 + 32) / 4 = 256 rows, o_proj 16 x 32 / 4 = 128 columns,
# the dense MLP's and each expert's (and the shared expert's) 512 intermediate units / 4 = 128. q_a_proj (192 rows)
# and kv_a_proj_with_mqa (160 + 32 rows) are replicated, with their partial blocks.
DEEPSEEK_TP4 = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 16, "num_key_value_heads": 16,
                "kv_lora_rank": 160, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
                "q_lora_rank": 192, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
                "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                "norm_topk_prob": True, "routed_scaling_factor": 2.5}


def _deepseek_fp8_rank(rank: int, init_file: str, path, full, expected: torch.Tensor, world: int) -> None:
    from tests.models.test_quant_checkpoints import effective_weight

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        model = load_model(path, dtype=torch.float32, device="cpu", tp_rank=rank, tp_size=world)
        for i, (block, full_block) in enumerate(zip(model.model.layers, full.model.layers)):
            attn, full_attn = block.self_attn, full_block.self_attn
            assert attn.num_heads == 16 // world
            heads = slice(rank * attn.num_heads, (rank + 1) * attn.num_heads)
            for got, want in zip(attn.absorbed_weights(), full_attn.absorbed_weights()):  # w_uk, w_uv
                assert torch.equal(got, want[heads]), f"layer {i}: this rank's heads of kv_b_proj"
            rows = full_attn.q_b_proj.weight.shape[0] // world
            assert torch.equal(effective_weight(attn.q_b_proj),
                               effective_weight(full_attn.q_b_proj)[rank * rows:(rank + 1) * rows]), f"layer {i}"
            cols = full_attn.o_proj.weight.shape[1] // world
            assert torch.equal(effective_weight(attn.o_proj),
                               effective_weight(full_attn.o_proj)[:, rank * cols:(rank + 1) * cols]), f"layer {i}"
            assert tuple(attn.o_proj.weight_scale.shape) == (2, 1)  # 256 rows x 128 columns: whole blocks
        experts = model.model.layers[1].mlp.experts
        assert experts.weight_format == "fp8_block"
        assert tuple(experts.w13_weight_scale.shape) == (4, 2, 2) and tuple(experts.w2_weight_scale.shape) == (4, 2, 1)
        with ops.use_backend("torch"):
            actual = _prefill_then_decode(model)
        # The tolerance argument of _fp8_block_rank: same 1 x 128 activation groups, same block scales; a row
        # differs by fp32 summation order unless that order flips one activation's FP8 rounding.
        scale = expected.abs().max().item()
        row_diff = (actual - expected).abs().amax(dim=1)
        at_fp32 = row_diff <= 1e-4 * max(1.0, scale)
        assert at_fp32.float().mean() >= 7 / 8, f"rank {rank}: rows off by more than fp32 noise: {row_diff.tolist()}"
        assert (row_diff <= 0.02 * scale).all(), f"rank {rank}: a row off by more than one rounding flip: " \
                                                 f"{row_diff.max().item():.3g} of {scale:.3g}"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_four_ranks_of_a_deepseek_v3_fp8_block_checkpoint_match_the_single_rank_model(tmp_path):
    """A DeepSeek-V3 FP8 checkpoint stored as the releases are (``quant_checkpoints.deepseek_fp8_checkpoint``)
    over TP 4 (forked gloo ranks): each rank's MLA pieces are its heads' rows / columns of the one-rank model's,
    and its logits (ragged prefill, decode) match the one-rank FP8 model's. Measured on 2 shared cores: 1 - 3 s."""
    pytest.importorskip("compressed_tensors")
    from tests.models import quant_checkpoints as qc
    from tests.models.test_parity_deepseek import build_deepseek_pair

    pair = build_deepseek_pair(ParityCase("v3_tp4", "deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK_TP4),
                               tmp_path / "fp32")
    path = qc.deepseek_fp8_checkpoint(pair.path, tmp_path / "fp8")
    full = load_model(path, dtype=torch.float32, device="cpu")
    with ops.use_backend("torch"):
        expected = _prefill_then_decode(full)
    mp.start_processes(_deepseek_fp8_rank, args=(os.path.join(tmp_path, "init"), path, full, expected, 4), nprocs=4,
                       join=True, start_method="fork")
