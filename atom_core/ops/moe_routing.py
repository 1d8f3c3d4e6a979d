"""Mixture-of-experts routing: which K experts each token goes to, and with what weight.

One function per routing family, each returning ``(topk_weights [T, K] fp32, topk_ids [T, K] int32)``
with each row's experts in descending order of preference:

* :func:`topk_softmax` — softmax over E, top-K, optional renormalisation (Mixtral, Qwen2/3-MoE, OLMoE);
* :func:`grouped_topk` — group-limited choice with softmax or sigmoid scores, an optional
  selection-only correction bias and a scaling factor (DeepSeek-V2/V3, GLM-4-MoE);
* :func:`gpt_oss_topk` — top-K logits, softmax over those K (GPT-OSS).

Ties go to the lower expert index on every backend (the twin sorts stably; HF's ``torch.topk``
leaves ties unspecified, so the two agree whenever the K-th best entry is not tied). On the torch
and triton backends a row holding NaN gets unspecified, but in-range and distinct, experts.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import moe as reference_moe
from atom_core.ops.validation import FLOAT_DTYPES, check_same_device, check_shape, check_tensor, debug_enabled

TOPK_SOFTMAX = Op("topk_softmax")
GROUPED_TOPK = Op("grouped_topk")
GPT_OSS_TOPK = Op("gpt_oss_topk")

SCORINGS = ("softmax", "sigmoid")
TRITON_MAX_EXPERTS = 512  # one token's logits live in one program's registers


def _copy_routing(result, topk_weights, topk_ids):
    topk_weights.copy_(result[0])
    topk_ids.copy_(result[1])


def _torch_topk_softmax(router_logits, renormalize, topk_weights, topk_ids):
    result = reference_moe.topk_softmax(router_logits, topk_ids.shape[1], renormalize)
    _copy_routing(result, topk_weights, topk_ids)


def _torch_grouped_topk(router_logits, num_expert_group, topk_group, renormalize, scoring, e_score_correction_bias,
                        routed_scaling_factor, topk_weights, topk_ids):
    result = reference_moe.grouped_topk(router_logits, topk_ids.shape[1], num_expert_group, topk_group, renormalize,
                                        scoring, e_score_correction_bias, routed_scaling_factor)
    _copy_routing(result, topk_weights, topk_ids)


def _torch_gpt_oss_topk(router_logits, topk_weights, topk_ids):
    _copy_routing(reference_moe.gpt_oss_topk(router_logits, topk_ids.shape[1]), topk_weights, topk_ids)


def _triton_supports(router_logits, *rest) -> str | None:
    if router_logits.shape[1] > TRITON_MAX_EXPERTS:
        return (f"triton routing holds a token's logits in one program: "
                f"E={router_logits.shape[1]} > {TRITON_MAX_EXPERTS}")
    return None


def _triton_key(router_logits, *rest):
    """What :func:`_triton_supports` reads."""
    return router_logits.shape[1] > TRITON_MAX_EXPERTS


def _aiter_contiguous(router_logits, *rest) -> str | None:
    if not router_logits.is_contiguous():
        return "aiter routing kernels need contiguous router_logits"
    return None


def _aiter_grouped_supports(router_logits, num_expert_group, topk_group, renormalize, scoring,
                            e_score_correction_bias, *rest) -> str | None:
    if e_score_correction_bias is not None and scoring != "sigmoid":
        return "aiter biased_grouped_topk scores with sigmoid only"
    return _aiter_contiguous(router_logits)


def _aiter_contiguous_key(router_logits, *rest):
    """What :func:`_aiter_contiguous` reads."""
    return router_logits.is_contiguous()


def _aiter_grouped_key(router_logits, num_expert_group, topk_group, renormalize, scoring,
                       e_score_correction_bias, *rest):
    """What :func:`_aiter_grouped_supports` reads."""
    return e_score_correction_bias is None, scoring, router_logits.is_contiguous()


TOPK_SOFTMAX.register("torch", _torch_topk_softmax)
TOPK_SOFTMAX.register("triton", "atom_core.ops.triton.moe_routing:topk_softmax", _triton_supports, _triton_key)
TOPK_SOFTMAX.register("aiter", "atom_core.ops.aiter.moe:topk_softmax", _aiter_contiguous, _aiter_contiguous_key)
GROUPED_TOPK.register("torch", _torch_grouped_topk)
GROUPED_TOPK.register("triton", "atom_core.ops.triton.moe_routing:grouped_topk", _triton_supports, _triton_key)
GROUPED_TOPK.register("aiter", "atom_core.ops.aiter.moe:grouped_topk", _aiter_grouped_supports, _aiter_grouped_key)
GPT_OSS_TOPK.register("torch", _torch_gpt_oss_topk)
GPT_OSS_TOPK.register("triton", "atom_core.ops.triton.moe_routing:gpt_oss_topk", _triton_supports, _triton_key)
GPT_OSS_TOPK.register("aiter", "atom_core.ops.aiter.moe:gpt_oss_topk", _aiter_contiguous, _aiter_contiguous_key)


@custom_op("topk_softmax", mutates_args=("topk_weights", "topk_ids"))
def _topk_softmax_op(router_logits: Tensor, renormalize: bool, topk_weights: Tensor, topk_ids: Tensor,
                     backend: Optional[str]) -> None:
    TOPK_SOFTMAX(router_logits, renormalize, topk_weights, topk_ids, backend=backend)


@_topk_softmax_op.register_fake
def _(router_logits, renormalize, topk_weights, topk_ids, backend) -> None:
    return None


@custom_op("grouped_topk", mutates_args=("topk_weights", "topk_ids"))
def _grouped_topk_op(router_logits: Tensor, num_expert_group: int, topk_group: int, renormalize: bool, scoring: str,
                     e_score_correction_bias: Optional[Tensor], routed_scaling_factor: float, topk_weights: Tensor,
                     topk_ids: Tensor, backend: Optional[str]) -> None:
    GROUPED_TOPK(router_logits, num_expert_group, topk_group, renormalize, scoring, e_score_correction_bias,
                 routed_scaling_factor, topk_weights, topk_ids, backend=backend)


@_grouped_topk_op.register_fake
def _(router_logits, num_expert_group, topk_group, renormalize, scoring, e_score_correction_bias,
      routed_scaling_factor, topk_weights, topk_ids, backend) -> None:
    return None


@custom_op("gpt_oss_topk", mutates_args=("topk_weights", "topk_ids"))
def _gpt_oss_topk_op(router_logits: Tensor, topk_weights: Tensor, topk_ids: Tensor, backend: Optional[str]) -> None:
    GPT_OSS_TOPK(router_logits, topk_weights, topk_ids, backend=backend)


@_gpt_oss_topk_op.register_fake
def _(router_logits, topk_weights, topk_ids, backend) -> None:
    return None


def _as_int(name: str, value) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return operator.index(value)


def _check_logits(router_logits: Tensor, top_k) -> int:
    """The per-call checks shared by the routings, run in debug mode only (atom_core.ops.validation)."""
    check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_experts = router_logits.shape[1]
    top_k = _as_int("top_k", top_k)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, E={num_experts}], got {top_k}")
    return top_k


def _check_grouped_args(router_logits, top_k, num_expert_group, topk_group, scoring, e_score_correction_bias):
    """The per-call checks of :func:`grouped_topk`, run in debug mode only."""
    top_k = _check_logits(router_logits, top_k)
    num_experts = router_logits.shape[1]
    num_expert_group = _as_int("num_expert_group", num_expert_group)
    topk_group = _as_int("topk_group", topk_group)
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"num_expert_group must be >= 1 and divide E={num_experts}, got {num_expert_group}")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group must be in [1, num_expert_group={num_expert_group}], got {topk_group}")
    group_size = num_experts // num_expert_group
    if top_k > topk_group * group_size:
        raise ValueError(f"top_k={top_k} exceeds the {topk_group * group_size} experts of the kept groups "
                         f"(topk_group={topk_group} x {group_size} experts per group)")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if e_score_correction_bias is not None:
        check_tensor("e_score_correction_bias", e_score_correction_bias, ndim=1, dtypes=FLOAT_DTYPES)
        check_shape("e_score_correction_bias", e_score_correction_bias, (num_experts,))
        check_same_device(router_logits=router_logits, e_score_correction_bias=e_score_correction_bias)
        if num_expert_group > 1 and group_size < 2:
            raise ValueError("a correction bias scores groups by their two best experts: "
                             f"groups need >= 2 experts, got E / num_expert_group = {group_size}")


def _allocate(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Empty (topk_weights [T, K] fp32, topk_ids [T, K] int32) on the logits' device."""
    shape = (router_logits.shape[0], top_k)
    device = router_logits.device
    return (torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.int32, device=device))


