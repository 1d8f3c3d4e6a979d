"""Expert parallelism by all-to-all (``layers.expert_exchange``): the packing of rows, the token slices and
the exchange choice in one process; then ``FusedMoE(ep_comm="all_to_all")`` over two real ranks (gloo)
against the single-rank layer, for both exchanges, both ``reduce_results``, token counts that do not
divide over the ranks (a rank with no token), SwiGLU and GPT-OSS's biased clamped experts.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atom_core import ops
from atom_core.models.layers.expert_exchange import (
    all_to_all_experts,
    choose_exchange,
    expected_fill,
    local_ids_per_rank,
    pack_rows,
    token_slice,
    unpack_rows,
)
from atom_core.models.layers.moe import FusedMoE, moe_ranks
from atom_core.models.parallel import (
    MissingProcessGroupError,
    ParallelContext,
    ep_comm_of,
)

RANKS = 2
X, H, I, K = 8, 16, 12, 3  # experts, hidden, intermediate, experts per token


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_rows_carry_ids_and_weights_bit_exactly(dtype):
    rows = torch.randn(2, 5, H).to(dtype)
    ids = torch.tensor([[-1, 7, 0]]).expand(2, 5, 3)
    weights = torch.tensor([float("nan"), 1e-30, -3.25]).expand(2, 5, 3)  # any bits survive
    packed = pack_rows(rows, ids, weights)
    assert packed.dtype == dtype and packed.shape == (2, 5, H + 8 * K // rows.element_size())
    got_rows, got_ids, got_weights = unpack_rows(packed.reshape(10, -1), H, K)
    assert torch.equal(got_rows.view(torch.uint8), rows.reshape(10, H).view(torch.uint8))
    assert got_ids.dtype == torch.int32 and torch.equal(got_ids, ids.reshape(10, 3).int())
    assert torch.equal(got_weights.view(torch.int32), weights.reshape(10, 3).view(torch.int32))


def test_token_slices_cover_the_tokens_once():
    for tokens in range(12):
        for ranks in (1, 2, 3, 4):
            slices = [token_slice(tokens, ranks, r) for r in range(ranks)]
            assert [t for start, stop, _ in slices for t in range(start, stop)] == list(range(tokens))
            assert all(stop - start <= n == -(-tokens // ranks) for start, stop, n in slices)


def test_local_ids_per_rank_and_the_expected_fill():
    ids = torch.tensor([[0, 5, -1], [3, 2, 7]])
    assert local_ids_per_rank(ids, 4, 2).tolist() == [[[0, -1, -1], [3, 2, -1]], [[-1, 1, -1], [-1, -1, 3]]]
    assert expected_fill(8, 8, 2) == 1.0 and expected_fill(8, 1, 2) == 0.5
    assert expected_fill(128, 8, 2) > 0.99 and 0.78 < expected_fill(8, 2, 2) < 0.79  # Qwen3-30B-A3B, Mixtral
    assert 0.6 < expected_fill(256, 8, 8) < 0.7                                         # DeepSeek-V3 over 8
    layer = FusedMoE(X, H, I, ep_rank=0, ep_size=2, ep_comm="all_to_all")
    assert choose_exchange(layer, torch.zeros(1, H), 3) == "padded"     # fill 1 - C(4, 3) / C(8, 3) = 0.93
    assert choose_exchange(layer, torch.zeros(1, H), 1) == "exact"      # fill 0.5
    layer.ep_exchange = "padded"
    assert choose_exchange(layer, torch.zeros(1, H), 1) == "padded"


def test_a_forced_exact_exchange_is_refused_by_name_while_a_cuda_graph_is_captured(monkeypatch):
    # (choose_exchange reads only x.is_cuda and the capture state: both stood in for on the CPU)
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    on_gpu = SimpleNamespace(is_cuda=True)
    layer = FusedMoE(X, H, I, ep_rank=0, ep_size=2, ep_comm="all_to_all")
    assert choose_exchange(layer, on_gpu, 1) == "padded"  # auto: padded while capturing, whatever the fill
    layer.ep_exchange = "exact"
    with pytest.raises(RuntimeError, match="ep_exchange='exact'.*capture"):
        choose_exchange(layer, on_gpu, 1)


def test_the_option_names_its_exchange_and_refuses_what_it_cannot_do():
    assert [ep_comm_of(v) for v in (False, True, "all_reduce", "all_to_all")] == \
        [None, "all_reduce", "all_reduce", "all_to_all"]
    with pytest.raises(ValueError, match="one of"):
        ParallelContext(expert_parallel="alltoall")
    assert moe_ranks(1, 2, "all_to_all")["ep_comm"] == "all_to_all" and "ep_comm" not in moe_ranks(1, 2, False)
    with pytest.raises(ValueError, match="intermediate dim"):
        FusedMoE(X, H, I, tp_rank=0, tp_size=2, ep_comm="all_to_all")
    layer = FusedMoE(X, H, I, ep_rank=1, ep_size=2, ep_comm="all_to_all")  # a shard without a group
    with pytest.raises(MissingProcessGroupError, match="FusedMoE"):
        layer(torch.zeros(2, H), torch.ones(2, K), torch.zeros(2, K, dtype=torch.int32))
    assert "all-to-all" in repr(layer)


# ---- two ranks ------------------------------------------------------------------------------------------------

def _layers(activation: str, bias: bool, rank: int | None, group=None, reduce_results=True) -> FusedMoE:
    """The layer with seeded full weights: the whole layer (rank None) or EP rank ``rank``'s half."""
    ranks = {} if rank is None else {"ep_rank": rank, "ep_size": RANKS, "group": group, "ep_comm": "all_to_all"}
    layer = FusedMoE(X, H, I, activation=activation, bias=bias, dtype=torch.float32, reduce_results=reduce_results,
                     **ranks)
    gen = torch.Generator().manual_seed(3)
    for name in ("w13_weight", "w2_weight") + (("w13_bias", "w2_bias") if bias else ()):
        param = getattr(layer, name)
        full = torch.randn((X, *param.shape[1:]), generator=gen) * 0.2
        layer.weight_loader(param, full, None)
    return layer


