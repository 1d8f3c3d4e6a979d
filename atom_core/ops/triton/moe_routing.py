"""Triton MoE routing: one program per token, the token's E router logits in registers (E ≤ 512).

The logits are viewed as a [groups, experts per group] tile (one group when routing is not
grouped), so group scores are row reductions. Top-k is K rounds of "take the best still-available
entry, lowest index on ties", the same choice as the twin's stable sort.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import functools

import triton
import triton.language as tl

from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, next_power_of_2, unit_stride

MAX_EXPERTS = 512
_NONE = tl.constexpr(1 << 30)  # larger than any expert or group index
_RENORM_EPS = tl.constexpr(1e-20)


@triton.jit
def _best_index(values, index, available):
    """Index of the largest available entry of a 1-D tile, lowest index on ties.

    Falls back to the lowest available index when no entry compares (NaN), so the result is
    always an available index.
    """
    v = tl.where(available, values, float("-inf"))
    best = tl.max(v, axis=0)
    chosen = tl.min(tl.where(available & (v == best), index, _NONE), axis=0)
    fallback = tl.min(tl.where(available, index, _NONE), axis=0)
    return tl.where(chosen == _NONE, fallback, chosen)


@triton.jit
def _best_index_2d(values, index, available):
    """As :func:`_best_index` over a 2-D tile (index holds each entry's flat index)."""
    v = tl.where(available, values, float("-inf"))
    best = tl.max(tl.max(v, axis=1), axis=0)
    chosen = tl.min(tl.min(tl.where(available & (v == best), index, _NONE), axis=1), axis=0)
    fallback = tl.min(tl.min(tl.where(available, index, _NONE), axis=1), axis=0)
    return tl.where(chosen == _NONE, fallback, chosen)


@triton.jit
def _routing_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    num_groups, group_size, top_k, topk_group, scale,
    stride_lt, stride_le, stride_wt, stride_it,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, RENORMALIZE: tl.constexpr,
    GROUPS_P2: tl.constexpr, GROUP_SIZE_P2: tl.constexpr, K_P2: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS_P2)
    j = tl.arange(0, GROUP_SIZE_P2)
    valid = (g[:, None] < num_groups) & (j[None, :] < group_size)
    flat = g[:, None] * group_size + j[None, :]
    expert = tl.where(valid, flat, _NONE)  # the expert of each lane; padding lanes name none
    logits = tl.load(logits_ptr + t * stride_lt + flat * stride_le, mask=valid, other=float("-inf"))
    logits = logits.to(tl.float32)

    if SIGMOID:
        scores = tl.where(valid, tl.sigmoid(logits), 0.0)
    else:
        p = tl.where(valid, tl.exp(logits - tl.max(tl.max(logits, axis=1), axis=0)), 0.0)
        scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
    if HAS_BIAS:
        # The bias moves the choice only; the weights stay the unbiased scores.
        choice = scores + tl.load(bias_ptr + flat, mask=valid, other=0.0).to(tl.float32)
    else:
        choice = logits  # same order as the scores (both scorings increase with the logit), exact
    available = valid

    if GROUPED:
        v = tl.where(valid, choice, float("-inf"))
        top1 = tl.max(v, axis=1)
        if HAS_BIAS:
            # group score = sum of its two best entries (DeepSeek-V3 / GLM-4-MoE)
            first = tl.min(tl.where(v == top1[:, None], j[None, :], _NONE), axis=1)
            top2 = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), v), axis=1)
            group_score = top1 + top2
        else:
            group_score = top1  # its best entry (DeepSeek-V2)
        group_ok = g < num_groups
        kept = g < 0
        for _ in range(topk_group):
            kept = kept | (g == _best_index(group_score, g, group_ok & ~kept))
        available = valid & kept[:, None]

    slot = tl.arange(0, K_P2)
    weights = tl.zeros([K_P2], dtype=tl.float32)
    ids = tl.zeros([K_P2], dtype=tl.int32)
    for k in range(top_k):
        pick = _best_index_2d(choice, expert, available)
        available = available & (expert != pick)
        w = tl.sum(tl.sum(tl.where(expert == pick, scores, 0.0), axis=1), axis=0)
        weights = tl.where(slot == k, w, weights)
        ids = tl.where(slot == k, pick, ids)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + _RENORM_EPS)
    in_row = slot < top_k
    tl.store(weights_ptr + t * stride_wt + slot, weights * scale, mask=in_row)
    tl.store(ids_ptr + t * stride_it + slot, ids, mask=in_row)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _launch_config(num_experts: int, num_groups: int, top_k: int) -> tuple[int, int, int, int, int]:
    """(group_size, GROUPS_P2, GROUP_SIZE_P2, K_P2, num_warps) for E experts in G groups, top-K."""
    group_size = num_experts // num_groups
    num_warps = max(1, min(next_power_of_2(num_experts) // 128, 4))
    return group_size, next_power_of_2(num_groups), next_power_of_2(group_size), next_power_of_2(top_k), num_warps


def _launch(logits, bias, weights, ids, *, num_groups, topk_group, renormalize, sigmoid, scale):
    num_tokens, num_experts = logits.shape
    if num_tokens == 0:
        return
    top_k = ids.shape[1]
    group_size, groups_p2, group_size_p2, k_p2, num_warps = _launch_config(num_experts, num_groups, top_k)
    _routing_kernel[(num_tokens,)](
        logits, bias, weights, ids,
        num_groups, group_size, top_k, topk_group, float(scale),
        logits.stride(0), logits.stride(1), weights.stride(0), ids.stride(0),
        SIGMOID=sigmoid, HAS_BIAS=bias is not None, GROUPED=num_groups > 1, RENORMALIZE=renormalize,
        GROUPS_P2=groups_p2, GROUP_SIZE_P2=group_size_p2, K_P2=k_p2, num_warps=num_warps,
        **launch_kwargs(logits, num_tokens),
    )


def topk_softmax(router_logits, renormalize, topk_weights, topk_ids):
    _launch(router_logits, None, topk_weights, topk_ids, num_groups=1, topk_group=1, renormalize=renormalize,
            sigmoid=False, scale=1.0)


def grouped_topk(router_logits, num_expert_group, topk_group, renormalize, scoring, e_score_correction_bias,
                 routed_scaling_factor, topk_weights, topk_ids):
    (bias,) = unit_stride(e_score_correction_bias)
    _launch(router_logits, bias, topk_weights, topk_ids, num_groups=num_expert_group,
            topk_group=topk_group, renormalize=renormalize, sigmoid=scoring == "sigmoid",
            scale=routed_scaling_factor)


def gpt_oss_topk(router_logits, topk_weights, topk_ids):
    # softmax over the K chosen logits = the full softmax's top-K probs renormalised.
    _launch(router_logits, None, topk_weights, topk_ids, num_groups=1, topk_group=1, renormalize=True,
            sigmoid=False, scale=1.0)
