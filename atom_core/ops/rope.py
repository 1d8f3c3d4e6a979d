"""Rotary position embedding: ``rope_cos_sin_cache`` (builds the table) and ``apply_rope_`` (in place).

Legend: T = tokens, Hq / Hk = query / key heads, D = head size, R = rotary dim (<= D, even),
P = positions in the cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import rope as reference_rope
from atom_core.ops.validation import FLOAT_DTYPES, check_same_device, check_shape, check_tensor, debug_enabled
from atom_core.ops.value_checks import check_positions

APPLY_ROPE = Op("apply_rope_")


def _torch_apply_rope(q, k, positions, cos_sin_cache, is_neox):
    reference_rope.apply_rope_(q, k, positions, cos_sin_cache, is_neox=is_neox)


TRITON_MAX_ROTARY_DIM = 1024  # one tile of cos/sin per program
_INT32_MAX = 2**31 - 1


def _triton_supports(q, k, positions, cos_sin_cache, is_neox) -> str | None:
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return "triton rope needs the head dim of q and k contiguous (stride 1)"
    if cos_sin_cache.stride(-1) != 1:
        return "triton rope needs cos_sin_cache rows contiguous"
    if cos_sin_cache.shape[-1] > TRITON_MAX_ROTARY_DIM:
        return f"rotary dim {cos_sin_cache.shape[-1]} exceeds one tile ({TRITON_MAX_ROTARY_DIM})"
    return None


def _triton_key(q, k, positions, cos_sin_cache, is_neox):
    """What :func:`_triton_supports` reads."""
    return (q.stride()[-1] == 1, k.stride()[-1] == 1, cos_sin_cache.stride()[-1] == 1,
            cos_sin_cache.shape[-1] > TRITON_MAX_ROTARY_DIM)


def _span(x: Tensor) -> int:
    """Elements from x's first to its last one (what an int32 offset must reach)."""
    return sum((size - 1) * stride for size, stride in zip(x.shape, x.stride())) + 1


def _aiter_supports(q, k, positions, cos_sin_cache, is_neox) -> str | None:
    # AITER's kernel reads cos/sin through raw pointers (row stride = their last dim), takes
    # int32 strides, and wants positions int64 with a unit last stride; see atom_core.ops.aiter.rope.
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return "aiter rope needs the head dim of q and k contiguous (stride 1)"
    if not cos_sin_cache.is_contiguous():
        return "aiter rope needs a contiguous cos_sin_cache"
    for name, x in (("q", q), ("k", k)):
        span = _span(x)
        if span > _INT32_MAX:
            return f"aiter rope indexes {name} with int32 offsets; {name} spans {span} elements"
    if 2 * cos_sin_cache.shape[0] > _INT32_MAX:
        return "aiter rope: cos_sin_cache has too many positions for int32 row ids"
    return None


def _aiter_key(q, k, positions, cos_sin_cache, is_neox):
    """What :func:`_aiter_supports` reads."""
    return (q.stride()[-1] == 1, k.stride()[-1] == 1, cos_sin_cache.is_contiguous(), _span(q) > _INT32_MAX,
            _span(k) > _INT32_MAX, 2 * cos_sin_cache.shape[0] > _INT32_MAX)


APPLY_ROPE.register("torch", _torch_apply_rope)
APPLY_ROPE.register("triton", "atom_core.ops.triton.rope:apply_rope_", _triton_supports, _triton_key)
APPLY_ROPE.register("aiter", "atom_core.ops.aiter.rope:apply_rope_", _aiter_supports, _aiter_key)


@custom_op("apply_rope_", mutates_args=("q", "k"))
def _apply_rope_op(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool,
                   backend: str | None) -> None:
    APPLY_ROPE(q, k, positions, cos_sin_cache, is_neox, backend=backend)


@_apply_rope_op.register_fake
def _(q, k, positions, cos_sin_cache, is_neox, backend) -> None:
    return None


