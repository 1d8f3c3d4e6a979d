"""Triton top-k of fp32 score rows by radix select over many programs a row (the DSA indexer's top-k).

``torch.topk`` gives each row to one thread block: a decode step's one 32k-wide row with K = 2048 took
0.06 ms on an H200, longer than the dense MLA decode it is meant to beat. Here each row is cut into
chunks of CHUNK scores, one program a chunk, and the K-th largest score is found digit by digit:

1. Scores become uint32 keys that order as the floats do (``_keys``). A score of -inf is not visible
   (the score kernel's mark) and is never selected.
2. Four histogram passes (``_histogram_kernel``), one byte of the key each, from the top: pass d counts
   the d-th byte of the visible keys whose higher bytes equal the prefix decided so far. Programs add
   their chunk's counts into the row's ``state`` with atomics. Every later program derives the decided
   prefix from the histograms before it (``_decided``): the byte where the count of keys at or above it
   reaches the number still wanted. After four passes the prefix is the K-th largest key itself
   (``threshold``), with ``above`` keys greater than it and ``wanted`` of the keys equal to it to take.
3. A count pass (``_count_kernel``) stores each chunk's number of keys above and equal to the threshold.
4. The select pass (``_select_kernel``) gives each kept position its slot s in position order, from the
   counts of the chunks before it: the keys above the threshold in slots [0, above), the first ``wanted``
   equal ones (in position order) after them. A row that keeps K positions stores slot s at
   ``(s * spread) % K`` (``spread_for``: coprime with K, so every slot is filled once); a row that keeps
   fewer stores them in order and -1 after them.

So the choice is exact (no score below a left-out one), ties at the threshold go to the earliest
positions, and the output is the same from run to run. Why the spread: the sparse attention reads the
selection in its order, 64 entries a tile, and at bs 64 × 32k took 0.2450 ms on position order against
0.2314 on this spread (0.2298 on a random shuffle, 0.2288 on ``torch.topk``'s score order; an H200,
docs/benchmarks.md).
Everything is sized from the row width and the token count (CUDA-graph capturable). ``state`` must be
zero when the first pass starts.

Legend: T = score rows (query tokens), W = row width, K = top-k, P = chunks a row.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2

BITS = 8  # key bits a histogram pass decides
BINS = 1 << BITS
PASSES = 32 // BITS
HISTOGRAM_INTS = PASSES * BINS  # a state row: the pass histograms, then (above, equal) a chunk
_COUNTS_AT = tl.constexpr(HISTOGRAM_INTS)  # (the kernels' name for it)
MAX_CHUNK = 4096
MIN_CHUNK = 512
PROGRAMS_PER_SM = 2
SPREAD = 45  # consecutive slots of a full row hold positions ~45 slots apart in position order (module docstring)


def state_width(width: int, chunk: int) -> int:
    """int32 values of one row's state: the histograms, then two counts a chunk."""
    return HISTOGRAM_INTS + 2 * cdiv(width, chunk)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def spread_for(keep: int) -> int:
    """The stride of a full row's slots: the first integer from ``SPREAD`` coprime with ``keep`` (1 for keep <= 2)."""
    if keep <= 2:
        return 1
    spread = SPREAD % keep or 1
    while math.gcd(spread, keep) != 1:
        spread += 1
    return spread


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def chunk_size(num_rows: int, width: int, sms: int) -> int:
    """Scores a program covers: ``MAX_CHUNK``, halved while the grid (rows x chunks) has fewer than
    ``PROGRAMS_PER_SM`` programs a multiprocessor, never below ``MIN_CHUNK``."""
    chunk = MAX_CHUNK
    while chunk > MIN_CHUNK and num_rows * cdiv(width, chunk) < PROGRAMS_PER_SM * sms:
        chunk //= 2
    return chunk


@triton.jit
def _keys(x):
    """fp32 -> uint32 in the same order (negatives: all bits flipped; the rest: the sign bit set). -0.0 becomes
    +0.0 (equal scores, equal keys: a tie) and every NaN a positive one (above +inf, as ``torch.topk`` ranks it)."""
    x = tl.where(x == 0.0, 0.0, tl.where(x != x, float("nan"), x))
    bits = x.to(tl.uint32, bitcast=True)
    flip = tl.where((bits >> 31) != 0, tl.full(x.shape, 0xFFFFFFFF, tl.uint32), tl.full(x.shape, 0x80000000, tl.uint32))
    return bits ^ flip


@triton.jit
def _decided(state_row, K, DONE: tl.constexpr):
    """(prefix of the key bytes decided by passes 0 .. DONE-1 (the rest zero), keys greater than the prefix's
    bytes, how many keys sharing them are still wanted), from the row's histograms."""
    bins = tl.arange(0, 256)
    first = tl.load(state_row + bins)
    wanted = tl.minimum(tl.sum(first, axis=0), K)  # every visible key is counted by pass 0
    prefix = tl.full([], 0, tl.uint32)
    above = tl.full([], 0, tl.int32)
    for d in tl.static_range(DONE):
        counts = tl.load(state_row + d * 256 + bins)
        at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # keys in bins >= b
        byte = tl.max(tl.where(at_or_above >= wanted, bins, 0), axis=0)
        higher = tl.sum(tl.where(bins > byte, counts, 0), axis=0)
        above += higher
        wanted -= higher
        prefix = prefix | (byte.to(tl.uint32) << (24 - 8 * d))
    return prefix, above, wanted


