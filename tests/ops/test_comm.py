"""Communication ops (``atom_core.ops.comm``): one rank without torch.distributed, and real collectives over
gloo SUBGROUPS of a four-process world (ranks {0, 1} and {2, 3}), each rank's input a function of its world
rank, so an op that reduced, gathered or exchanged over any other ranks than its group's (the default
group among them) gives other numbers. Eager, under torch.compile (fullgraph) and through opcheck.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atom_core import ops
from atom_core.ops.dispatch import BackendUnavailable

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
WORLD = 4
PAIRS = ([0, 1], [2, 3])


# ---- nominal calls for tests/ops/test_dispatch_cache.py (``ARGS.update(COMM_DISPATCH_ARGS)``) --------------------
# The ops' positional calls as the public functions make them (group None here: the dispatch reads no group).

def _all_reduce_dispatch_args(c):
    return (c.tensor(c.vary(3, 1), c.vary(24, 8), dtype=c.vary(BF16, FP16, FP32)), None)


def _all_gather_dispatch_args(c):
    return (c.tensor(c.vary(3, 1), c.vary(24, 8), dtype=c.vary(BF16, FP16, FP32)), None, c.vary(1, 0))


def _all_to_all_dispatch_args(c):
    rows = c.vary(3, 1)
    splits = c.vary(None, [rows])
    return (c.tensor(rows, c.vary(24, 8), dtype=c.vary(BF16, FP16, FP32)), None, splits, splits)


COMM_DISPATCH_ARGS = {
    "all_reduce": _all_reduce_dispatch_args,
    "all_gather": _all_gather_dispatch_args,
    "all_to_all": _all_to_all_dispatch_args,
}


# ---- one rank: no torch.distributed -------------------------------------------------------------------------------

def test_one_rank_returns_the_input_itself_without_initializing_torch_distributed():
    x = torch.randn(5, 6)
    before = x.clone()
    assert ops.all_reduce(x, None) is x
    assert ops.all_gather(x, None, -1) is x and ops.all_gather(x, None, 0) is x
    assert ops.all_to_all(x, None) is x and ops.all_to_all(x, None, [5], [5]) is x
    assert torch.equal(x, before)
    assert not dist.is_initialized()


def test_a_backend_named_without_a_comm_implementation_is_refused_even_for_one_rank():
    with pytest.raises(BackendUnavailable, match="all_reduce.*no triton implementation"):
        ops.all_reduce(torch.randn(2, 3), None, backend="triton")


@pytest.mark.parametrize("kwargs, match", [
    ({"input_split_sizes": [2, 3]}, r"input_split_sizes must hold 1 sizes"),
    ({"input_split_sizes": [4]}, r"sum to 4, x has 5 rows"),
    ({"output_split_sizes": [3]}, r"receives its own 5 rows"),
])
def test_all_to_all_refuses_splits_that_do_not_fit_in_debug_mode(kwargs, match):
    with ops.debug_checks(), pytest.raises(ValueError, match=match):
        ops.all_to_all(torch.randn(5, 2), None, **kwargs)


def test_all_gather_refuses_a_dim_out_of_range_in_debug_mode():
    with ops.debug_checks(), pytest.raises(ValueError, match="dim=2 is out of range"):
        ops.all_gather(torch.randn(5, 2), None, 2)


def test_the_selftest_cases_pass_on_the_torch_backend():
    from atom_core.ops.selftest_cases_comm import comm_cases

    cases = comm_cases("quick", torch.device("cpu"))
    assert {c.op for c in cases} == {"all_reduce", "all_gather", "all_to_all"}
    for case in cases:
        with ops.debug_checks():
            assert case.check(case.run("torch"), case.run("torch")) is None, case.label


# ---- four processes, two subgroups ------------------------------------------------------------------------------

def _value(world_rank: int, *shape) -> torch.Tensor:
    """Rank w's input: distinct per rank and per element (so sums and orders are recognisable)."""
    return torch.arange(float(torch.Size(shape).numel())).view(shape) + 1000.0 * (world_rank + 1)


def _split_sizes(world_rank: int) -> list[int]:
    """Rows world rank w sends to each of its pair's two ranks (uneven, one of them 0 for rank 3)."""
    return {0: [1, 2], 1: [3, 1], 2: [2, 2], 3: [0, 3]}[world_rank]


