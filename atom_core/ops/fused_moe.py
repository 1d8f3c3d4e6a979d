"""Fused mixture-of-experts: ``fused_experts`` — the routing-weighted sum of each token's K experts —
and ``fused_experts_quant``, the same with quantized expert weights (fp8 block-128, fp8 per-channel,
MXFP4 kept packed).

Each expert is a gated MLP: ``expert_e(x) = w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]``. The routing
(which experts, what weights) comes from :mod:`atom_core.ops.moe_routing`; a model's MoE layer
composes the two.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from atom_core.ops import quant as quant_ops
from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import moe as reference_moe
from atom_core.ops.reference.moe import FP8_BLOCK, MXFP4_BLOCK, WEIGHT_FORMATS
from atom_core.ops.reference.quant import FP8_DTYPE
from atom_core.ops.validation import (FLOAT_DTYPES, check_out, check_out_shape, check_same_device, check_shape,
                                      check_tensor, debug_enabled)

FUSED_EXPERTS = Op("fused_experts")
FUSED_EXPERTS_QUANT = Op("fused_experts_quant")

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


def _check_routing_and_biases(hidden, num_experts, two_inter, topk_weights, topk_ids, activation, w13_bias, w2_bias):
    num_tokens, hidden_size = hidden.shape
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


def _check_fused_experts_args(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out):
    """The per-call checks, run in debug mode only (atom_core.ops.validation)."""
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    hidden_size = hidden.shape[1]
    check_tensor("w13", w13, ndim=3, dtypes=(hidden.dtype,))
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    if two_inter % 2:
        raise ValueError(f"w13 must hold 2I rows per expert (gate and up), got shape {tuple(w13.shape)}")
    inter = two_inter // 2
    check_shape("w13", w13, (num_experts, two_inter, hidden_size))
    check_tensor("w2", w2, ndim=3, dtypes=(hidden.dtype,))
    check_shape("w2", w2, (num_experts, hidden_size, inter))
    _check_routing_and_biases(hidden, num_experts, two_inter, topk_weights, topk_ids, activation, w13_bias, w2_bias)
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


# ------------------------------------------------------------------------------ quantized expert weights

def _torch_fused_experts_quant(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format,
                               activation, w13_bias, w2_bias, out, hidden_q, hidden_scale):
    # hidden_q / hidden_scale are hidden's own quantization (the op's contract): the twin quantizes hidden itself
    out.copy_(reference_moe.fused_experts_quant(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids,
                                                weight_format, activation, w13_bias, w2_bias))


def _triton_quant_supports(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, *rest):
    if weight_format != "mxfp4" and hidden.is_cuda and not quant_ops.fp8_e4m3fn_native(hidden.device):
        return "triton fp8 e4m3fn MoE needs an NVIDIA GPU of compute capability 8.9+ or an AMD gfx95x"
    return None


def _triton_quant_key(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, *rest):
    """What :func:`_triton_quant_supports` reads (the device is part of every call's signature)."""
    return weight_format


def _aiter_quant_supports(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, activation,
                          w13_bias, w2_bias, out, hidden_q, hidden_scale) -> str | None:
    if weight_format == "mxfp4":
        # aiter/fused_moe.py, QuantType.per_1x32: bf16 activations only with ActivationType.Swiglu on
        # gate/up halves, weights and scales pre-shuffled (moe_shuffle_weight / moe_shuffle_scale) and
        # H, I padded to 256 (ATOM's Mxfp4MoEMethod prepares them so); with Silu it quantizes the
        # activations to MXFP4 too (A4W4). Neither is this op's GPT-OSS layout with bf16 activations.
        return ("aiter's MXFP4 fused MoE (per_1x32) needs gate/up halves pre-shuffled for its Swiglu, or "
                "quantizes activations to MXFP4 with Silu: not this op's interleaved, weight-only layout")
    reason = _aiter_supports(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out)
    if reason is not None:
        return reason
    if not (w13_scale.is_contiguous() and w2_scale.is_contiguous()):
        return "aiter fused_moe needs contiguous weight scales"
    if not quant_ops.fp8_e4m3fn_native(hidden.device):
        return "aiter's fp8 on this GPU is e4m3fnuz, not torch.float8_e4m3fn"
    if weight_format == "fp8_block" and (hidden.shape[1] % FP8_BLOCK or w2.shape[2] % FP8_BLOCK):
        # its per_1x128 activation quantization views rows in groups of 128
        return (f"aiter's block-fp8 fused MoE needs H and I multiples of {FP8_BLOCK}, got H = {hidden.shape[1]}, "
                f"I = {w2.shape[2]}")
    return None


def _aiter_quant_key(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, activation,
                     w13_bias, w2_bias, out, hidden_q, hidden_scale):
    """What :func:`_aiter_quant_supports` reads."""
    return (weight_format, _aiter_key(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out),
            w13_scale.is_contiguous(), w2_scale.is_contiguous(), hidden.shape[1] % FP8_BLOCK == 0,
            w2.shape[2] % FP8_BLOCK == 0)


FUSED_EXPERTS_QUANT.register("torch", _torch_fused_experts_quant)
FUSED_EXPERTS_QUANT.register("triton", "atom_core.ops.triton.fused_moe:fused_experts_quant", _triton_quant_supports,
                             _triton_quant_key)
FUSED_EXPERTS_QUANT.register("aiter", "atom_core.ops.aiter.moe:fused_experts_quant", _aiter_quant_supports,
                             _aiter_quant_key)


@custom_op("fused_experts_quant", mutates_args=("out",))
def _fused_experts_quant_op(hidden: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
                            topk_weights: Tensor, topk_ids: Tensor, weight_format: str, activation: str,
                            w13_bias: Optional[Tensor], w2_bias: Optional[Tensor], out: Tensor,
                            hidden_q: Optional[Tensor], hidden_scale: Optional[Tensor],
                            backend: Optional[str]) -> None:
    FUSED_EXPERTS_QUANT(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, activation,
                        w13_bias, w2_bias, out, hidden_q, hidden_scale, backend=backend)


@_fused_experts_quant_op.register_fake
def _(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, activation, w13_bias, w2_bias,
      out, hidden_q, hidden_scale, backend) -> None:
    return None


def quant_weight_shapes(weight_format: str, num_experts: int, rows: int, cols: int) -> tuple[tuple, tuple]:
    """(weight shape, scale shape) of one stack of ``num_experts`` [rows, cols] matrices in ``weight_format``."""
    if weight_format == "mxfp4":
        return (num_experts, rows, cols // 2), (num_experts, rows, cols // MXFP4_BLOCK)
    if weight_format == "fp8_channel":
        return (num_experts, rows, cols), (num_experts, rows, 1)
    return (num_experts, rows, cols), (num_experts, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))


def _check_fused_experts_quant_args(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format,
                                    activation, w13_bias, w2_bias, out):
    """The per-call checks, run in debug mode only (atom_core.ops.validation)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    hidden_size = hidden.shape[1]
    mxfp4 = weight_format == "mxfp4"
    weight_dtype, scale_dtype = (torch.uint8, torch.uint8) if mxfp4 else (FP8_DTYPE, torch.float32)
    check_tensor("w13", w13, ndim=3, dtypes=(weight_dtype,))
    check_tensor("w2", w2, ndim=3, dtypes=(weight_dtype,))
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    if two_inter % 2:
        raise ValueError(f"w13 must hold 2I rows per expert (gate and up), got shape {tuple(w13.shape)}")
    inter = two_inter // 2
    if mxfp4 and (hidden_size % MXFP4_BLOCK or inter % MXFP4_BLOCK):
        raise ValueError(f"mxfp4 weights need H and I multiples of {MXFP4_BLOCK} (whole scale blocks), "
                         f"got H = {hidden_size}, I = {inter}")
    for name, w, scale, rows, cols in (("w13", w13, w13_scale, two_inter, hidden_size),
                                       ("w2", w2, w2_scale, hidden_size, inter)):
        w_shape, scale_shape = quant_weight_shapes(weight_format, num_experts, rows, cols)
        check_shape(name, w, w_shape)
        check_tensor(f"{name}_scale", scale, ndim=3, dtypes=(scale_dtype,))
        check_shape(f"{name}_scale", scale, scale_shape)
    _check_routing_and_biases(hidden, num_experts, two_inter, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    check_same_device(hidden=hidden, w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale,
                      topk_weights=topk_weights, topk_ids=topk_ids, w13_bias=w13_bias, w2_bias=w2_bias)
    check_out("out", out, hidden.shape, hidden.dtype, hidden.device)


def _check_hidden_quant(hidden, weight_format, hidden_q, hidden_scale):
    """Debug mode: hidden_q / hidden_scale (both or neither, checked before), when given, are hidden's
    quantization in the format's activation scheme (``reference.moe.quantize_activation``'s), bit for bit."""
    if hidden_q is None:
        return
    if weight_format not in ("fp8_block", "fp8_channel"):
        raise ValueError(f"hidden_q / hidden_scale: {weight_format} GEMMs read hidden itself (weight-only)")
    want_q, want_scale = reference_moe.quantize_activation(hidden, weight_format)
    check_tensor("hidden_q", hidden_q, ndim=2, dtypes=(FP8_DTYPE,))
    check_shape("hidden_q", hidden_q, tuple(want_q.shape))
    check_tensor("hidden_scale", hidden_scale, ndim=2, dtypes=(torch.float32,))
    check_shape("hidden_scale", hidden_scale, tuple(want_scale.shape))
    if not (torch.equal(hidden_q.float(), want_q.float()) and torch.equal(hidden_scale, want_scale)):
        raise ValueError(f"hidden_q / hidden_scale are not hidden's {weight_format} quantization "
                         "(reference.quant per_group_quant / per_token_quant of hidden)")


def fused_experts_quant(hidden: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
                        topk_weights: Tensor, topk_ids: Tensor, *, weight_format: str, activation: str = "silu",
                        w13_bias: Tensor | None = None, w2_bias: Tensor | None = None, out: Tensor | None = None,
                        hidden_q: Tensor | None = None, hidden_scale: Tensor | None = None,
                        backend: str | None = None) -> Tensor:
    """:func:`fused_experts` with quantized expert weights; ``weight_format`` says which:

    ================  ===========================  =================================  ==========================
    weight_format     w13 / w2                     w13_scale / w2_scale               activations in the GEMMs
    ================  ===========================  =================================  ==========================
    ``"fp8_block"``   fp8 e4m3fn [E, 2I, H] /      fp32 [E, ceil(2I/128), ceil(H/128)]  fp8, dynamic per
                      [E, H, I]                    / [E, ceil(H/128), ceil(I/128)]     1 x 128 group
    ``"fp8_channel"`` fp8 e4m3fn, as above         fp32 [E, 2I, 1] / [E, H, 1]         fp8, dynamic per token
    ``"mxfp4"``       uint8 [E, 2I, H/2] /         uint8 e8m0 [E, 2I, H/32] /          hidden's dtype
                      [E, H, I/2]: 2 e2m1 codes    [E, H, I/32]                        (weight-only)
                      per byte, low nibble first
    ================  ===========================  =================================  ==========================

    Scales multiply (block: DeepSeek's ``weight_scale_inv`` as stored; w13's row block r // 128 of its
    2I stacked rows). MXFP4 is GPT-OSS's ``*_blocks`` [E, N, K/32, 16] flattened to [E, N, K/2] (a view)
    with its ``*_scales``; H and I must be multiples of 32. Everything else (hidden [T, H] fp32/fp16/
    bf16, routing, activation and its gate/up row layout, biases, ``out``) is as in :func:`fused_experts`.
    The twin dequantizes each chosen expert to fp32 and, for fp8, quantizes the hidden and intermediate
    activations as ``per_group_quant`` / ``per_token_quant`` do (``reference.moe.fused_experts_quant``).

    ``hidden_q`` / ``hidden_scale`` (fp8 formats, both or neither): hidden already quantized as the gate/up
    GEMM reads it, fp8 e4m3fn [T, H] with fp32 scales [T, ceil(H / 128)] (fp8_block) or [T, 1] (fp8_channel),
    e.g. by the norm that produced hidden (``rms_norm_quant(..., normed=hidden)``, one launch for both). They
    must be hidden's own quantization (checked in debug mode): the Triton backend reads them instead of
    quantizing hidden (one launch fewer), the twin and AITER quantize hidden themselves.
    """
    if (hidden_q is None) != (hidden_scale is None):  # always on: one without the other is never meant
        raise ValueError("hidden_q and hidden_scale come together (hidden's quantization and its scales)")
    if debug_enabled():
        _check_fused_experts_quant_args(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format,
                                        activation, w13_bias, w2_bias, out)
        _check_hidden_quant(hidden, weight_format, hidden_q, hidden_scale)
    elif out is not None:  # always on (see check_out_shape)
        check_out_shape("out", out, hidden.shape)
    out = torch.empty_like(hidden) if out is None else out
    call_op("fused_experts_quant", hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format,
            activation, w13_bias, w2_bias, out, hidden_q, hidden_scale, backend)
    return out