def _check_rope_args(q, k, positions, cos_sin_cache) -> None:
    """The per-call checks, run in debug mode only (atom_core.ops.validation)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,))
    num_tokens, _, head_size = q.shape
    check_shape("k", k, (num_tokens, None, head_size))
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64,))
    check_shape("positions", positions, (num_tokens,))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or rotary_dim == 0 or rotary_dim > head_size:
        raise ValueError(f"cos_sin_cache must have an even number of columns (the rotary dim) in [2, {head_size}], "
                         f"got shape {tuple(cos_sin_cache.shape)}")
    check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    check_positions(positions, cos_sin_cache.shape[0])


def apply_rope_(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, *, is_neox: bool = True,
                backend: str | None = None) -> None:
    """Rotate the first R dims of every head of ``q`` and ``k`` in place by their tokens' positions.

    q: [T, Hq, D], k: [T, Hk, D], fp32/fp16/bf16, same dtype; may be strided views (e.g. slices of a
    fused qkv buffer viewed as heads) as long as the head dim is contiguous.
    positions: int64 [T], each in [0, P). cos_sin_cache: [P, R] from :func:`rope_cos_sin_cache`
    (cos in columns [0, R/2), sin in [R/2, R)). Dims R..D of each head are left as they are.
    is_neox=True pairs dim i with i + R/2 (GPT-NeoX / Llama "rotate_half"); False pairs dims 2i and
    2i + 1 (GPT-J). Each pair (a, b) becomes ``(a cos - b sin, b cos + a sin)``, computed in fp32.
    """
    if debug_enabled():
        _check_rope_args(q, k, positions, cos_sin_cache)
    call_op("apply_rope_", q, k, positions, cos_sin_cache, bool(is_neox), backend)


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, scaling: dict | None = None, *,
                       dtype: torch.dtype = torch.float32, device=None) -> tuple[Tensor, float]:
    """The cos/sin table of positions [0, max_position) and its attention scale.

    Returns ``(cos_sin_cache [max_position, rotary_dim], attention_scale)``: row p holds
    ``cos(p * inv_freq) * s`` then ``sin(p * inv_freq) * s`` (inv_freq: [rotary_dim / 2]), with
    ``s = attention_scale``. ``scaling`` is an HF ``rope_scaling`` / ``rope_parameters`` dict naming
    ``rope_type`` (or the older ``type``): "default"; "linear" (factor); "llama3" (factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings); "yarn" (factor,
    original_max_position_embeddings, and optionally beta_fast, beta_slow, mscale, mscale_all_dim,
    attention_factor, truncate); "longrope" (short_factor, long_factor, original_max_position_embeddings, and
    optionally factor, attention_factor: ``long_factor`` when ``max_position`` exceeds the pretraining length,
    else ``short_factor``, for every row, as vLLM chooses). ``s`` is yarn's attention factor (its mscale) or
    longrope's, 1.0 for the others;
    it is already folded into the table, and returned so callers can see it. Other keys
    (``rope_theta``, ``partial_rotary_factor``) are ignored: ``base`` and ``rotary_dim`` say them.
    Built in fp32 on the CPU like HF transformers' rotary embedding, then cast to ``dtype``.
    """
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"max_position must be a positive int, got {max_position!r}")
    if not isinstance(base, (int, float)) or base <= 1:
        raise ValueError(f"base must be a number > 1, got {base!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise TypeError(f"scaling must be a dict or None, got {type(scaling).__name__}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return reference_rope.rope_cos_sin_cache(rotary_dim, max_position, float(base), scaling, dtype=dtype,
                                             device=device)


def yarn_softmax_scale(head_dim: int, scaling: dict | None) -> float:
    """The softmax scale of attention over heads of ``head_dim`` dims under an HF rope ``scaling`` dict, as
    DeepSeek-V2/V3 (and Kimi-K2) define it: ``head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2``
    with ``yarn_mscale(s, m) = 0.1 m ln(s) + 1`` (1 for s <= 1) when the rope type is not "default" and
    ``mscale_all_dim`` is set and non-zero; plain ``head_dim ** -0.5`` otherwise. For MLA, ``head_dim`` is
    ``qk_nope_head_dim + qk_rope_head_dim``. The cos/sin table of :func:`rope_cos_sin_cache` carries the other
    half of DeepSeek's YaRN: the ratio ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)``.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise TypeError(f"scaling must be a dict or None, got {type(scaling).__name__}")
    return reference_rope.yarn_softmax_scale(head_dim, scaling)