def topk_softmax(router_logits: Tensor, top_k: int, *, renormalize: bool, backend: str | None = None):
    """Softmax routing: softmax over the E logits, the K most probable experts, their probs as weights.

    router_logits: [T, E] fp32/fp16/bf16 (math in fp32). renormalize=True divides the K weights by
    their sum (Mixtral; Qwen3-MoE's ``norm_topk_prob``). Returns ``(topk_weights [T, K] fp32,
    topk_ids [T, K] int32)``, most probable first, ties to the lower expert index.
    """
    if debug_enabled():
        _check_logits(router_logits, top_k)
    topk_weights, topk_ids = _allocate(router_logits, top_k)
    call_op("topk_softmax", router_logits, bool(renormalize), topk_weights, topk_ids, backend)
    return topk_weights, topk_ids


def grouped_topk(router_logits: Tensor, top_k: int, *, num_expert_group: int, topk_group: int, renormalize: bool,
                 scoring: str = "softmax", e_score_correction_bias: Tensor | None = None,
                 routed_scaling_factor: float = 1.0, backend: str | None = None):
    """Group-limited routing (DeepSeek-V2/V3, GLM-4-MoE).

    router_logits: [T, E] fp32/fp16/bf16; the E experts form ``num_expert_group`` groups of E / G
    consecutive experts and only the ``topk_group`` best groups may be chosen from.
    scoring: "softmax" (over E) or "sigmoid" (per expert). e_score_correction_bias: [E] float or
    None — added to the scores to CHOOSE experts and to score groups (sum of each group's two best
    biased scores; without a bias, its best logit); the weights stay the unbiased scores.
    Weights: divided by their sum when ``renormalize``, then times ``routed_scaling_factor``.
    Returns ``(topk_weights [T, K] fp32, topk_ids [T, K] int32)``. See ``reference.moe.grouped_topk``.
    """
    if debug_enabled():
        _check_grouped_args(router_logits, top_k, num_expert_group, topk_group, scoring, e_score_correction_bias)
    topk_weights, topk_ids = _allocate(router_logits, top_k)
    call_op("grouped_topk", router_logits, num_expert_group, topk_group, bool(renormalize), scoring,
            e_score_correction_bias, float(routed_scaling_factor), topk_weights, topk_ids, backend)
    return topk_weights, topk_ids


def gpt_oss_topk(router_logits: Tensor, top_k: int, *, backend: str | None = None):
    """GPT-OSS routing: the K largest logits, then a softmax over those K only.

    router_logits: [T, E] fp32/fp16/bf16, the router's bias already added. Returns
    ``(topk_weights [T, K] fp32, topk_ids [T, K] int32)``, largest logit first, ties to the lower index.
    """
    if debug_enabled():
        _check_logits(router_logits, top_k)
    topk_weights, topk_ids = _allocate(router_logits, top_k)
    call_op("gpt_oss_topk", router_logits, topk_weights, topk_ids, backend)
    return topk_weights, topk_ids
