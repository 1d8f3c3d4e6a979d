"""Fused mixture-of-experts: ``fused_experts`` — the routing-weighted sum of each token's K experts.

Each expert is a gated MLP: ``expert_e(x) = w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]``. The routing
(which experts, what weights) comes from :mod:`atom_core.ops.moe_routing`; a model's MoE layer
composes the two.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import moe as reference_moe
from atom_core.ops.validation import (FLOAT_DTYPES, check_out, check_out_shape, check_same_device, check_shape,
                                      check_tensor, debug_enabled)

FUSED_EXPERTS = Op("fused_experts")

ACTIVATIONS = ("silu", "swiglu_clamped")
_ID_DTYPES = (torch.int32, torch.int64)


def _torch_fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out):
    out.copy_(reference_moe.fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias))


def _aiter_supports(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out) -> str | None:
    if activation != "silu":
        return f"aiter fused_moe is used for silu with [gate | up] halves only, got {activation!r}"
    if w13_bias is not None or w2_bias is not None:
        return "aiter fused_moe is used without expert biases"
    if hidden.dtype not in (torch.float16, torch.bfloat16):
        return f"aiter fused_moe is used for fp16/bf16, got {hidden.dtype}"
    if topk_weights.dtype != torch.float32 or topk_ids.dtype != torch.int32:
        return "aiter fused_moe needs fp32 topk_weights and int32 topk_ids"
    if not all(t.is_contiguous() for t in (hidden, w13, w2, topk_weights, topk_ids)):
        return "aiter fused_moe needs contiguous hidden, weights and routing tensors"
    return None


def _aiter_key(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out):
    """What :func:`_aiter_supports` reads."""
    return (activation, w13_bias is None, w2_bias is None, hidden.dtype, topk_weights.dtype, topk_ids.dtype,
            hidden.is_contiguous(), w13.is_contiguous(), w2.is_contiguous(), topk_weights.is_contiguous(),
            topk_ids.is_contiguous())


FUSED_EXPERTS.register("torch", _torch_fused_experts)
FUSED_EXPERTS.register("triton", "atom_core.ops.triton.fused_moe:fused_experts")  # any layout, any dtype
FUSED_EXPERTS.register("aiter", "atom_core.ops.aiter.moe:fused_experts", _aiter_supports, _aiter_key)


@custom_op("fused_experts", mutates_args=("out",))
def _fused_experts_op(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                      activation: str, w13_bias: Optional[Tensor], w2_bias: Optional[Tensor], out: Tensor,
                      backend: Optional[str]) -> None:
    FUSED_EXPERTS(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out, backend=backend)


@_fused_experts_op.register_fake
def _(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out, backend) -> None:
    return None


def _check_fused_experts_args(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out):
    """The per-call checks, run in debug mode only (atom_core.ops.validation)."""
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, hidden_size = hidden.shape
    check_tensor("w13", w13, ndim=3, dtypes=(hidden.dtype,))
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    if two_inter % 2:
        raise ValueError(f"w13 must hold 2I rows per expert (gate and up), got shape {tuple(w13.shape)}")
    inter = two_inter // 2
    check_shape("w13", w13, (num_experts, two_inter, hidden_size))
    check_tensor("w2", w2, ndim=3, dtypes=(hidden.dtype,))
    check_shape("w2", w2, (num_experts, hidden_size, inter))
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_ID_DTYPES)
    check_shape("topk_ids", topk_ids, (num_tokens, None))
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must have at least one choice per token, got shape {tuple(topk_ids.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if w13_bias is not None:
        check_tensor("w13_bias", w13_bias, ndim=2, dtypes=FLOAT_DTYPES)
        check_shape("w13_bias", w13_bias, (num_experts, two_inter))
    if w2_bias is not None:
        check_tensor("w2_bias", w2_bias, ndim=2, dtypes=FLOAT_DTYPES)
        check_shape("w2_bias", w2_bias, (num_experts, hidden_size))
    check_same_device(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
                      w13_bias=w13_bias, w2_bias=w2_bias)
    check_out("out", out, hidden.shape, hidden.dtype, hidden.device)


def fused_experts(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, *,
                  activation: str = "silu", w13_bias: Tensor | None = None, w2_bias: Tensor | None = None,
                  out: Tensor | None = None, backend: str | None = None) -> Tensor:
    """``out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])``.

    hidden: [T, H] fp32/fp16/bf16. w13: [E, 2I, H] and w2: [E, H, I] in hidden's dtype (the rows of
    each expert's gate/up and down projections, as ``nn.Linear`` stores them).
    topk_weights: [T, K] float (fp32 from the routing functions); topk_ids: [T, K] int32/int64 in
    [0, E) — the torch and triton backends also take an id outside [0, E) (e.g. -1) as a dropped
    choice that adds nothing, AITER does not. w13_bias: [E, 2I] or None; w2_bias: [E, H] or None.

    activation="silu": w13 rows [0, I) are the gate, [I, 2I) the up projection (as ``silu_and_mul``),
    act = silu(gate) * up. activation="swiglu_clamped" (GPT-OSS): rows interleaved, 2j gate and
    2j+1 up, act = (up.clamp(-7, 7) + 1) * g * sigmoid(1.702 g) with g = gate.clamp(max=7).
    The activation between the two projections is rounded to hidden's dtype; everything else is
    fp32 math. Returns out [T, H] in hidden's dtype.
    """
    if debug_enabled():
        _check_fused_experts_args(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out)
    elif out is not None:  # always on (see check_out_shape)
        check_out_shape("out", out, hidden.shape)
    out = torch.empty_like(hidden) if out is None else out
    call_op("fused_experts", hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out, backend)
    return out
