"""AITER adapters for mixture-of-experts: routing (aiter/ops/moe_op.py, aiter/ops/topk.py) and the
fused experts (aiter/fused_moe.py). AITER writes routing results into the tensors it is given.

Quantized experts go through the same ``fused_moe`` with AITER's ``QuantType`` (the enum of
csrc/include/aiter_enum.h): fp8 per-channel as ``per_Token`` (w1_scale [E, 2I, 1], w2_scale [E, H, 1],
AITER's layout comments), fp8 block-128 as ``per_1x128`` (ATOM's Fp8MoEMethod passes DeepSeek's
[E, 2I/128, H/128] / [E, H/128, I/128] scales so; ``per_128x128`` is remapped to it inside AITER);
a1_scale / a2_scale None: AITER quantizes the activations dynamically, per token or per 1 x 128 group,
as the twin does. MXFP4 is not mapped (``atom_core.ops.fused_moe._aiter_quant_supports`` says why).

AITER's CK/asm MoE kernels may read w13/w2 pre-shuffled (``aiter.ops.shuffle.shuffle_weight``, the
tensor tagged ``is_shuffled``); they look at the tag themselves. A model that shuffles its weights
for AITER must keep calling this backend: the other backends read the plain layout.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import aiter
import torch
from aiter import ActivationType, QuantType
from aiter.fused_moe import fused_moe as aiter_fused_moe


def topk_softmax(router_logits, renormalize, topk_weights, topk_ids):
    # token_expert_indices [T, K] int32 is AITER scratch (the flat (t, k) slot of each choice).
    token_expert_indices = torch.empty_like(topk_ids)
    aiter.topk_softmax(topk_weights, topk_ids, token_expert_indices, router_logits, renormalize)


def gpt_oss_topk(router_logits, topk_weights, topk_ids):
    # softmax over the K chosen logits = the K largest softmax probs renormalised.
    topk_softmax(router_logits, True, topk_weights, topk_ids)


def grouped_topk(router_logits, num_expert_group, topk_group, renormalize, scoring, e_score_correction_bias,
                 routed_scaling_factor, topk_weights, topk_ids):
    if e_score_correction_bias is None:
        aiter.grouped_topk(router_logits, topk_weights, topk_ids, num_expert_group, topk_group, renormalize,
                           is_softmax=scoring == "softmax", routed_scaling_factor=routed_scaling_factor)
    else:
        # sigmoid scoring only (checked by the op's supports); AITER reads the bias in the logits' dtype.
        aiter.biased_grouped_topk(router_logits, e_score_correction_bias.to(router_logits.dtype), topk_weights,
                                  topk_ids, num_expert_group, topk_group, renormalize,
                                  routed_scaling_factor=routed_scaling_factor)


def fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out):
    # Silu with [gate | up] halves, no biases and no quantisation: AITER's defaults
    # (activation=ActivationType.Silu, quant_type=QuantType.No). The op's supports() keeps other cases away.
    result = aiter_fused_moe(hidden, w13, w2, topk_weights, topk_ids, bias1=None, bias2=None)
    out.copy_(result)


def fused_experts_quant(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, activation,
                        w13_bias, w2_bias, out, hidden_q, hidden_scale):
    # fp8 formats, silu with [gate | up] halves, no biases (the op's supports() keeps other cases away). AITER
    # quantizes hidden itself: hidden_q / hidden_scale, hidden's own quantization by contract, are not read.
    quant_type = QuantType.per_1x128 if weight_format == "fp8_block" else QuantType.per_Token
    result = aiter_fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation=ActivationType.Silu,
                             quant_type=quant_type, w1_scale=w13_scale, w2_scale=w2_scale, a1_scale=None,
                             a2_scale=None, bias1=None, bias2=None)
    out.copy_(result)
