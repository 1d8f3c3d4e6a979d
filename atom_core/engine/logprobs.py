"""What the engine returns as log-probs: ``Engine(logprobs_mode=...)``, vLLM's four values.

* ``raw_logprobs`` (default): ``log_softmax`` of the model's logits, before any processing — the
  model's own likelihood of the token;
* ``raw_logits``: those logits themselves (float32);
* ``processed_logprobs``: ``log_softmax`` of the scores the token was drawn from: the logits after
  the logits processing (grammar mask, biases and bans, penalties, allow-list), divided by the row's
  temperature, with the tokens its filters (top-k, top-p, min-p) drop at -inf. What HF's
  ``output_scores`` / ``compute_transition_scores(..., normalize_logits=True)`` give;
* ``processed_logits``: those scores themselves (so ``log_softmax`` of them is ``processed_logprobs``).

A greedy row (``temperature < GREEDY_BELOW_TEMPERATURE``) is an argmax of the processed logits: its
processed scores are those logits, with no temperature and no filter (vLLM resets a greedy request's
filters; atom_core's sampler ignores them). The filters come from ``ops.reference.sampling.filter_cutoff``,
the very function every sampling backend calls, so a processed score is finite exactly where the draw
could land, and the sampled token's is always finite. The top-N alternatives come from the same
values as the chosen token's (vLLM's rule), so in a processed mode a filtered token is among them
only with -inf, past every kept token.

Prompt log-probs follow the logits-or-log-probs half of the mode only: prompt positions go through no
sampling processing, so ``processed_*`` gives what ``raw_*`` gives there (vLLM's
``compute_prompt_logprobs_with_chunking`` in ``vllm/v1/worker/gpu/sample/prompt_logprob.py``, and its
``--logprobs-mode`` help).

Each chosen token also gets vLLM's rank (``token_ranks``): how many tokens of its row score at least as
high as it does, itself included, so 1 for the most likely and, among equal values, the last of their
places (vLLM's ``batched_count_greater_than``, which counts ``>=``). The top-N alternatives are ranked
1..N by their place, as vLLM ranks them.

Legend: R = rows (sampled rows or prompt positions), V = vocabulary, N = top alternatives.
"""

from __future__ import annotations

import torch

from atom_core.ops.reference.sampling import GREEDY_BELOW_TEMPERATURE, filter_cutoff

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
PROCESSED_MODES = ("processed_logprobs", "processed_logits")


def check_logprobs_mode(mode) -> str:
    """``mode`` when it is one of LOGPROBS_MODES, else ValueError naming them."""
    if not isinstance(mode, str) or mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)} (vLLM's), got {mode!r}")
    return mode


def processed_scores(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                     top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """The scores ``ops.sample`` draws from, given the same arguments: float32 [R, V] = ``logits / T``
    with each sampled row's filtered tokens at -inf; a greedy row's logits as they are (see the module
    docstring). A new tensor: ``logits`` (which may be a CUDA graph's output buffer) is not written."""
    x = logits.float()
    greedy = temperature < GREEDY_BELOW_TEMPERATURE
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scores = x / t[:, None]
    cutoff = filter_cutoff(x, temperature, top_k, top_p, min_p)  # on x: the backends' cut-off, bit for bit
    if cutoff is not None:
        scores.masked_fill_((x < cutoff[:, None]) & ~greedy[:, None], float("-inf"))
    return scores


def token_ranks(scores: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's rank of ``token_ids`` [R] in their rows of ``scores`` [R, V]: int64 [R], the number of entries
    of the row at least as large as the token's own (itself included: 1 for the row's largest). Ties: every
    token of equal value counts, so a token tied with others gets the last of their places (vLLM's
    ``batched_count_greater_than(logprobs, token_logprobs)``, which is ``(x >= value).sum(-1)``).

    ``scores`` are the values the log-probs are taken from (raw logits or processed scores): their
    ``log_softmax`` shifts each row by one constant, which keeps the order, so the rank of a log-prob is
    the rank of its logit, and the fused draw, which forms no log-prob row, ranks the same way. (Where
    float32 rounding of that shift makes two different logits' log-probs equal, vLLM, which compares the
    log-probs, counts the lower one too; the logits here do not.) One comparison and sum over the row, in
    ``scores``' own dtype (a bf16 row compares as its float32 values would)."""
    chosen = scores.gather(1, token_ids[:, None])
    return (scores >= chosen).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, *, as_logits: bool = False):
    """``log_softmax(logits)`` [R, V] at ``token_ids`` [R] (float32 [R]), the tokens' ranks (``token_ranks``,
    int64 [R]), and the ``num_top`` largest entries ((ids int64 [R, N], values float32 [R, N]), or None
    when ``num_top`` is 0). ``as_logits``: the float32 logits themselves instead of their ``log_softmax``
    (the same top ids and ranks: the softmax keeps the order)."""
    values = logits.float() if as_logits else torch.log_softmax(logits.float(), dim=-1)
    chosen = values.gather(1, token_ids[:, None])[:, 0]
    ranks = token_ranks(logits, token_ids)
    if not num_top:
        return chosen, ranks, None
    top = values.topk(min(num_top, values.shape[1]), dim=-1)
    return chosen, ranks, (top.indices, top.values)