def _a2a_rows(src: int, dst_index: int) -> torch.Tensor:
    """The rows world rank ``src`` sends to the rank at ``dst_index`` of its pair: [n, 2], row i = (src, dst, i)."""
    n = _split_sizes(src)[dst_index]
    return torch.tensor([[1000.0 * src + 100 * dst_index + i, float(src)] for i in range(n)]).view(n, 2)


def _check_collectives(rank: int, pair: list[int], group) -> None:
    me = pair.index(rank)
    # all_reduce: the pair's sum; eagerly in place in the (donated) input
    x = _value(rank, 3, 4)
    out = ops.all_reduce(x, group)
    assert out is x
    torch.testing.assert_close(out, sum(_value(r, 3, 4) for r in pair), rtol=0, atol=0)
    # a non-contiguous input is reduced in a contiguous copy
    xt = _value(rank, 4, 3).t()
    torch.testing.assert_close(ops.all_reduce(xt, group), sum(_value(r, 4, 3) for r in pair).t(), rtol=0, atol=0)
    # all_gather along each dim, in group-rank order
    y = _value(rank, 2, 3, 5)
    for dim in (0, 1, 2, -1):
        expected = torch.cat([_value(r, 2, 3, 5) for r in pair], dim=dim)
        assert torch.equal(ops.all_gather(y, group, dim), expected), dim
    # all_to_all, variable splits: what rank j of the pair sent here, in pair order
    sent = torch.cat([_a2a_rows(rank, j) for j in range(2)])
    received = ops.all_to_all(sent, group, [_split_sizes(src)[me] for src in pair], _split_sizes(rank))
    assert torch.equal(received, torch.cat([_a2a_rows(src, me) for src in pair]))
    # all_to_all, equal splits: row block j of every rank goes to rank j
    z = _value(rank, 4, 2)
    assert torch.equal(ops.all_to_all(z, group), torch.cat([_value(src, 4, 2)[2 * me: 2 * me + 2] for src in pair]))
    # what expert parallelism exchanges: int64 counts, bf16 rows whose tail holds int32 ids / fp32 weights as bits
    # (NaN patterns included) that must arrive unchanged, and nothing at all
    counts = torch.tensor([10 * rank, 10 * rank + 1])
    assert ops.all_to_all(counts, group).tolist() == [10 * src + me for src in pair]
    bits = (torch.arange(8, dtype=torch.int32) * 0x10001 + 0x7FC00001 + rank).view(4, 2)   # NaN bit patterns
    rows = bits.view(torch.bfloat16)                                                          # [4, 4] bf16
    got = ops.all_to_all(rows, group).view(torch.int32)
    assert torch.equal(got, torch.cat([(torch.arange(8, dtype=torch.int32) * 0x10001 + 0x7FC00001 + src)
                                       .view(4, 2)[2 * me: 2 * me + 2] for src in pair]))
    assert ops.all_to_all(torch.ones(0, 3), group, [0, 0], [0, 0]).shape == (0, 3)


def _check_compiled(rank: int, pair: list[int], group) -> None:
    def step(a, b, c):
        return (ops.all_reduce(a * 2, group), ops.all_gather(b, group, -1),
                ops.all_to_all(c, group, [2, 2], [2, 2]))

    a, b, c = _value(rank, 3, 4), _value(rank, 2, 3), _value(rank, 4, 2)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # a graph break would raise
    got = compiled(a, b, c)
    want = step(a.clone(), b.clone(), c.clone())
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # the custom ops are functional: opcheck (schema, fake tensors, no mutation of the inputs)
    name = group.group_name
    torch.library.opcheck(torch.ops.atom_core.all_reduce.default, (a, name, None))
    torch.library.opcheck(torch.ops.atom_core.all_gather.default, (b, name, 2, 1, None))
    torch.library.opcheck(torch.ops.atom_core.all_to_all.default, (c, name, [2, 2], [2, 2], None))
    assert torch.equal(a, _value(rank, 3, 4))


