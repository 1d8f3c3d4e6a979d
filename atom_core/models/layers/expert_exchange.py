"""Expert parallelism by all-to-all: a MoE layer's tokens go to the ranks that hold their experts, and
the experts' outputs come back (``FusedMoE(ep_comm="all_to_all")``; the model option
``expert_parallel="all_to_all"``).

Legend: R ranks of the expert-parallel group, r this rank (its place in the group), T tokens of the
layer's input (the same on every rank: activations are replicated under tensor parallelism), n =
ceil(T / R) tokens rank r dispatches, H hidden, K experts per token, X experts, X_r = X / R experts
per rank (rank j holds experts ``[j * X_r, (j + 1) * X_r)``), P rows this rank sends, P' rows it receives.

**The step, per layer** (``all_to_all_experts``):

1. *Slice.* Every rank already holds all T tokens and their routing, so each takes its own n of them
   (rows ``[r * n, r * n + n)``, the last slice padded with rows routed nowhere): the dispatch work is
   split over the ranks, not repeated on each.
2. *Dispatch.* A token goes ONCE to each rank holding at least one of its K experts (not once per
   (token, expert) pair: with R = 2 and K = 8 nearly every token touches both ranks, so this sends
   2 rows where pairs would send 8), with its K expert ids local to that rank (-1 for the experts held
   elsewhere) and its K routing weights. The ids and weights ride in the same message as the row
   (``pack_rows``: 2K int32 appended to the H values, bit-copied), so the dispatch is one
   ``ops.all_to_all``.
3. *Experts.* The owner runs its experts on the P' rows it received (the layer's usual ``fused_experts``
   call: a -1 id is skipped), each row's output the routing-weighted sum over its experts held here.
4. *Combine.* The outputs go back by the reverse exchange, and each token sums what its ranks returned.
5. *Gather.* ``ops.all_gather`` of the ranks' n rows gives every rank the layer's [T, H] output again
   (``reduce_results=False``: instead, this rank's rows in place and zeros elsewhere, a partial sum that
   the caller's all-reduce completes).

Where activations are NOT replicated (data-parallel attention: each rank holds its own tokens),
``all_to_all_experts(..., tokens_replicated=False)`` runs steps 2-4 on the rank's own tokens: no slice,
no gather.

**Two exchanges.** ``exact``: the counts of rows each rank sends each other one are exchanged first
(an ``all_to_all`` of R ints, read on the host), then exactly the rows needed move; one host sync per
layer, variable shapes, so it cannot be captured in a CUDA graph. ``padded``: every rank sends every
rank all its n rows (a fixed capacity that can never overflow, because a token goes at most once to a
rank), the rows a rank does not need carrying ids -1; equal splits, no host sync, CUDA-graph capturable.
``auto`` (the default) takes ``padded`` while a CUDA graph is being captured (the engine's decode and
mixed-step graphs) and when routing would fill most of the padded exchange anyway: the expected share
of (token, rank) pairs a token touches, ``1 - C(X - X_r, K) / C(X, K)`` for uniform routing, is at least
``PADDED_FILL`` (Qwen3-30B-A3B over 2 ranks: 0.996; Mixtral over 2: 0.79; DeepSeek-V3 over 8: 0.66);
otherwise ``exact``. Every rank makes the same choice: it depends on the layer's shapes and on whether
the ranks are capturing, which they do in lock step.
"""

# R ranks, n tokens dispatched per rank, H hidden, K experts per token, X experts, X_r local experts

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from atom_core.ops import comm

if TYPE_CHECKING:
    from atom_core.models.layers.moe import FusedMoE

__all__ = ["EXCHANGES", "PADDED_FILL", "all_to_all_experts", "expected_fill", "pack_rows",
           "token_slice", "unpack_rows"]

EXCHANGES = ("auto", "padded", "exact")
PADDED_FILL = 0.75  # exact saves under a quarter of the rows above this: not worth its host sync

