"""AITER adapters for sampling (signatures in aiter/ops/sample.py).

``mixed_sample_outer_exponential(out, input, exponentials, temperatures, eps)`` writes, per row,
``argmax softmax(input / T) / (exponentials + eps)`` (the exponential trick with caller-given
Exp(1) noise), or ``argmax input`` where ``T == 0``; ``out`` is int32. The adapter supplies:

* the filters, as ``-inf`` outside each row's cut-off (``reference.filter_cutoff``, in torch);
* the noise, from the twin's counter-based hash of (seed, offset, vocab index), so draws stay
  seeded per row (AITER's own ``random_sample`` uses a stateful generator, which is not);
* log-probs, in torch (AITER returns only the token).

``greedy_sample(out, input)`` (int32 argmax per row) gives the target's tokens for greedy
speculative acceptance; the acceptance itself is the twin's vectorised prefix rule.
"""

from __future__ import annotations

import aiter
import torch

from atom_core.ops.reference.sampling import (GREEDY_BELOW_TEMPERATURE, accept_greedy, exponential_noise,
                                              filter_cutoff)


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, token_ids, logprobs):
    rows, vocab = logits.shape
    if rows == 0:
        return
    cutoff = filter_cutoff(logits, temperature, top_k, top_p, min_p)
    filtered = logits if cutoff is None else logits.masked_fill(logits.float() < cutoff[:, None], float("-inf"))
    exponentials = exponential_noise(seeds, offsets, vocab).float()  # > 0, so eps can be 0
    out = torch.empty(rows, dtype=torch.int32, device=logits.device)
    # Greedy rows: AITER tests T == 0; the op's contract is T < GREEDY_BELOW_TEMPERATURE (0 and
    # negatives included), where input / T would overflow.
    temperatures = torch.where(temperature < GREEDY_BELOW_TEMPERATURE, 0.0, temperature).float()
    aiter.mixed_sample_outer_exponential(out, filtered, exponentials, temperatures, 0.0)
    token_ids.copy_(out)
    if logprobs is not None:
        logprobs.copy_(torch.log_softmax(logits.float(), dim=-1).gather(1, token_ids[:, None])[:, 0])


def rejection_sample_greedy(draft_token_ids, target_logits, output_token_ids, num_accepted):
    rows, k = draft_token_ids.shape
    if rows == 0:
        return
    target_argmax = torch.empty(target_logits.shape[0], dtype=torch.int32, device=target_logits.device)
    aiter.greedy_sample(target_argmax, target_logits)
    output, accepted = accept_greedy(draft_token_ids, target_argmax.long().view(rows, k + 1))
    output_token_ids.copy_(output)
    num_accepted.copy_(accepted)
