"""Reference twins for mixture-of-experts: routing (which experts each token uses, with what weight)
and the fused experts (the weighted sum of the chosen experts' gated MLPs). Plain torch, fp32 math.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import torch

from atom_core.ops.reference.activation import silu_and_mul, swiglu_clamped

# Denominator guard of the sigmoid-scored renormalisation (DeepSeek-V3 / GLM-4-MoE add it too):
# sigmoid scores can all underflow to 0, softmax scores cannot.
RENORM_EPS = 1e-20


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row [R, N] → int64 [R, k], largest first.

    Ties go to the lower index first (a stable sort keeps equal entries in index order), so the
    choice is deterministic; ``torch.topk`` leaves the order of ties unspecified.
    """
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Softmax routing (Mixtral, Qwen2/3-MoE, OLMoE).

    router_logits [T, E] (any float dtype) → ``(topk_weights [T, K] fp32, topk_ids [T, K] int32)``.
    probs = softmax(logits) over E in fp32; the K experts with the largest logits (the same ones as
    the largest probs, as softmax is increasing; choosing on the logits is exact on every backend)
    in descending order, ties to the lower expert index; weights = their probs, divided by their
    sum when ``renormalize`` (Mixtral always, Qwen3-MoE when ``norm_topk_prob``).
    """
    logits = router_logits.float()
    ids = top_indices(logits, top_k)
    weights = torch.softmax(logits, dim=-1).gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def grouped_topk(router_logits: torch.Tensor, top_k: int, num_expert_group: int, topk_group: int,
                 renormalize: bool, scoring: str = "softmax", e_score_correction_bias: torch.Tensor | None = None,
                 routed_scaling_factor: float = 1.0):
    """Group-limited routing (DeepSeek-V2/V3, GLM-4-MoE): experts come in ``num_expert_group`` groups
    of E / G consecutive experts; only the best ``topk_group`` groups may be chosen from.

    router_logits [T, E]; e_score_correction_bias [E] or None →
    ``(topk_weights [T, K] fp32, topk_ids [T, K] int32)``.

    1. scores = softmax(logits) over E, or sigmoid(logits), in fp32.
    2. choice = scores + bias when a bias is given, else the logits themselves (the same order as
       the scores, as both scorings are increasing in the logit, and exact on every backend).
    3. group score = sum of the two largest choice values in the group when a bias is given
       (DeepSeek-V3 / GLM-4-MoE), the largest one otherwise (DeepSeek-V2 ``group_limited_greedy``).
    4. keep the ``topk_group`` best groups (ties to the lower group), mask the other experts out,
       take the K best choice values among the rest (ties to the lower expert).
    5. weights = the UNBIASED scores of those experts (the bias moves the choice only), divided by
       their sum (+1e-20) when ``renormalize``, then times ``routed_scaling_factor``.
    """
    logits = router_logits.float()
    num_tokens, num_experts = logits.shape
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = logits if e_score_correction_bias is None else scores + e_score_correction_bias.float()

    per_group = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
    if e_score_correction_bias is None:
        group_scores = per_group.max(dim=-1).values
    else:
        group_scores = per_group.sort(dim=-1, descending=True).values[..., :2].sum(dim=-1)
    kept_groups = top_indices(group_scores, topk_group)
    group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_kept = group_kept.repeat_interleave(num_experts // num_expert_group, dim=1)

    ids = top_indices(choice.masked_fill(~expert_kept, float("-inf")), top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def gpt_oss_topk(router_logits: torch.Tensor, top_k: int):
    """GPT-OSS routing: the K largest logits (the router's bias already added by the caller), then a
    softmax over those K logits only.

    router_logits [T, E] → ``(topk_weights [T, K] fp32, topk_ids [T, K] int32)``, descending, ties
    to the lower expert. (The same numbers as :func:`topk_softmax` with ``renormalize=True``:
    ``softmax(l)_i / sum_j∈top softmax(l)_j = exp(l_i) / sum_j∈top exp(l_j)``.)
    """
    logits = router_logits.float()
    ids = top_indices(logits, top_k)
    weights = torch.softmax(logits.gather(1, ids), dim=-1)
    return weights, ids.to(torch.int32)


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str,
               b13: torch.Tensor | None, b2: torch.Tensor | None, intermediate_dtype: torch.dtype) -> torch.Tensor:
    """One expert on its tokens: x [N, H] fp32, w13 [2I, H], w2 [H, I], b13 [2I] | None, b2 [H] | None → [N, H] fp32.

    gate_up = x @ w13ᵀ + b13; a = act(gate_up) rounded to ``intermediate_dtype`` (the activation a
    model stores between the two GEMMs); y = a @ w2ᵀ + b2.
    """
    gate_up = x @ w13.float().t()
    if b13 is not None:
        gate_up = gate_up + b13.float()
    act = silu_and_mul(gate_up) if activation == "silu" else swiglu_clamped(gate_up, 1.702, 7.0)
    y = act.to(intermediate_dtype).float() @ w2.float().t()
    return y if b2 is None else y + b2.float()


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mixture of gated-MLP experts, one plain loop over the experts.

    hidden [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, K]; topk_ids [T, K] (int);
    w13_bias [E, 2I] | None; w2_bias [E, H] | None → [T, H] in hidden's dtype.

    out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]), summed in fp32 and
    rounded once. An id outside [0, E) contributes nothing (a dropped slot, e.g. -1).
    "silu": w13 rows [0, I) are the gate, [I, 2I) the up projection, act = silu(gate) * up.
    "swiglu_clamped" (GPT-OSS): rows interleaved (2j gate, 2j+1 up), act = (up + 1) * g * sigmoid(1.702 g)
    with g = gate.clamp(max=7), up clamped to [-7, 7].
    """
    x = hidden.float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        y = expert_mlp(x[tokens], w13[e], w2[e], activation,
                       None if w13_bias is None else w13_bias[e], None if w2_bias is None else w2_bias[e], hidden.dtype)
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float()[:, None])
    return out.to(hidden.dtype)