def _inputs(tokens: int):
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, H, generator=gen)
    logits = torch.randn(tokens, X, generator=gen)
    weights, ids = torch.topk(logits.softmax(-1), K)
    if tokens > 2:
        ids[1] = torch.tensor([0, 1, 2])    # a token whose experts are all on rank 0
        ids[2] = torch.tensor([4, 6, 7])    # ... all on rank 1
    return hidden, weights.float(), ids.int()


def _rank(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        with ops.use_backend("torch"):
            for activation, bias in (("silu", False), ("swiglu_clamped", True)):
                whole = _layers(activation, bias, None)
                for reduce_results in (True, False):
                    mine = _layers(activation, bias, rank, group, reduce_results)
                    for exchange in ("padded", "exact"):
                        mine.ep_exchange = exchange
                        for tokens in (1, 2, 5, 16):
                            hidden, weights, ids = _inputs(tokens)
                            want = whole(hidden, weights, ids)
                            got = mine(hidden.clone(), weights, ids)
                            if not reduce_results:  # a partial sum: the ranks' sum is the layer's output
                                got = ops.all_reduce(got, group)
                            where = f"rank {rank} {activation} reduce={reduce_results} {exchange} T={tokens}"
                            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=where)
                # each rank's own tokens (data-parallel attention): unequal counts (exact), equal ones (padded)
                for exchange, counts in (("exact", (5, 3)), ("exact", (0, 4)), ("padded", (4, 4))):
                    mine.ep_exchange = exchange
                    hidden, weights, ids = _inputs(counts[rank] + 10 * rank)
                    hidden, weights, ids = hidden[:counts[rank]], weights[:counts[rank]], ids[:counts[rank]]
                    got = all_to_all_experts(mine, hidden, weights, ids, group, tokens_replicated=False)
                    torch.testing.assert_close(got, whole(hidden, weights, ids), rtol=1e-5, atol=1e-5,
                                               msg=f"rank {rank} own tokens {exchange} {counts}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_all_to_all_experts_over_two_ranks_equal_the_single_rank_layer(tmp_path):
    mp.start_processes(_rank, args=(os.path.join(tmp_path, "init"),), nprocs=RANKS, join=True, start_method="fork")


# ---- two GPUs, NCCL: eager exchanges, and the padded exchange captured in a CUDA graph and replayed ------------

def _gpu_rank(rank: int, init_file: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=120), device_id=device)
    try:
        group = dist.group.WORLD
        whole = _layers("silu", False, None).to(device, torch.bfloat16)
        mine = _layers("silu", False, rank, group).to(device, torch.bfloat16)

        def inputs(tokens: int, top_k: int, seed: int):
            gen = torch.Generator().manual_seed(seed)  # drawn on the host: the same on both ranks
            hidden = torch.randn(tokens, H, generator=gen).to(device, torch.bfloat16)
            weights, ids = torch.topk(torch.randn(tokens, X, generator=gen).softmax(-1), top_k)
            return hidden, weights.float().to(device), ids.int().to(device)

        def check(got, hidden, weights, ids, where):
            want = whole(hidden, weights, ids).float()
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item(), msg=where)

        for exchange in ("padded", "exact"):
            mine.ep_exchange = exchange
            for tokens in (1, 5, 64):
                hidden, weights, ids = inputs(tokens, K, tokens)
                check(mine(hidden, weights, ids), hidden, weights, ids, f"rank {rank} {exchange} T={tokens}")
        # K = 1: "auto" is exact eagerly (fill 0.5) and must take the padded exchange while capturing
        mine.ep_exchange = "auto"
        static = inputs(8, 1, 100)
        with ops.debug_checks(False):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                mine(*static)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = mine(*static)
            for seed in (101, 102, 103):
                fresh = inputs(8, 1, seed)
                for buffer, value in zip(static, fresh):
                    buffer.copy_(value)
                graph.replay()
                torch.cuda.synchronize(device)
                check(out, *fresh, f"rank {rank} graph replay {seed}")
            graph.reset()  # NCCL destroys a communicator only once the graphs that captured it are gone
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_all_to_all_experts_over_two_gpus_eagerly_and_replayed_from_a_cuda_graph(tmp_path):
    mp.start_processes(_gpu_rank, args=(os.path.join(tmp_path, "init"),), nprocs=RANKS, join=True,
                       start_method="spawn")