@triton.jit
def _load_chunk(scores_ptr, row, chunk, width, stride_s, CHUNK: tl.constexpr):
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(scores_ptr + row * stride_s + offs, mask=offs < width, other=float("-inf"))
    return offs, _keys(x), x != float("-inf")


@triton.jit
def _histogram_kernel(scores_ptr, state_ptr, width, stride_s, stride_state, K,
                      PASS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    state_row = state_ptr + row * stride_state
    _, keys, match = _load_chunk(scores_ptr, row, tl.program_id(1), width, stride_s, CHUNK)
    if PASS > 0:
        prefix, _, _ = _decided(state_row, K, PASS)
        match = match & ((keys >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
    byte = ((keys >> (24 - 8 * PASS)) & 0xFF).to(tl.int32)
    bins = tl.arange(0, 256)
    # keys left out counted in bin 0, then taken back out
    misses = tl.sum((~match).to(tl.int32), axis=0)
    counts = tl.histogram(tl.where(match, byte, 0), 256) - tl.where(bins == 0, misses, 0)
    tl.atomic_add(state_row + PASS * 256 + bins, counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _split_at_threshold(scores_ptr, state_ptr, width, stride_s, stride_state, K, CHUNK: tl.constexpr):
    """This program's chunk against the row's K-th largest key: (the row's state, the chunk's positions, which are
    above it, which equal it, how many keys of the row are above it, how many equal ones are wanted)."""
    row = tl.program_id(0).to(tl.int64)
    state_row = state_ptr + row * stride_state
    offs, keys, visible = _load_chunk(scores_ptr, row, tl.program_id(1), width, stride_s, CHUNK)
    threshold, above, wanted = _decided(state_row, K, 4)
    return state_row, offs, visible & (keys > threshold), visible & (keys == threshold), above, wanted


@triton.jit
def _count_kernel(scores_ptr, state_ptr, width, stride_s, stride_state, K,
                  CHUNK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    state_row, _, is_above, is_equal, _, _ = _split_at_threshold(scores_ptr, state_ptr, width, stride_s,
                                                                 stride_state, K, CHUNK)
    counts = state_row + _COUNTS_AT + 2 * tl.program_id(1)  # (above, equal) of this chunk
    tl.store(counts, tl.sum(is_above.to(tl.int32), axis=0))
    tl.store(counts + 1, tl.sum(is_equal.to(tl.int32), axis=0))


@triton.jit
def _select_kernel(scores_ptr, state_ptr, out_ptr, width, keep, spread, stride_s, stride_state, stride_o, stride_ok, K,
                   CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    state_row, offs, is_above, is_equal, above, wanted = _split_at_threshold(scores_ptr, state_ptr, width, stride_s,
                                                                             stride_state, K, CHUNK)
    chunks = tl.arange(0, CHUNKS_PAD)
    before = chunks < tl.program_id(1)  # the counts of the chunks before this one
    above_before = tl.sum(tl.load(state_row + _COUNTS_AT + 2 * chunks, mask=before, other=0), axis=0)
    equal_before = tl.sum(tl.load(state_row + _COUNTS_AT + 1 + 2 * chunks, mask=before, other=0), axis=0)
    row = tl.program_id(0).to(tl.int64)
    out_row = out_ptr + row * stride_o
    stride = tl.where(above + wanted == keep, spread, 1).to(tl.int64)  # a full row: its slots spread
    slot = above_before + tl.cumsum(is_above.to(tl.int32), axis=0) - 1
    tl.store(out_row + (slot * stride % keep) * stride_ok, offs, mask=is_above)
    rank = equal_before + tl.cumsum(is_equal.to(tl.int32), axis=0) - 1
    tl.store(out_row + ((above + rank) * stride % keep) * stride_ok, offs, mask=is_equal & (rank < wanted))
    # -1 in the slots past the selection (this chunk's share of [above + wanted, keep))
    tl.store(out_row + offs * stride_ok, tl.full([CHUNK], -1, tl.int32), mask=(offs >= above + wanted) & (offs < keep))


def topk_positions(scores: torch.Tensor, state: torch.Tensor, out: torch.Tensor, keep: int, chunk: int) -> None:
    """out[t, :keep] = the positions of the ``keep`` largest scores of ``scores[t]`` (fp32 [T, W], -inf: not
    visible; in the order of the module docstring), then -1 where fewer are visible. state: int32
    [T, ``state_width(W, chunk)``], zero on entry (left holding the histograms and counts). keep <= W."""
    rows, width = scores.shape
    if rows == 0:
        return
    if scores.stride(1) != 1:
        raise ValueError(f"topk_positions reads score rows at unit stride, got strides {scores.stride()}")
    chunks = cdiv(width, chunk)
    grid = (rows, chunks)
    args = (scores, state, width, scores.stride(0), state.stride(0), keep)
    pdl = launch_kwargs(scores, rows)
    for d in range(PASSES):
        _histogram_kernel[grid](*args, PASS=d, CHUNK=chunk, num_warps=4, **pdl)
    _count_kernel[grid](*args, CHUNK=chunk, num_warps=4, **pdl)
    _select_kernel[grid](scores, state, out, width, keep, spread_for(keep), scores.stride(0), state.stride(0),
                         out.stride(0), out.stride(1), keep, CHUNK=chunk, CHUNKS_PAD=next_power_of_2(chunks),
                         num_warps=4, **pdl)
