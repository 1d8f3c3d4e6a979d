"""Triton top-k positions of each row of an fp32 score buffer (the lightning indexer's selection), by radix
select: one program per row.

Each score is mapped to an int32 key whose signed order is the float order (``_ordered_key``: the bits of
a negative float have all but the sign bit flipped). Four passes over the row, one per byte of the key
from the top, histogram the next byte of the keys that share the bytes chosen so far (``tl.histogram``,
256 bins) and choose the byte in which the ``keep``-th largest key lies: after the fourth, ``threshold``
is that key exactly, ``above`` keys are larger and ``keep - above`` of the keys equal to it are kept.
A fifth pass writes the positions: those above the threshold first (in column order), then the tied
ones up to ``keep`` (in column order). A threshold of -inf means the row has fewer than ``keep`` finite
scores: the tied entries are written as -1, so -1 entries come last, as ``torch.topk``'s would.

The order of the kept positions is column order, not score order (the op contract leaves it open).
Reads the row ``5 x W x 4`` bytes (L2-resident at 32k: 128 KiB a row). Sized by shapes only (CUDA-graph
capturable).

Legend: T = rows (query tokens), W = columns, K = kept positions (``keep``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from atom_core.ops.dispatch import triton_interpret

INT32_MIN = tl.constexpr(-(1 << 31))
MINUS_INF_KEY = tl.constexpr(-0x7F800001)  # _ordered_key(-inf): 0xff800000 ^ 0x7fffffff = 0x807fffff, as an int32


@triton.jit
def _ordered_key(x):
    """int32 keys whose signed order is the order of the fp32 values x (NaN above +inf)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _byte_histogram(row_ptr, width, prefix, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """[256] counts of byte ``SHIFT / 8`` of the row's unsigned keys, over the keys whose higher bytes equal
    ``prefix``'s (all keys on the first pass)."""
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros([256], tl.int32)
    for start in range(0, width, BLOCK):
        cols = start + offs
        valid = cols < width
        unsigned = _ordered_key(tl.load(row_ptr + cols, mask=valid, other=float("-inf"))) ^ INT32_MIN
        if SHIFT < 24:
            valid = valid & ((unsigned >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        hist += tl.histogram((unsigned >> SHIFT) & 255, 256, mask=valid)
    return hist


@triton.jit
def _choose_byte(hist, prefix, above, keep, SHIFT: tl.constexpr):
    """The byte holding the ``keep``-th largest key, given ``above`` larger keys outside this histogram:
    (prefix with it set, above + the keys in higher bins)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.cumsum(hist, 0, reverse=True)                       # keys whose byte is >= the bin's
    byte = tl.sum((above + at_or_above >= keep).to(tl.int32), 0) - 1    # at_or_above is non-increasing
    above = above + tl.sum(tl.where(bins > byte, hist, 0), 0)
    return prefix | (byte << SHIFT), above


@triton.jit
def _topk_positions_kernel(scores_ptr, out_ptr, width, keep, stride_s, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + row * stride_s
    out_row = out_ptr + row * stride_o
    prefix = tl.zeros([], tl.int32)
    above = tl.zeros([], tl.int32)
    for p in tl.static_range(4):
        hist = _byte_histogram(row_ptr, width, prefix, 24 - 8 * p, BLOCK)
        prefix, above = _choose_byte(hist, prefix, above, keep, 24 - 8 * p)
    threshold = prefix ^ INT32_MIN                                        # the keep-th largest key, signed
    fill = threshold == MINUS_INF_KEY                                     # fewer finite scores than keep
    offs = tl.arange(0, BLOCK)
    taken_above = tl.zeros([], tl.int32)
    taken_tied = tl.zeros([], tl.int32)
    for start in range(0, width, BLOCK):
        cols = start + offs
        valid = cols < width
        key = _ordered_key(tl.load(row_ptr + cols, mask=valid, other=float("-inf")))
        is_above = valid & (key > threshold)
        is_tied = valid & (key == threshold)
        slot = taken_above + tl.cumsum(is_above.to(tl.int32), 0) - 1
        tl.store(out_row + slot, cols, mask=is_above)
        slot = above + taken_tied + tl.cumsum(is_tied.to(tl.int32), 0) - 1
        tl.store(out_row + slot, tl.where(fill, -1, cols), mask=is_tied & (slot < keep))
        taken_above += tl.sum(is_above.to(tl.int32), 0)
        taken_tied += tl.sum(is_tied.to(tl.int32), 0)


def topk_positions(scores, keep, out):
    """out[t, :keep] (int32) = the columns of the ``keep`` largest scores of ``scores[t]`` (fp32 [T, W],
    keep <= W), -1 for columns scored -inf, those last."""
    block = 64 if triton_interpret() else 2048
    _topk_positions_kernel[(scores.shape[0],)](scores, out, scores.shape[1], keep, scores.stride(0), out.stride(0),
                                               BLOCK=block, num_warps=8)
