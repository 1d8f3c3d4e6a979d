"""Reference twins for sampling: plain torch, no host sync, written to be read.

Legend: B = rows (one per sequence), V = vocabulary size, K = draft tokens per row.

Three pieces, each usable on its own:

* :func:`filter_cutoff` — top-k, top-p and min-p expressed as ONE cut-off logit per row: a row
  keeps exactly the tokens whose raw logit is ``>= cutoff[r]``. Every filter keeps a prefix of the
  tokens sorted by logit, so their intersection is a prefix too, and a prefix is a threshold.
  Tokens tied with the last kept one are kept as well (a threshold cannot split a tie). The Triton
  and AITER backends call this same function, so all backends share one definition of the filters.
* :func:`exponential_noise` — Exp(1) noise that is a counter-based hash of
  ``(seed, offset, vocab index)``: a row's noise never depends on its batch mates.
* :func:`sample` — greedy or filtered draw with the exponential trick, plus log-probs.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
# Rows with a temperature below this are greedy (vLLM's _SAMPLING_EPS): logits / T overflows fp32
# for T near the smallest normal (1.2e-38), and the kernels score in fp32.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer hash (xorshift-multiply rounds), on int64 tensors holding uint32.

    Multipliers are odd and below 2**31, so ``x * c < 2**63`` never overflows int64.
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    x = x ^ (x >> 15)
    return x


def uniform_noise(seeds: Tensor, offsets: Tensor, vocab_size: int) -> Tensor:
    """Uniform (0, 1) numbers, a pure function of ``(seeds[r], offsets[r], v)``.

    seeds, offsets: [B] int64. Returns [B, V] float64. The 64-bit seed and offset are cut into
    32-bit words and absorbed one at a time into a chain of bijective hashes, starting from the
    vocab index; the final 32-bit hash h maps to ``(h + 0.5) / 2**32``, never 0 or 1.
    """
    index = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)[None, :]
    words = [offsets >> 32, offsets, seeds >> 32, seeds]  # `& _MASK32` below keeps the low 32 bits
    h = _mix32(index ^ 0x5EED5A3B)
    for w in words:
        h = _mix32(h ^ (w[:, None] & _MASK32))
    return (h.double() + 0.5) * 2.0**-32


def exponential_noise(seeds: Tensor, offsets: Tensor, vocab_size: int) -> Tensor:
    """Exp(1) noise ``E = -log(1 - u)`` from :func:`uniform_noise`. Returns [B, V] float64 (> 0)."""
    return -torch.log1p(-uniform_noise(seeds, offsets, vocab_size))


def filter_cutoff(logits: Tensor, temperature: Tensor, top_k: Tensor | None, top_p: Tensor | None,
                  min_p: Tensor | None) -> Tensor | None:
    """The lowest raw logit each row keeps after top-k, then top-p, then min-p (HF transformers' order).

    logits: [B, V] float; temperature: [B] float32 (only rows with ``temperature >=
    GREEDY_BELOW_TEMPERATURE`` are sampled and read their cut-off; the others are greedy);
    top_k: [B] int (``<= 0`` or ``>= V``: off); top_p: [B] float32 (``>= 1``: off); min_p: [B]
    float32 (``<= 0``: off). A None filter is off for every row; with all three None the result is
    None (nothing to filter, and no sort is paid).
    Returns cutoff [B] float32: the row keeps token v iff ``logits[r, v] >= cutoff[r]``.

    * top-k keeps the tokens whose logit is ``>=`` the k-th largest: ties with the k-th are kept,
      as HF's TopKLogitsWarper and vLLM v1 keep them;
    * top-p then keeps the smallest prefix whose probability sum is ``>= top_p`` — always at least
      the top token — with probabilities renormalised over everything top-k kept (ties included,
      as HF's TopPLogitsWarper and vLLM v1 see them);
    * min-p last keeps tokens with ``p >= min_p * p_max``, i.e. ``logit >= max_logit + T * log(min_p)``
      (HF's MinPLogitsWarper). A ratio to the top token, so its own kept set does not depend on the
      order; but vLLM v1 applies min-p FIRST, so there top-p renormalises over min-p's survivors and
      can cut more. This function keeps HF's order.
    Probabilities are those of ``logits / temperature``. A tie that top-p's cut falls into is kept
    whole (a threshold cannot split it), where HF's sort would keep only some of the tied tokens.
    """
    if top_k is None and top_p is None and min_p is None:
        return None
    x = logits.float()
    rows, vocab = x.shape
    sampled = temperature >= GREEDY_BELOW_TEMPERATURE
    t = torch.where(sampled, temperature, torch.ones_like(temperature)).float()[:, None]
    cutoff = torch.full((rows,), float("-inf"), device=x.device)
    if top_k is not None or top_p is not None:
        sorted_x = x.sort(dim=-1, descending=True).values  # [B, V]
        rank = torch.arange(vocab, device=x.device)[None, :]
        keep = torch.ones(rows, vocab, dtype=torch.bool, device=x.device)
        if top_k is not None:
            k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k.long())
            kth_logit = sorted_x.gather(1, k[:, None] - 1)  # [B, 1]
            keep = sorted_x >= kth_logit  # a prefix of the sorted order: the k largest and their ties
        if top_p is not None:
            probs = torch.softmax((sorted_x / t).masked_fill(~keep, float("-inf")), dim=-1)
            # mass_before[i] = sum of probs[:i]; token i is needed while the mass before it is < top_p.
            mass_before = torch.nn.functional.pad(probs.cumsum(-1)[:, :-1], (1, 0))
            keep = keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1) | (rank == 0))
        num_kept = keep.sum(-1, keepdim=True)  # a prefix of the sorted order, >= 1 token
        cutoff = sorted_x.gather(1, num_kept - 1)[:, 0]
        row_max = sorted_x[:, 0]
    else:
        row_max = x.amax(-1)
    if min_p is not None:
        min_p_cut = row_max + t[:, 0] * torch.log(min_p.float().clamp(min=1e-30))
        cutoff = torch.maximum(cutoff, torch.where(min_p > 0, min_p_cut, float("-inf")))
    return cutoff


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor | None, top_p: Tensor | None,
           min_p: Tensor | None, seeds: Tensor, offsets: Tensor, return_logprobs: bool = False):
    """Draw one token per row.

    logits: [B, V] fp32/fp16/bf16; temperature, top_p, min_p: [B] float32; top_k: [B] int;
    seeds, offsets: [B] int64 (filters may be None: off for every row; see :func:`filter_cutoff`).
    Returns token_ids [B] int64, and with ``return_logprobs`` also logprobs [B] float32 =
    ``log_softmax(logits)`` at the chosen token — the RAW logits, before temperature and filters.

    ``temperature < GREEDY_BELOW_TEMPERATURE`` (1e-5, as vLLM; 0 included): greedy, the argmax
    (lowest index on ties). Otherwise the exponential trick: ``argmax_v p_v / E_v`` with E ~ Exp(1)
    i.i.d. picks v with probability p_v, where p is the filtered, renormalised softmax of
    ``logits / T``; taking logs, the winner maximises ``logits_v / T - log(E_v)`` over the kept
    tokens (the softmax normaliser is common to all v).
    """
    x = logits.float()
    greedy = temperature < GREEDY_BELOW_TEMPERATURE
    t = torch.where(greedy, torch.ones_like(temperature), temperature).double()[:, None]
    score = x.double() / t - torch.log(exponential_noise(seeds, offsets, x.shape[1]))
    cutoff = filter_cutoff(x, temperature, top_k, top_p, min_p)
    if cutoff is not None:
        score = score.masked_fill(x < cutoff[:, None], float("-inf"))
    token_ids = torch.where(greedy, x.argmax(-1), score.argmax(-1))
    if not return_logprobs:
        return token_ids
    logprobs = torch.log_softmax(x, dim=-1).gather(1, token_ids[:, None])[:, 0]
    return token_ids, logprobs


def accept_greedy(draft_token_ids: Tensor, target_argmax: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy acceptance from the target's argmax tokens.

    draft_token_ids: [B, K] int64; target_argmax: [B, K+1] int64 (position j is the target's token
    after the row's first j draft tokens). Returns ``(output_token_ids [B, K+1] int64,
    num_accepted [B] int32)``: drafts are accepted while they equal the target's token;
    ``num_accepted`` counts them (0..K); the output holds the accepted drafts, then the target's
    token at the first mismatch (or the bonus token at position K when all K were accepted), then -1.
    """
    k = draft_token_ids.shape[1]
    matches = (draft_token_ids == target_argmax[:, :k]).int()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)  # length of the all-match prefix
    position = torch.arange(k + 1, device=target_argmax.device)[None, :]
    # Accepted drafts equal the target's tokens, so every valid output position is target_argmax.
    output = torch.where(position <= num_accepted[:, None], target_argmax, torch.full_like(target_argmax, -1))
    return output, num_accepted.int()


def rejection_sample_greedy(draft_token_ids: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy speculative-decoding acceptance.

    draft_token_ids: [B, K] int64; target_logits: [B*(K+1), V] float, row ``r*(K+1) + j`` holding the
    target's logits after row r's first j drafts. Returns ``(output_token_ids [B, K+1] int64 padded
    with -1, num_accepted [B] int32)`` as in :func:`accept_greedy`.
    """
    rows, k = draft_token_ids.shape
    target_argmax = target_logits.argmax(dim=-1).view(rows, k + 1)
    return accept_greedy(draft_token_ids, target_argmax)
