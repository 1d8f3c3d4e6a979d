"""Sort the (token, slot) choices of a routing by expert and pad each expert's list to a multiple of
BLOCK_M, so a grouped GEMM can give every program BLOCK_M rows of ONE expert.

All on the device in one single-program kernel — no host sync, so the MoE is CUDA-graph capturable —
into buffers whose sizes depend only on the shapes:

* ``sorted_entries`` int32 [max_padded]: flat choice indices ``t * K + k``, expert by expert, each
  expert's run padded with ``T * K`` (the "no row" sentinel) to a multiple of BLOCK_M;
* ``block_experts`` int32 [max_blocks]: the expert of each BLOCK_M block, -1 past the end;
* ``num_padded`` int32 [1]: the used length of ``sorted_entries``.

``max_padded = N + min(E, N) * (BLOCK_M - 1)`` with N = T * K: at most min(E, N) experts are hit and
each wastes fewer than BLOCK_M slots. Within an expert the order of entries is unspecified (slots are
claimed with atomics); each row of the GEMM is computed on its own, so the order changes no result.
Ids outside [0, E) are left out: they reach no expert.

:func:`block_of` gives a GEMM program its block: from these buffers, or, for a batch of at most BLOCK_M
choices, from the routing ids themselves (the same blocks, sorted in the program; no launch here).
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2

_BLOCK_ROWS = 32  # blocks labelled per loop step


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def align_sizes(num_entries: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(max_padded, max_blocks) for N = ``num_entries`` choices: the static buffer sizes."""
    max_padded = num_entries + min(num_experts, num_entries) * (block_m - 1)
    return max_padded, cdiv(max_padded, block_m)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_config(num_entries: int, num_experts: int) -> tuple[int, int, int, int]:
    """(EXPERTS_P2, BLOCK_ROWS, CHUNK, num_warps) of the single-program align kernel: 8 warps, entries
    1,024 a loop step up to 1,024 of them, else 2,048 (the fastest of 4 / 8 / 16 warps by 1,024 / 2,048 on
    an H200 from 8 to 32,768 entries; docs/benchmarks.md)."""
    experts_p2 = next_power_of_2(num_experts)
    return experts_p2, max(1, min(_BLOCK_ROWS, 8192 // experts_p2)), 1024 if num_entries <= 1024 else 2048, 8


@triton.jit
def _moe_align_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, cursor_ptr,
    num_entries, num_experts, max_padded, max_blocks,
    BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    experts = tl.arange(0, EXPERTS_P2)
    expert_ok = experts < num_experts
    chunk = tl.arange(0, CHUNK)

    # 1. count the choices of each expert (a histogram in the program; left-out ids counted in bin 0, then
    #    taken back out)
    counts = tl.zeros([EXPERTS_P2], dtype=tl.int32)
    for start in range(0, num_entries, CHUNK):
        entry = start + chunk
        ids = tl.load(ids_ptr + entry, mask=entry < num_entries, other=-1)
        hit = (entry < num_entries) & (ids >= 0) & (ids < num_experts)
        misses = tl.sum((~hit).to(tl.int32), axis=0)
        counts += tl.histogram(tl.where(hit, ids, 0).to(tl.int32), EXPERTS_P2) - tl.where(experts == 0, misses, 0)

    # 2. padded run of each expert: [starts[e], ends[e])
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(cursor_ptr + experts, starts, mask=expert_ok)

    # 3. the expert of block b is the number of experts whose run ends at or before b * BLOCK_M
    #    (empty runs before it included); blocks past `total` get -1.
    for first in range(0, max_blocks, BLOCK_ROWS):
        block = first + tl.arange(0, BLOCK_ROWS)
        row = block * BLOCK_M
        before = (ends[None, :] <= row[:, None]) & expert_ok[None, :]
        owner = tl.sum(before.to(tl.int32), axis=1)
        tl.store(block_experts_ptr + block, tl.where(row < total, owner, -1), mask=block < max_blocks)

    # 4. padding everywhere, then each choice claims the next slot of its expert's run (relaxed atomics: the
    #    barrier orders them after the cursors' and the padding's stores)
    for start in range(0, max_padded, CHUNK):
        slot = start + chunk
        tl.store(sorted_ptr + slot, tl.full([CHUNK], 0, tl.int32) + num_entries, mask=slot < max_padded)
    tl.debug_barrier()
    for start in range(0, num_entries, CHUNK):
        entry = start + chunk
        ids = tl.load(ids_ptr + entry, mask=entry < num_entries, other=-1)
        hit = (entry < num_entries) & (ids >= 0) & (ids < num_experts)
        slot = tl.atomic_add(cursor_ptr + ids, 1, mask=hit, sem="relaxed")
        tl.store(sorted_ptr + slot, entry, mask=hit)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, K] int32/int64 → ``(sorted_entries [max_padded], block_experts [max_blocks],
    num_padded [1])``, all int32 on topk_ids' device (see the module docstring)."""
    ids = topk_ids.reshape(-1)  # flat choice index t * K + k
    num_entries = ids.numel()
    max_padded, max_blocks = align_sizes(num_entries, num_experts, block_m)
    device = topk_ids.device
    sorted_entries = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    experts_p2, block_rows, chunk, num_warps = _launch_config(num_entries, num_experts)
    _moe_align_kernel[(1,)](
        ids, sorted_entries, block_experts, num_padded, cursor,
        num_entries, num_experts, max_padded, max_blocks,
        BLOCK_M=block_m, EXPERTS_P2=experts_p2, CHUNK=chunk, BLOCK_ROWS=block_rows, num_warps=num_warps,
        **launch_kwargs(topk_ids, topk_ids.shape[0]),
    )
    return sorted_entries, block_experts, num_padded


@triton.jit
def block_of(pid_m, sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr, stride_it, stride_ik, num_entries,
             num_experts, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, SORT_HERE: tl.constexpr):
    """(expert, entries [BLOCK_M]) of M block pid_m of the fused-MoE GEMMs (``fused_moe``); expert -1: no such
    block (the program returns). Entries are choice indices t * K + k, num_entries past the block's rows.

    From :func:`moe_align`'s buffers, or with SORT_HERE (a batch of at most BLOCK_M choices, so that no expert
    has more rows than one block) from topk_ids itself: block b is the b-th distinct valid expert in choice
    order, and its rows are the choices that picked it, in order. Every program derives its own block from the
    BLOCK_M ids (a [BLOCK_M, BLOCK_M] comparison), so a small batch needs no sort launch."""
    rows = tl.arange(0, BLOCK_M)
    if SORT_HERE:
        ids = tl.load(ids_ptr + (rows // TOP_K) * stride_it + (rows % TOP_K) * stride_ik, mask=rows < num_entries,
                      other=-1)
        valid = (ids >= 0) & (ids < num_experts)
        repeats = tl.sum(((ids[:, None] == ids[None, :]) & (rows[None, :] < rows[:, None])).to(tl.int32), axis=1)
        first = valid & (repeats == 0)  # the expert's first choice
        rank = tl.cumsum(first.to(tl.int32), axis=0) - 1
        expert = tl.max(tl.where(first & (rank == pid_m), ids, -1), axis=0)
        hit = valid & (ids == expert)
        slot = tl.cumsum(hit.to(tl.int32), axis=0) - 1  # the row of each choice of this block
        match = hit[None, :] & (slot[None, :] == rows[:, None])  # [row, choice]
        entry = tl.where(tl.sum(match.to(tl.int32), axis=1) > 0, tl.sum(tl.where(match, rows[None, :], 0), axis=1),
                         num_entries)
    else:
        expert = tl.where(pid_m * BLOCK_M < tl.load(num_padded_ptr), tl.load(block_experts_ptr + pid_m), -1)
        entry = tl.load(sorted_ptr + pid_m * BLOCK_M + rows)
    return expert, entry
