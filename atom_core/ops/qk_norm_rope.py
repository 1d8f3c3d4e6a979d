"""Per-head RMSNorm of q and k followed by RoPE, in place: ``qk_norm_rope_``.

Legend: T = tokens, Hq / Hk = query / key heads, D = head size, R = rotary dim (<= D, even),
P = positions in the cache.

Qwen3, Qwen3-MoE and GLM-4-MoE (``use_qk_norm``) normalise every q and k head over its D values
before the rotation. Unfused that is five launches per layer (a copy of the strided q view, its
RMSNorm, the same for k, then ``apply_rope_``); this op is one Triton launch, and is defined as
exactly that composition (the twin: ``atom_core.ops.reference.qk_norm_rope``).

Backends: torch (the twin) and triton. No AITER backend, on purpose: AITER has no fused qk-norm +
rope whose signature we know (tests/ops/aiter_signatures.txt), and one composed of its rmsnorm and
rope adapters could never launch fewer kernels than the unfused path: ``rmsnorm2d_fwd`` wants
contiguous rows and returns a new tensor, so each of q and k costs a copy of its strided view, the
rmsnorm and a copy back into the view, then the rope runs: seven launches against Triton's one.
Yet ``auto`` prefers an AITER backend the selftest has verified over Triton on ROCm, so registering
that composition would take the fusion away exactly where AITER is installed. Without it, ROCm runs
the Triton kernel; ``backend="aiter"`` is refused and ``use_backend("aiter")`` falls through, as for
any op without an AITER adapter.
"""

from __future__ import annotations

from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.norm import _check_eps
from atom_core.ops.reference import qk_norm_rope as reference_qk_norm_rope
from atom_core.ops.rope import _check_rope_args
from atom_core.ops.validation import check_same_device, check_shape, check_tensor, debug_enabled

QK_NORM_ROPE = Op("qk_norm_rope_")


def _torch_qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox):
    reference_qk_norm_rope.qk_norm_rope_(q, k, q_weight, k_weight, positions, cos_sin_cache, eps=eps,
                                         is_neox=is_neox)


TRITON_MAX_HEAD_DIM = 4096  # one whole head per tile at least (TILE_ELEMENTS of triton/qk_norm_rope.py)


def _triton_supports(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox) -> str | None:
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return "triton qk_norm_rope needs the head dim of q and k contiguous (stride 1)"
    if q_weight.stride(-1) != 1 or k_weight.stride(-1) != 1:
        return "triton qk_norm_rope needs q_weight and k_weight contiguous (stride 1)"
    if cos_sin_cache.stride(-1) != 1:
        return "triton qk_norm_rope needs cos_sin_cache rows contiguous"
    if q.shape[-1] > TRITON_MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} exceeds one tile ({TRITON_MAX_HEAD_DIM})"
    return None


def _triton_key(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox):
    """What :func:`_triton_supports` reads."""
    return (q.stride()[-1] == 1, k.stride()[-1] == 1, q_weight.stride()[-1] == 1, k_weight.stride()[-1] == 1,
            cos_sin_cache.stride()[-1] == 1, q.shape[-1] > TRITON_MAX_HEAD_DIM)


QK_NORM_ROPE.register("torch", _torch_qk_norm_rope)
QK_NORM_ROPE.register("triton", "atom_core.ops.triton.qk_norm_rope:qk_norm_rope_", _triton_supports, _triton_key)


@custom_op("qk_norm_rope_", mutates_args=("q", "k"))
def _qk_norm_rope_op(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Tensor,
                     cos_sin_cache: Tensor, eps: float, is_neox: bool, backend: str | None) -> None:
    QK_NORM_ROPE(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, backend=backend)


@_qk_norm_rope_op.register_fake
def _(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, backend) -> None:
    return None


def _check_qk_norm_rope_args(q, k, q_weight, k_weight, positions, cos_sin_cache, eps) -> None:
    """The per-call checks, run in debug mode only (atom_core.ops.validation): apply_rope_'s, the
    weights', and rms_norm's on eps."""
    _check_rope_args(q, k, positions, cos_sin_cache)
    head_size = q.shape[-1]
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(name, weight, ndim=1)
        check_shape(name, weight, (head_size,))
    check_same_device(q=q, q_weight=q_weight, k_weight=k_weight)
    _check_eps(eps)


def qk_norm_rope_(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Tensor,
                  cos_sin_cache: Tensor, *, eps: float, is_neox: bool = True, backend: str | None = None) -> None:
    """RMS-normalise every head of ``q`` and ``k`` over its D values, then rotate its first R dims; in place.

    q: [T, Hq, D], k: [T, Hk, D], fp32/fp16/bf16, same dtype; may be strided views (e.g. slices of a
    fused qkv buffer viewed as heads) as long as the head dim is contiguous.
    q_weight, k_weight: [D] (any float dtype), the per-head norms' weights of q and of k.
    positions: int64 [T], each in [0, P). cos_sin_cache: [P, R] from :func:`rope_cos_sin_cache`.
    Each head becomes ``rms_norm(head, weight, eps)`` (:func:`rms_norm`'s definition, rounded to the
    input dtype); then its first R dims are rotated as :func:`apply_rope_` rotates them (NeoX halves
    when ``is_neox``, GPT-J pairs otherwise, fp32 math), and dims R..D keep the normalised values.
    """
    if debug_enabled():
        _check_qk_norm_rope_args(q, k, q_weight, k_weight, positions, cos_sin_cache, eps)
    call_op("qk_norm_rope_", q, k, q_weight, k_weight, positions, cos_sin_cache, float(eps), bool(is_neox), backend)