def _worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        groups = [dist.new_group(ranks) for ranks in PAIRS]  # every rank creates every group
        pair = PAIRS[rank // 2]
        group = groups[rank // 2]
        _check_collectives(rank, pair, group)
        _check_compiled(rank, pair, group)
        # the one-shot path is CUDA only: a gloo group stays on torch.distributed (the sum in place)
        assert not ops.comm.enable_one_shot_all_reduce(group, FP32, "cpu")
        x = _value(rank, 4, 8)
        assert ops.all_reduce(x, group) is x
        # an entry left under this group's name by another group (destroyed, never disabled) is not used
        from atom_core.ops.comm import _ONE_SHOT, _OneShot

        _ONE_SHOT[group.group_name] = _OneShot(torch.empty(1024, dtype=FP32), object())
        try:
            x = torch.ones(4, 8)
            assert ops.all_reduce(x, group) is x and torch.equal(x, torch.full_like(x, 2))
            ops.comm.disable_one_shot_all_reduce(group)  # (not this group's: left alone)
            assert group.group_name in _ONE_SHOT
        finally:
            _ONE_SHOT.pop(group.group_name, None)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_collectives_over_subgroups_of_a_four_rank_world_combine_only_their_group(tmp_path):
    # spawn, not fork: torch.compile in a rank reads the CUDA RNG state, which a child forked from a process that
    # has used CUDA (any earlier GPU test) cannot; a failure in any rank raises here (and ends the others)
    mp.start_processes(_worker, args=(os.path.join(tmp_path, "init"),), nprocs=WORLD, join=True, start_method="spawn")


# ---- the one-shot all-reduce (CUDA, two GPUs) ---------------------------------------------------------------------

def test_one_shot_rule_takes_only_contiguous_aligned_messages_of_its_dtype_up_to_its_buffer():
    from atom_core.ops.comm import _OneShot

    one_shot = _OneShot(torch.empty(1024, dtype=BF16), None)
    flat = torch.empty(4096, dtype=BF16)
    assert one_shot.serves(flat[:1024]) and one_shot.serves(flat[8:16].view(2, 4))
    assert not one_shot.serves(flat[:1025])                      # more than the buffer
    assert not one_shot.serves(flat[:0])                         # nothing to sum
    assert not one_shot.serves(flat[:64].to(FP32))               # another dtype
    assert not one_shot.serves(flat[:64].view(8, 8).t())         # not contiguous
    assert not one_shot.serves(flat[1:65])                       # 2-byte offset: not 16-byte aligned


def test_one_shot_is_off_for_one_rank_without_touching_torch_distributed():
    assert not ops.comm.enable_one_shot_all_reduce(None, BF16, "cuda")
    assert not dist.is_initialized()


def _one_shot_gpu_rank(rank: int, init_dir: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    # Two worlds one after the other in the same processes (as two engines in one process): the second
    # world's group has the first one's name, which torch's symmetric memory still knows: it stays on NCCL.
    for world in range(2):
        dist.init_process_group("nccl", init_method=f"file://{init_dir}/init{world}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60), device_id=device)
        try:
            group = dist.new_group([0, 1])
            if world == 0:
                _check_one_shot(rank, group, device)
            else:
                assert not ops.comm.enable_one_shot_all_reduce(group, BF16, device)
                x = torch.ones(8, dtype=BF16, device=device)
                assert ops.all_reduce(x, group) is x and torch.equal(x, torch.full_like(x, 2))
        finally:
            dist.destroy_process_group()


def _check_one_shot(rank: int, group, device) -> None:
    assert not ops.comm.enable_one_shot_all_reduce(group, FP16, device)      # torch's kernel sums bf16 / fp32
    assert not ops.comm.enable_one_shot_all_reduce(group, BF16, device, want=rank == 0)  # one rank says no
    assert ops.comm.enable_one_shot_all_reduce(group, BF16, device)
    limit = ops.comm.one_shot_max_bytes(2) // 2                               # bf16 elements
    for numel in (4096, limit, limit + 8):
        x = torch.arange(numel, device=device).remainder(61).to(BF16) * (rank + 1)
        want = torch.arange(numel, device=device).remainder(61).to(BF16) * 3
        got = ops.all_reduce(x, group)
        assert torch.equal(got, want), numel
        assert (got is not x) == (numel <= limit), numel                     # one-shot: a new tensor; NCCL: x
    # captured in a CUDA graph, replayed with new inputs
    static = torch.zeros(16, 4096, dtype=BF16, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        ops.all_reduce(static.clone(), group)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.all_reduce(static.clone(), group)
    for step in range(3):
        static.copy_(torch.full_like(static, step + rank))
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(out, torch.full_like(out, 2 * step + 1)), step
    del graph
    ops.comm.disable_one_shot_all_reduce(group)
    x = torch.ones(8, dtype=BF16, device=device)
    assert ops.all_reduce(x, group) is x and torch.equal(x, torch.full_like(x, 2))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_shot_all_reduce_sums_small_messages_eagerly_and_in_a_cuda_graph_and_leaves_the_rest_to_nccl(tmp_path):
    mp.start_processes(_one_shot_gpu_rank, args=(str(tmp_path),), nprocs=2, join=True, start_method="spawn")
