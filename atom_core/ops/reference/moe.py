"""Reference twins for mixture-of-experts: routing (which experts each token uses, with what weight)
and the fused experts (the weighted sum of the chosen experts' gated MLPs), with plain or quantized
expert weights. Plain torch, fp32 math.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

from typing import Callable

import torch

from atom_core.ops.reference.activation import silu_and_mul, swiglu_clamped
from atom_core.ops.reference.quant import FP8_DTYPE, GROUP_SIZE, dequantize, per_group_quant, per_token_quant
from atom_core.ops.reference.scaled_mm import expand_block_scales

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
               b13: torch.Tensor | None, b2: torch.Tensor | None, intermediate_dtype: torch.dtype,
               activation_quant: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """One expert on its tokens: x [N, H] fp32, w13 [2I, H], w2 [H, I], b13 [2I] | None, b2 [H] | None → [N, H] fp32.

    gate_up = x @ w13ᵀ + b13; a = act(gate_up) rounded to ``intermediate_dtype`` (the activation a
    model stores between the two GEMMs); y = a @ w2ᵀ + b2. ``activation_quant`` (fp8 weights:
    quantize-then-dequantize, [N, C] fp32 → [N, C] fp32) replaces x and a by what the GEMMs read.
    """
    if activation_quant is not None:
        x = activation_quant(x)
    gate_up = x @ w13.float().t()
    if b13 is not None:
        gate_up = gate_up + b13.float()
    act = silu_and_mul(gate_up) if activation == "silu" else swiglu_clamped(gate_up, 1.702, 7.0)
    act = act.to(intermediate_dtype).float()
    if activation_quant is not None:
        act = activation_quant(act)
    y = act @ w2.float().t()
    return y if b2 is None else y + b2.float()


def _experts_loop(hidden: torch.Tensor, num_experts: int, expert_weights, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str, w13_bias, w2_bias, activation_quant=None) -> torch.Tensor:
    """The loop of :func:`fused_experts`; ``expert_weights(e)`` → (w13[e], w2[e]) in any float dtype,
    called only for the experts some token chose."""
    x = hidden.float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in range(num_experts):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        w13_e, w2_e = expert_weights(e)
        y = expert_mlp(x[tokens], w13_e, w2_e, activation, None if w13_bias is None else w13_bias[e],
                       None if w2_bias is None else w2_bias[e], hidden.dtype, activation_quant)
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float()[:, None])
    return out.to(hidden.dtype)


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
    return _experts_loop(hidden, w13.shape[0], lambda e: (w13[e], w2[e]), topk_weights, topk_ids, activation,
                         w13_bias, w2_bias)


# ------------------------------------------------------------------------------ quantized expert weights
#
# Formats of ``fused_experts_quant`` (weights [E, N, K]: N output rows, K the reduced dim, as
# nn.Linear stores them; w13: N = 2I, K = H; w2: N = H, K = I):
#
# | format      | weight                      | scale                                   | activations        |
# |-------------|-----------------------------|-----------------------------------------|--------------------|
# | fp8_block   | fp8 e4m3fn [E, N, K]        | fp32 [E, ceil(N/128), ceil(K/128)]      | fp8, 1 x 128 groups |
# | fp8_channel | fp8 e4m3fn [E, N, K]        | fp32 [E, N, 1]                          | fp8, per token     |
# | mxfp4       | uint8 [E, N, K/2], 2 codes  | uint8 e8m0 [E, N, K/32]                 | hidden's dtype     |
#
# Scales multiply (block: DeepSeek's weight_scale_inv as stored; w13's row blocks run over its 2I
# rows as stacked, row r in block r // 128). MXFP4 (OCP microscaling, GPT-OSS's layout): byte j of a
# row holds element 2j in its low nibble and 2j + 1 in its high nibble; a code is an E2M1 value
# (sign bit, 3-bit magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6); element k is
# E2M1_VALUES[code] * 2 ** (scale[k // 32] - 127); scale 255 is NaN.

WEIGHT_FORMATS = ("fp8_block", "fp8_channel", "mxfp4")
FP8_BLOCK = GROUP_SIZE  # 128 x 128 weight blocks, 1 x 128 activation groups
MXFP4_BLOCK = 32  # elements per e8m0 scale
E8M0_BIAS = 127
E8M0_NAN = 255
# code -> value (OCP E2M1). The same table as models/mxfp4.py's, which ops may not import;
# tests/ops/test_fused_moe_quant.py pins the two (and the Triton decode) together.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., N, K/2] and scales uint8 [..., N, K/32] → fp32 [..., N, K] (exact)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()  # element 2j, then 2j + 1
    exponent = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(lut[codes], exponent.repeat_interleave(MXFP4_BLOCK, dim=-1))
    return values.masked_fill((scales == E8M0_NAN).repeat_interleave(MXFP4_BLOCK, dim=-1), float("nan"))


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, weight_format: str) -> torch.Tensor:
    """One expert's weight [N, K] (mxfp4: [N, K/2] packed) and its scale → fp32 [N, K]."""
    if weight_format == "mxfp4":
        return dequantize_mxfp4(w, scale)
    if weight_format == "fp8_channel":
        return w.float() * scale.float()
    return w.float() * expand_block_scales(scale, w.shape[0], w.shape[1], FP8_BLOCK)


def quantize_activation(x: torch.Tensor, weight_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An activation x [N, C] as the GEMMs of an fp8 ``weight_format`` read it (``reference.quant``): fp8
    with scales per 1 x 128 group [N, ceil(C / 128)] for fp8_block, per row [N, 1] for fp8_channel."""
    if weight_format == "fp8_block":
        return per_group_quant(x, FP8_DTYPE, FP8_BLOCK)
    return per_token_quant(x, FP8_DTYPE)


def activation_quantizer(weight_format: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the GEMMs of ``weight_format`` read for an activation x [N, C]: fp8 weights quantize it
    dynamically (:func:`quantize_activation`) and multiply back; MXFP4 weights read it as it is
    (weight-only)."""
    if weight_format not in ("fp8_block", "fp8_channel"):
        return None
    group = FP8_BLOCK if weight_format == "fp8_block" else None
    return lambda x: dequantize(*quantize_activation(x, weight_format), group)


def fused_experts_quant(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                        w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        weight_format: str, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fused_experts` with quantized expert weights (formats in the table above).

    Each chosen expert's weights are dequantized to fp32 (one expert at a time); with fp8 weights
    the GEMM inputs (hidden, and the activation after its rounding to hidden's dtype) are quantized
    to fp8 and dequantized (``activation_quantizer``); then the fp32 expert loop. → [T, H] in
    hidden's dtype.
    """
    def expert_weights(e):
        return (dequantize_weight(w13[e], w13_scale[e], weight_format),
                dequantize_weight(w2[e], w2_scale[e], weight_format))

    return _experts_loop(hidden, w13.shape[0], expert_weights, topk_weights, topk_ids, activation, w13_bias,
                         w2_bias, activation_quantizer(weight_format))