# the integer type of each element size: rows are packed and unpacked as bits
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def token_slice(num_tokens: int, ranks: int, rank: int) -> tuple[int, int, int]:
    """(start, stop, n): rank ``rank`` dispatches tokens ``[start, stop)``, padded to n = ceil(T / R) rows."""
    n = -(-num_tokens // ranks)
    start = min(rank * n, num_tokens)
    return start, min(start + n, num_tokens), n


def expected_fill(num_experts: int, top_k: int, ranks: int) -> float:
    """The expected share of a token's (token, rank) pairs it sends a row on, for uniform routing:
    ``1 - C(X - X_r, K) / C(X, K)`` (the chance that a rank holds at least one of the token's K experts)."""
    local = num_experts // ranks
    if num_experts - local < top_k:
        return 1.0
    return 1.0 - math.comb(num_experts - local, top_k) / math.comb(num_experts, top_k)


def local_ids_per_rank(topk_ids: torch.Tensor, num_local: int, ranks: int) -> torch.Tensor:
    """Global ids [n, K] -> [R, n, K]: entry j holds the ids local to rank j, -1 where rank j does not
    hold the expert (or the id was -1 already)."""
    offsets = torch.arange(ranks, device=topk_ids.device, dtype=topk_ids.dtype).view(ranks, 1, 1) * num_local
    local = topk_ids.unsqueeze(0) - offsets
    held = (local >= 0) & (local < num_local) & (topk_ids >= 0).unsqueeze(0)
    return torch.where(held, local, torch.full_like(local, -1))


def pack_rows(rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [..., H] (any float dtype), ids [..., K] int, weights [..., K] fp32 -> [..., H + M] of ``rows``'s
    dtype, the ids (int32) and weights (fp32) bit-copied after the H values (M = 8K / element size).
    Built and taken apart in an integer view, so no value passes through a float conversion."""
    bits = _BITS[rows.element_size()]
    meta = torch.cat([ids.to(torch.int32), weights.to(torch.float32).view(torch.int32)], dim=-1)  # [..., 2K]
    return torch.cat([rows.view(bits), meta.view(bits)], dim=-1).view(rows.dtype)


def unpack_rows(packed: torch.Tensor, hidden: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_rows``'s inverse for [P, H + M]: rows [P, H] (contiguous), ids [P, K] int32, weights [P, K] fp32."""
    bits = packed.view(_BITS[packed.element_size()])
    rows = bits[:, :hidden].contiguous().view(packed.dtype)
    meta = bits[:, hidden:].contiguous().view(torch.int32)
    return rows, meta[:, :top_k].contiguous(), meta[:, top_k:].contiguous().view(torch.float32)


def _run_experts(layer: FusedMoE, rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] == 0:
        return rows.new_zeros((0, layer.hidden_size))
    bias = layer.w2_bias if layer.tp_rank == 0 else None
    return layer.quant_method.apply(layer, rows, weights, ids, bias)


def _exchange_padded(layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, dest_ids: torch.Tensor,
                     group) -> torch.Tensor:
    """x [n, H], weights [n, K], dest_ids [R, n, K] -> [n, H]: every rank sends every rank its n rows."""
    ranks, n, top_k = dest_ids.shape
    hidden = x.shape[1]
    payload = pack_rows(x.unsqueeze(0).expand(ranks, n, hidden), dest_ids,
                        weights.unsqueeze(0).expand(ranks, n, top_k)).reshape(ranks * n, -1)
    rows, ids, wts = unpack_rows(comm.all_to_all(payload, group), hidden, top_k)       # rank j's rows at j * n
    back = comm.all_to_all(_run_experts(layer, rows, wts, ids), group)                # [R * n, H]
    return back.view(ranks, n, hidden).sum(dim=0)


def _exchange_exact(layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, dest_ids: torch.Tensor,
                    group) -> torch.Tensor:
    """As ``_exchange_padded``, but only the rows a rank needs move (their counts exchanged first)."""
    n, top_k = dest_ids.shape[1:]
    hidden = x.shape[1]
    hits = (dest_ids >= 0).any(dim=-1)                                                 # [R, n]
    send_counts = hits.sum(dim=1)                                                      # [R]
    recv_counts = comm.all_to_all(send_counts, group)                                  # [R]: what rank j sends here
    send, recv = torch.stack([send_counts, recv_counts]).tolist()                      # (the host sync)
    dest, token = hits.nonzero(as_tuple=True)                                          # [P], by rank, then token
    payload = pack_rows(x[token], dest_ids[dest, token], weights[token])               # [P, H + M]
    rows, ids, wts = unpack_rows(comm.all_to_all(payload, group, recv, send), hidden, top_k)
    back = comm.all_to_all(_run_experts(layer, rows, wts, ids), group, send, recv)    # [P, H]
    # Each (rank, token) pair comes back once: placed, then summed over the ranks in rank order (the same
    # order every run, unlike an index_add_ whose CUDA atomics add in arrival order).
    placed = x.new_zeros((dest_ids.shape[0], n, hidden))
    placed[dest, token] = back
    return placed.sum(dim=0)


def choose_exchange(layer: FusedMoE, x: torch.Tensor, top_k: int) -> str:
    """``layer.ep_exchange`` resolved (see the module docstring): the same answer on every rank."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if layer.ep_exchange == "exact" and capturing:
        raise RuntimeError("ep_exchange='exact' reads its row counts on the host, which a CUDA graph capture cannot: "
                           "use 'padded' or 'auto' (padded while capturing), or run the engine with enforce_eager")
    if layer.ep_exchange != "auto":
        return layer.ep_exchange
    if capturing:
        return "padded"
    return "padded" if expected_fill(layer.num_experts, top_k, layer.ep_size) >= PADDED_FILL else "exact"


def all_to_all_experts(layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, group, *, tokens_replicated: bool = True) -> torch.Tensor:
    """``layer``'s output for hidden [T, H] (the same on every rank of ``group``), topk_weights [T, K] fp32,
    topk_ids [T, K] global ids -> [T, H]: the whole layer's output with ``layer.reduce_results``, else this
    rank's partial sum (its dispatched rows, zeros elsewhere). See the module docstring.

    ``tokens_replicated=False``: the tokens are this rank's own (data-parallel attention: each rank's T may
    differ; for the padded exchange every rank must pass the same T, e.g. padded to a common bucket): no
    slice and no gather, the output is these tokens' [T, H] whatever ``reduce_results``."""
    if not tokens_replicated:
        top_k = topk_ids.shape[1]
        dest_ids = local_ids_per_rank(topk_ids, layer.shard.num_local_experts, layer.ep_size)
        exchange = _exchange_padded if choose_exchange(layer, hidden, top_k) == "padded" else _exchange_exact
        return exchange(layer, hidden.contiguous(), topk_weights, dest_ids, group)
    ranks, rank = layer.ep_size, layer.ep_rank
    num_tokens, top_k = topk_ids.shape
    start, stop, n = token_slice(num_tokens, ranks, rank)
    pad = n - (stop - start)
    x = F.pad(hidden[start:stop], (0, 0, 0, pad))                                      # [n, H]
    weights = F.pad(topk_weights[start:stop], (0, 0, 0, pad))                          # [n, K]
    ids = F.pad(topk_ids[start:stop], (0, 0, 0, pad), value=-1)                        # [n, K], pad rows go nowhere
    dest_ids = local_ids_per_rank(ids, layer.shard.num_local_experts, ranks)          # [R, n, K]
    exchange = _exchange_padded if choose_exchange(layer, x, top_k) == "padded" else _exchange_exact
    mine = exchange(layer, x, weights, dest_ids, group)                                # [n, H]
    if layer.reduce_results:
        return comm.all_gather(mine, group, 0)[:num_tokens]
    return F.pad(mine[:stop - start], (0, 0, start, num_tokens - stop))
