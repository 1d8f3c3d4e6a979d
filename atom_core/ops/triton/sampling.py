"""Triton sampling: one fused pass over the logits (temperature, cut-off, noise, argmax, log-sum-exp).

Legend: B = rows, V = vocabulary size, R = rows per program, S = programs per row (splits),
K = draft tokens per row.

The filters arrive as one cut-off logit per row (``reference.filter_cutoff``, computed in torch
before the launch). The kernel streams each row once, in blocks of ``BLOCK = 4 * QUARTER`` logits:

    score_v = logit_v / T - log(E_v)   for logit_v >= cutoff, else -inf
    (greedy rows, T < GREEDY_BELOW_TEMPERATURE = 1e-5: score_v = logit_v)
    token   = argmax_v score_v         (lowest index on ties)
    lse     = log(sum_v exp(logit_v))  (online, only when log-probs are asked for)

Noise: one Philox call, keyed by the row's 64-bit seed with counter ``(v // 4, offset_lo,
offset_hi, 0)``, gives four 32-bit words; column v takes word ``v % 4``. So E_v depends on the seed,
the offset and v only — not on the batch, the row index, the block size or how a row is split —
and each Philox call serves four columns. ``E_v = -log(1 - u_v)``, u_v = (word + 0.5) / 2**32.

Launch shape. On a GPU: R = 1 and, when B is small (decode), each row is split over S programs so
that the SMs fill; each split writes (best score, best index, running max, running sum) and a
combine kernel reduces them. Under the CPU interpreter, where every op has a fixed cost, a program
takes R rows at once (a [R, BLOCK] tile) so that tests can afford thousands of draws.

Greedy speculative acceptance reuses the pass (greedy only) for the target's argmax, then a tiny
per-request kernel finds the accepted prefix.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_core.ops.reference.sampling import GREEDY_BELOW_TEMPERATURE, filter_cutoff
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2, num_sms

GPU_QUARTER = 1024  # block = 4096 logits per row and step on a GPU (16 KiB of fp32)
_MIN_BLOCKS_PER_SPLIT = 4  # a split streams at least 4 blocks
_INTERPRETER_ROWS = 256  # rows per program under the CPU interpreter


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2; FAST uses the GPU's approximate instruction (NVIDIA lg2.approx, relative error ~2**-22),
    where tl.log2 would be a ~20-instruction polynomial. The noise needs two logs per logit."""
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, B, V, chunk,
    temperature_ptr, cutoff_ptr, seeds_ptr, offsets_ptr,
    token_ids_ptr, logprobs_ptr,
    part_score_ptr, part_idx_ptr, part_m_ptr, part_l_ptr, num_splits,
    ALL_GREEDY: tl.constexpr, HAS_CUTOFF: tl.constexpr, RETURN_LOGPROBS: tl.constexpr,
    SPLIT: tl.constexpr, ROWS: tl.constexpr, QUARTER: tl.constexpr, FAST_LOG2: tl.constexpr,
    MIN_TEMPERATURE: tl.constexpr,
):
    BLOCK: tl.constexpr = 4 * QUARTER
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [R]
    row_ok = rows < B
    split = tl.program_id(1)
    row_ptr = logits_ptr + rows * stride_row  # [R]
    if ALL_GREEDY:
        sampled = tl.zeros((ROWS,), tl.int1)
        log2e_over_t = tl.full((ROWS,), 1.0, tl.float32)
        seed = tl.zeros((ROWS,), tl.int64)
        offset = tl.zeros((ROWS,), tl.int64)
    else:
        temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=0.0)
        # Below MIN_TEMPERATURE: greedy (0 included); x / T would overflow fp32 for tiny T.
        sampled = temperature >= MIN_TEMPERATURE
        log2e_over_t = tl.where(sampled, 1.4426950408889634 / tl.where(sampled, temperature, 1.0), 1.0)
        seed = tl.load(seeds_ptr + rows, mask=row_ok, other=0)
        offset = tl.load(offsets_ptr + rows, mask=row_ok, other=0)
    cutoff = tl.full((ROWS,), float("-inf"), tl.float32)
    if HAS_CUTOFF:
        cutoff = tl.where(sampled, tl.load(cutoff_ptr + rows, mask=row_ok, other=float("-inf")), float("-inf"))
    any_sampled = tl.max(sampled.to(tl.int32), axis=0) > 0

    zero_words = tl.zeros((ROWS, QUARTER), tl.uint32)
    offset_lo = zero_words + (offset & 0xFFFFFFFF).to(tl.uint32)[:, None]
    offset_hi = zero_words + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)[:, None]
    seed_tile = seed[:, None]

    best_score = tl.full((ROWS,), float("-inf"), tl.float32)
    best_idx = tl.zeros((ROWS,), tl.int64)
    m = tl.full((ROWS,), -3.0e38, tl.float32)  # not -inf: exp(m - m_new) stays a number on all -inf blocks
    l = tl.zeros((ROWS,), tl.float32)
    start_col = split * chunk
    end_col = tl.minimum(start_col + chunk, V)
    for start in range(start_col, end_col, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < V)[None, :]
        x = tl.load(row_ptr[:, None] + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)  # [R, BLOCK]
        if any_sampled:
            # Column v takes word v % 4 of philox(seed; v // 4, offset_lo, offset_hi, 0).
            group = zero_words + (start // 4 + tl.arange(0, QUARTER)).to(tl.uint32)[None, :]
            w0, w1, w2, w3 = tl.philox(seed_tile, group, offset_lo, offset_hi, zero_words)
            word = tl.arange(0, 4)[None, None, :]  # [R, QUARTER, 4] -> [R, BLOCK] keeps columns in order
            bits = tl.where(word == 0, w0[:, :, None], tl.where(word == 1, w1[:, :, None],
                                                                tl.where(word == 2, w2[:, :, None], w3[:, :, None])))
            bits = tl.reshape(bits, (ROWS, BLOCK))
            # u in (0, 1); E = -log(1 - u) ~ Exp(1), taken from the small-u end where fp32 is
            # fine-grained (small E decides the winner): u + u^2/2 + u^3/3 below 0.01 (error < u^4/4),
            # -log(1 - u) above, with 1 - u floored at 1e-30 (u rounds to 1.0) so E stays finite.
            u = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10
            series = u * (1.0 + u * (0.5 + u * 0.3333333333333333))
            e = tl.where(u < 0.01, series, -0.6931471805599453 * _log2(tl.maximum(1.0 - u, 1e-30), FAST_LOG2))
            # The score in log2 units, (x / T - log E) / ln 2: same argmax, one multiply less.
            noisy = tl.where(x >= cutoff[:, None], x * log2e_over_t[:, None] - _log2(e, FAST_LOG2), float("-inf"))
            score = tl.where(sampled[:, None], noisy, x)
        else:
            score = x
        block_best = tl.max(score, axis=1)
        take = block_best > best_score  # strict: an earlier block wins a tie
        best_idx = tl.where(take, start + tl.argmax(score, axis=1), best_idx)
        best_score = tl.where(take, block_best, best_score)
        if RETURN_LOGPROBS:
            m_new = tl.maximum(m, tl.max(x, axis=1))
            l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
            m = m_new

    if SPLIT:
        part = rows * num_splits + split
        tl.store(part_score_ptr + part, best_score, mask=row_ok)
        tl.store(part_idx_ptr + part, best_idx, mask=row_ok)
        if RETURN_LOGPROBS:
            tl.store(part_m_ptr + part, m, mask=row_ok)
            tl.store(part_l_ptr + part, l, mask=row_ok)
    else:
        tl.store(token_ids_ptr + rows, best_idx, mask=row_ok)
        if RETURN_LOGPROBS:
            chosen = tl.load(row_ptr + best_idx, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(logprobs_ptr + rows, chosen - (m + tl.log(l)), mask=row_ok)


@triton.jit
def _combine_kernel(
    logits_ptr, stride_row, token_ids_ptr, logprobs_ptr,
    part_score_ptr, part_idx_ptr, part_m_ptr, part_l_ptr, num_splits,
    RETURN_LOGPROBS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    in_row = s < num_splits
    part = row * num_splits + s
    score = tl.load(part_score_ptr + part, mask=in_row, other=float("-inf"))
    winner = tl.argmax(score, axis=0)  # lowest split on ties = lowest vocab index
    idx = tl.sum(tl.where(s == winner, tl.load(part_idx_ptr + part, mask=in_row, other=0), 0), axis=0)
    tl.store(token_ids_ptr + row, idx)
    if RETURN_LOGPROBS:
        m = tl.load(part_m_ptr + part, mask=in_row, other=-3.0e38)
        l = tl.load(part_l_ptr + part, mask=in_row, other=0.0)
        m_all = tl.max(m, axis=0)
        lse = m_all + tl.log(tl.sum(l * tl.exp(m - m_all), axis=0))
        chosen = tl.load(logits_ptr + row * stride_row + idx).to(tl.float32)
        tl.store(logprobs_ptr + row, chosen - lse)


@triton.jit
def _accept_kernel(draft_ptr, stride_draft, target_argmax_ptr, out_ptr, stride_out, num_accepted_ptr, K,
                   BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    target = tl.load(target_argmax_ptr + row * (K + 1) + j, mask=j <= K, other=-1)
    draft = tl.load(draft_ptr + row * stride_draft + j, mask=j < K, other=-1)
    mismatch = (draft != target) & (j < K)
    num_accepted = tl.min(tl.where(mismatch, j, K), axis=0)  # first mismatch, or K
    tl.store(out_ptr + row * stride_out + j, tl.where(j <= num_accepted, target, -1), mask=j <= K)
    tl.store(num_accepted_ptr + row, num_accepted.to(tl.int32))


def _has_fast_log2(device: torch.device) -> bool:
    # NVIDIA only: on ROCm tl.log2 already lowers to the native v_log_f32; the interpreter has no asm.
    return device.type == "cuda" and torch.version.hip is None


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_shape(rows: int, vocab: int, device: torch.device, num_splits: int | None):
    """(rows per program R, QUARTER, splits per row S, columns per split, grid of the pass)."""
    if device.type == "cuda":
        rows_per_program, quarter = 1, GPU_QUARTER
        if num_splits is None:
            max_splits = cdiv(vocab, _MIN_BLOCKS_PER_SPLIT * 4 * quarter)
            num_splits = max(1, min(max_splits, cdiv(2 * num_sms(device.index or 0), rows)))
    else:  # interpreter: few large programs; blocks no wider than the vocab needs
        rows_per_program = min(_INTERPRETER_ROWS, next_power_of_2(rows))
        quarter = min(GPU_QUARTER, next_power_of_2(cdiv(vocab, 4)))
        num_splits = num_splits or 1
    block = 4 * quarter
    chunk = cdiv(cdiv(vocab, num_splits), block) * block  # whole blocks per split
    splits = cdiv(vocab, chunk)
    return rows_per_program, quarter, splits, chunk, (cdiv(rows, rows_per_program), splits)


def _row_pass(logits, temperature, cutoff, seeds, offsets, token_ids, logprobs, *, all_greedy, num_splits=None):
    """Launch the fused pass (and the combine when split). ``num_splits`` overrides the choice (tests)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    rows_per_program, quarter, splits, chunk, grid = _launch_shape(rows, vocab, logits.device, num_splits)
    split = splits > 1
    if split:
        part_score = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
        part_idx = torch.empty(rows, splits, dtype=torch.int64, device=logits.device)
        part_m, part_l = torch.empty_like(part_score), torch.empty_like(part_score)
    else:
        part_score = part_idx = part_m = part_l = token_ids  # not read
    return_logprobs = logprobs is not None
    unused = token_ids
    _sample_kernel[grid](
        logits, logits.stride(0), rows, vocab, chunk,
        unused if temperature is None else temperature, unused if cutoff is None else cutoff,
        unused if seeds is None else seeds, unused if offsets is None else offsets,
        token_ids, logprobs if return_logprobs else unused,
        part_score, part_idx, part_m, part_l, splits,
        ALL_GREEDY=all_greedy, HAS_CUTOFF=cutoff is not None, RETURN_LOGPROBS=return_logprobs,
        SPLIT=split, ROWS=rows_per_program, QUARTER=quarter, FAST_LOG2=_has_fast_log2(logits.device),
        MIN_TEMPERATURE=GREEDY_BELOW_TEMPERATURE, num_warps=8,
    )
    if split:
        _combine_kernel[(rows,)](
            logits, logits.stride(0), token_ids, logprobs if return_logprobs else unused,
            part_score, part_idx, part_m, part_l, splits,
            RETURN_LOGPROBS=return_logprobs, BLOCK_S=next_power_of_2(splits), num_warps=1,
        )


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, token_ids, logprobs, *, num_splits=None):
    """Backend entry of ``atom_core.ops.sampling.sample``: writes token_ids [B] int64 (and logprobs [B] f32)."""
    cutoff = filter_cutoff(logits, temperature, top_k, top_p, min_p)
    # The kernel reads the per-row tensors at unit stride (a strided or expanded view is copied).
    _row_pass(logits, temperature.contiguous(), cutoff, seeds.contiguous(), offsets.contiguous(), token_ids,
              logprobs, all_greedy=False, num_splits=num_splits)


def rejection_sample_greedy(draft_token_ids, target_logits, output_token_ids, num_accepted, *, num_splits=None):
    """Backend entry of ``atom_core.ops.sampling.rejection_sample_greedy``: fills the two outputs."""
    rows, k = draft_token_ids.shape
    if rows == 0:
        return
    target_argmax = torch.empty(target_logits.shape[0], dtype=torch.int64, device=target_logits.device)
    _row_pass(target_logits, None, None, None, None, target_argmax, None, all_greedy=True, num_splits=num_splits)
    draft_token_ids = draft_token_ids.contiguous()  # the kernel reads each row at unit stride
    _accept_kernel[(rows,)](
        draft_token_ids, draft_token_ids.stride(0), target_argmax, output_token_ids, output_token_ids.stride(0),
        num_accepted, k, BLOCK_K=next_power_of_2(k + 1), num_warps=1,
    )
