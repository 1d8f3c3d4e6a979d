"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) over the paged latent pool:
``store_mla_`` (the ``concat_and_cache_mla`` write), ``mla_prefill_attention`` (expanded form) and
``mla_decode_attention`` (absorbed form).

What is cached, what each form computes and why both exist is stated in
``atom_core.ops.reference.mla``, the definition of correct. Both attention forms serve any token
layout (prefill, chunked prefill on a cached prefix, decode, multi-token decode, mixed batches:
bottom-right causal like ``paged_attention``) and give the same result; a model picks the cheaper
one per step (expanded when rows have many queries, absorbed for decode).

The signatures are what a kernel implements: tensors in (``w_uk`` / ``w_uv`` may be strided views of
``kv_b_proj``'s weight), results written into ``out``, ``max_seqlen_q`` / ``max_seqlen_k`` ints that
size a launch, and nothing read on the host outside debug mode, so a CUDA graph can capture them.

Backends: ``torch`` (the reference twins); ``triton`` (``ops/triton/mla_cache.py``: the row write;
``mla_decode.py``: the absorbed form, a split-K multi-query kernel over the latent rows between two torch
``bmm`` calls; ``mla_prefill.py``: the expanded form, per-head K/V from a GEMM over the row's pages, then the
unified flash-attention kernel); ``aiter`` (``ops/aiter/mla.py``: ``concat_and_cache_mla``, ``mla_decode_fwd``
for DeepSeek-shaped bf16 decode batches, ``flash_attn_varlen_func`` over the expanded K/V).

Legend: T = query tokens, B = rows, H = query heads, L = kv_lora_rank, R = qk_rope_head_dim,
Dn = qk_nope_head_dim, Dv = v_head_dim, NB = pool blocks, BS = block size, P = pages per row.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import mla as reference_mla
from atom_core.ops.reference.kv_cache import FP8_DTYPE
from atom_core.ops.validation import (FLOAT_DTYPES, check_out, check_out_shape, check_same_device, check_shape,
                                      check_tensor, debug_enabled)
from atom_core.ops.value_checks import check_attention_layout, check_slots

STORE_MLA = Op("store_mla_")
MLA_PREFILL_ATTENTION = Op("mla_prefill_attention")
MLA_DECODE_ATTENTION = Op("mla_decode_attention")


def _torch_store_mla(kv_c, k_pe, mla_cache, slot_mapping, kv_scale):
    reference_mla.store_mla_(kv_c, k_pe, mla_cache, slot_mapping, kv_scale)


def _torch_mla_prefill(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                       max_seqlen_k, scale, kv_scale, out):
    out.copy_(reference_mla.mla_prefill_attention(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q,
                                                  context_lens, max_seqlen_q, max_seqlen_k, scale=scale,
                                                  kv_scale=kv_scale))


def _torch_mla_decode(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                      max_seqlen_k, scale, kv_scale, out):
    out.copy_(reference_mla.mla_decode_attention(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q,
                                                 context_lens, max_seqlen_q, max_seqlen_k, scale=scale,
                                                 kv_scale=kv_scale))


# The Triton kernels keep a q tile of [heads, L] and [heads, R] in registers (DeepSeek: L = 512, R = 64).
TRITON_MAX_LATENT_DIM = 1024
TRITON_MAX_ROPE_DIM = 256
# The expanded form runs the unified attention kernel on one head dim max(Dn + R, Dv) (attention.py's limit).
TRITON_MAX_EXPANDED_HEAD_DIM = 256


def _no_native_fp8(cache: Tensor) -> bool:
    return cache.dtype == FP8_DTYPE and cache.is_cuda and torch.cuda.get_device_capability(cache.device) < (8, 9)


def _triton_store_supports(kv_c, k_pe, mla_cache, slot_mapping, kv_scale) -> str | None:
    if any(t.stride(-1) != 1 for t in (kv_c, k_pe, mla_cache)):
        return "triton store_mla_ needs the last dim of kv_c, k_pe and mla_cache contiguous"
    return None


def _triton_store_key(kv_c, k_pe, mla_cache, slot_mapping, kv_scale):
    """What :func:`_triton_store_supports` reads."""
    return kv_c.stride()[-1] == 1, k_pe.stride()[-1] == 1, mla_cache.stride()[-1] == 1


def triton_absorbed_refusal(q_pe, mla_cache, latent_dim: int) -> str | None:
    """Why the absorbed-form Triton kernels (MLA decode, DSA sparse) cannot serve, or None."""
    if q_pe.stride(-1) != 1 or mla_cache.stride(-1) != 1:
        return "triton MLA attention needs the last dim of q_pe and mla_cache contiguous"
    if latent_dim > TRITON_MAX_LATENT_DIM or q_pe.shape[-1] > TRITON_MAX_ROPE_DIM:
        return (f"triton MLA attention keeps [heads, L] and [heads, R] tiles in registers: L <= {TRITON_MAX_LATENT_DIM}"
                f" and R <= {TRITON_MAX_ROPE_DIM}, got L = {latent_dim}, R = {q_pe.shape[-1]}")
    if _no_native_fp8(mla_cache):
        return "fp8 (e4m3) pools need a GPU of compute capability 8.9 or newer"
    return None


def triton_absorbed_key(q_pe, mla_cache, latent_dim: int):
    """What :func:`triton_absorbed_refusal` reads (the compute capability follows from the device, in the signature)."""
    return (q_pe.stride()[-1] == 1, mla_cache.stride()[-1] == 1, latent_dim > TRITON_MAX_LATENT_DIM,
            q_pe.shape[-1] > TRITON_MAX_ROPE_DIM, mla_cache.dtype)


def _triton_decode_supports(q_nope, q_pe, mla_cache, w_uk, w_uv, *rest) -> str | None:
    return triton_absorbed_refusal(q_pe, mla_cache, w_uk.shape[-1])


def _triton_decode_key(q_nope, q_pe, mla_cache, w_uk, w_uv, *rest):
    return triton_absorbed_key(q_pe, mla_cache, w_uk.shape[-1])


def _expanded_head_dim(q_nope, q_pe, w_uv) -> int:
    return max(q_nope.shape[-1] + q_pe.shape[-1], w_uv.shape[1])


def _triton_prefill_supports(q_nope, q_pe, mla_cache, w_uk, w_uv, *rest) -> str | None:
    # Inputs are copied (gathered, expanded) by torch first: any strides, fp8 dequantised before the kernel.
    head_dim = _expanded_head_dim(q_nope, q_pe, w_uv)
    if head_dim > TRITON_MAX_EXPANDED_HEAD_DIM:
        return (f"triton expanded MLA runs the unified attention kernel on max(Dn + R, Dv) = {head_dim} > "
                f"{TRITON_MAX_EXPANDED_HEAD_DIM}")
    return None


def _triton_prefill_key(q_nope, q_pe, mla_cache, w_uk, w_uv, *rest):
    return (_expanded_head_dim(q_nope, q_pe, w_uv) > TRITON_MAX_EXPANDED_HEAD_DIM,)


def _aiter_rule(name: str):
    """``supports`` / ``key`` of the AITER adapter, imported only where AITER runs."""
    return lambda *args: getattr(importlib.import_module("atom_core.ops.aiter.mla"), name)(*args)


STORE_MLA.register("torch", _torch_store_mla)
STORE_MLA.register("triton", "atom_core.ops.triton.mla_cache:store_mla_", _triton_store_supports, _triton_store_key)
STORE_MLA.register("aiter", "atom_core.ops.aiter.mla:store_mla_", _aiter_rule("store_supports"),
                   "atom_core.ops.aiter.mla:store_key")
MLA_PREFILL_ATTENTION.register("torch", _torch_mla_prefill)
MLA_PREFILL_ATTENTION.register("triton", "atom_core.ops.triton.mla_prefill:mla_prefill_attention",
                               _triton_prefill_supports, _triton_prefill_key)
MLA_PREFILL_ATTENTION.register("aiter", "atom_core.ops.aiter.mla:mla_prefill_attention",
                               _aiter_rule("prefill_supports"), "atom_core.ops.aiter.mla:prefill_key")
MLA_DECODE_ATTENTION.register("torch", _torch_mla_decode)
MLA_DECODE_ATTENTION.register("triton", "atom_core.ops.triton.mla_decode:mla_decode_attention",
                              _triton_decode_supports, _triton_decode_key)
MLA_DECODE_ATTENTION.register("aiter", "atom_core.ops.aiter.mla:mla_decode_attention",
                              _aiter_rule("decode_supports"), "atom_core.ops.aiter.mla:decode_key")


@custom_op("store_mla_", mutates_args=("mla_cache",))
def _store_mla_op(kv_c: Tensor, k_pe: Tensor, mla_cache: Tensor, slot_mapping: Tensor, kv_scale: Optional[Tensor],
                  backend: Optional[str]) -> None:
    STORE_MLA(kv_c, k_pe, mla_cache, slot_mapping, kv_scale, backend=backend)


@_store_mla_op.register_fake
def _(kv_c, k_pe, mla_cache, slot_mapping, kv_scale, backend) -> None:
    return None


@custom_op("mla_prefill_attention", mutates_args=("out",))
def _mla_prefill_op(q_nope: Tensor, q_pe: Tensor, mla_cache: Tensor, w_uk: Tensor, w_uv: Tensor, block_tables: Tensor,
                    cu_seqlens_q: Tensor, context_lens: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                    kv_scale: Optional[Tensor], out: Tensor, backend: Optional[str]) -> None:
    MLA_PREFILL_ATTENTION(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                          max_seqlen_k, scale, kv_scale, out, backend=backend)


@_mla_prefill_op.register_fake
def _(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
      scale, kv_scale, out, backend) -> None:
    return None


@custom_op("mla_decode_attention", mutates_args=("out",))
def _mla_decode_op(q_nope: Tensor, q_pe: Tensor, mla_cache: Tensor, w_uk: Tensor, w_uv: Tensor, block_tables: Tensor,
                   cu_seqlens_q: Tensor, context_lens: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                   kv_scale: Optional[Tensor], out: Tensor, backend: Optional[str]) -> None:
    MLA_DECODE_ATTENTION(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                         max_seqlen_k, scale, kv_scale, out, backend=backend)


@_mla_decode_op.register_fake
def _(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
      scale, kv_scale, out, backend) -> None:
    return None


# ---- argument checks (debug mode only, atom_core.ops.validation) -----------------------------------------------

def _check_kv_scale(kv_scale, mla_cache: Tensor) -> None:
    if mla_cache.dtype == FP8_DTYPE and kv_scale is None:
        raise ValueError(f"kv_scale is required when the cache is {FP8_DTYPE} (rows are stored as row / kv_scale)")
    if kv_scale is not None:
        check_tensor("kv_scale", kv_scale, dtypes=(torch.float32,))
        if kv_scale.numel() != 1:
            raise ValueError(f"kv_scale must hold one per-tensor scale (shape [1]), got shape {tuple(kv_scale.shape)}")


def _check_store_args(kv_c, k_pe, mla_cache, slot_mapping, kv_scale) -> None:
    check_tensor("kv_c", kv_c, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, latent_dim = kv_c.shape
    check_tensor("k_pe", k_pe, ndim=2, dtypes=(kv_c.dtype,))
    check_shape("k_pe", k_pe, (num_tokens, None))
    check_tensor("mla_cache", mla_cache, ndim=3, dtypes=(kv_c.dtype, FP8_DTYPE))
    check_shape("mla_cache", mla_cache, (None, None, latent_dim + k_pe.shape[1]))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    _check_kv_scale(kv_scale, mla_cache)
    check_same_device(kv_c=kv_c, k_pe=k_pe, mla_cache=mla_cache, slot_mapping=slot_mapping, kv_scale=kv_scale)
    check_slots(slot_mapping, mla_cache.shape[0] * mla_cache.shape[1])


def _check_attention_args(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                          max_seqlen_k, scale, kv_scale, out) -> None:
    check_tensor("q_nope", q_nope, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, nope_dim = q_nope.shape
    check_tensor("q_pe", q_pe, ndim=3, dtypes=(q_nope.dtype,))
    check_shape("q_pe", q_pe, (num_tokens, num_heads, None))
    check_tensor("w_uk", w_uk, ndim=3, dtypes=(q_nope.dtype,))
    check_shape("w_uk", w_uk, (num_heads, nope_dim, None))
    latent_dim = w_uk.shape[2]
    check_tensor("w_uv", w_uv, ndim=3, dtypes=(q_nope.dtype,))
    check_shape("w_uv", w_uv, (num_heads, None, latent_dim))
    check_tensor("mla_cache", mla_cache, ndim=3, dtypes=(q_nope.dtype, FP8_DTYPE))
    check_shape("mla_cache", mla_cache, (None, None, latent_dim + q_pe.shape[2]))
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    num_rows = block_tables.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,))
    check_shape("cu_seqlens_q", cu_seqlens_q, (num_rows + 1,))
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,))
    check_shape("context_lens", context_lens, (num_rows,))
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    _check_kv_scale(kv_scale, mla_cache)
    check_out("out", out, (num_tokens, num_heads, w_uv.shape[1]), q_nope.dtype, q_nope.device)
    check_same_device(q_nope=q_nope, q_pe=q_pe, mla_cache=mla_cache, w_uk=w_uk, w_uv=w_uv, block_tables=block_tables,
                      cu_seqlens_q=cu_seqlens_q, context_lens=context_lens, kv_scale=kv_scale)
    check_attention_layout(num_tokens, mla_cache.shape[0], mla_cache.shape[1], block_tables, cu_seqlens_q,
                           context_lens, max_seqlen_q, max_seqlen_k)


# ---- the public functions ----------------------------------------------------------------------------------------

def store_mla_(kv_c: Tensor, k_pe: Tensor, mla_cache: Tensor, slot_mapping: Tensor, *,
               kv_scale: Tensor | None = None, backend: str | None = None) -> None:
    """Write each token's latent row and rope key into its slot of the MLA pool, in place.

    kv_c: [T, L] fp32/fp16/bf16, the latent after ``kv_a_layernorm``; k_pe: [T, R] in kv_c's dtype, the
    rope key after rotation (both may be strided views with the last dim contiguous, e.g. slices of
    ``kv_a_proj_with_mqa``'s output). mla_cache: [NB, BS, L + R] in kv_c's dtype, or float8_e4m3fn.
    slot_mapping: int64 [T]; token t goes to block ``slot_mapping[t] // BS``, offset ``% BS``, as
    ``cache[block, offset] = [kv_c[t], k_pe[t]]``; -1 writes nothing. Slots are assumed distinct and
    below NB * BS (checked in debug mode, except distinctness).
    kv_scale: fp32 [1], required for an fp8 cache, which stores ``clamp(row / kv_scale, -448, 448)``
    rounded to nearest even; ignored otherwise.
    """
    if debug_enabled():
        _check_store_args(kv_c, k_pe, mla_cache, slot_mapping, kv_scale)
    elif slot_mapping.shape[0] != kv_c.shape[0]:
        # Always on: a short slot_mapping would make a kernel read slot ids past its end.
        raise ValueError(f"slot_mapping must have one slot per token ({kv_c.shape[0]}), got {slot_mapping.shape[0]}")
    if mla_cache.dtype != FP8_DTYPE:
        kv_scale = None
    call_op("store_mla_", kv_c, k_pe, mla_cache, slot_mapping, kv_scale, backend)


def _attention(name: str, q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens,
               max_seqlen_q, max_seqlen_k, scale, kv_scale, out, backend) -> Tensor:
    if debug_enabled():
        _check_attention_args(q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens,
                              max_seqlen_q, max_seqlen_k, scale, kv_scale, out)
    shape = (q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=q_nope.dtype, device=q_nope.device)
    else:  # always on: a kernel writes out over these extents
        check_out_shape("out", out, torch.Size(shape))
    if mla_cache.dtype != FP8_DTYPE:
        kv_scale = None
    call_op(name, q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
            max_seqlen_k, float(scale), kv_scale, out, backend)
    return out


def mla_prefill_attention(q_nope: Tensor, q_pe: Tensor, mla_cache: Tensor, w_uk: Tensor, w_uv: Tensor,
                          block_tables: Tensor, cu_seqlens_q: Tensor, context_lens: Tensor, max_seqlen_q: int,
                          max_seqlen_k: int, *, scale: float, kv_scale: Tensor | None = None,
                          out: Tensor | None = None, backend: str | None = None) -> Tensor:
    """MLA attention, expanded form: each row's cached latents become per-head keys ``[w_uk c_kv, k_pe]``
    and values ``w_uv c_kv``, then causal multi-head attention (cheap when rows have many queries).

    q_nope: [T, H, Dn], q_pe: [T, H, R] (rotated), fp32/fp16/bf16, one dtype; strided views of the
        q projection are fine (last dim contiguous); row r's tokens are ``cu_seqlens_q[r]:cu_seqlens_q[r+1]``.
    mla_cache: [NB, BS, L + R], rows ``[c_kv, k_pe]`` written by :func:`store_mla_` (this step's included);
        q's dtype, or float8_e4m3fn holding ``row / kv_scale``.
    w_uk: [H, Dn, L], w_uv: [H, Dv, L], q's dtype: ``kv_b_proj.weight.view(H, Dn + Dv, L)`` split along
        dim 1 (views; k_nope = w_uk[h] @ c_kv, v = w_uv[h] @ c_kv).
    block_tables: int32 [B, P], pool block of each page, -1 past the row's last page.
    cu_seqlens_q: int32 [B + 1]; context_lens: int32 [B], tokens of each row in the pool (0 = padding row,
        output zeros).
    max_seqlen_q, max_seqlen_k: ints, upper bounds of the query lengths and of context_lens; they size the
        launch, never a result.
    scale: softmax scale of q.k over the Dn + R dims (DeepSeek: ``ops.yarn_softmax_scale(Dn + R, rope_scaling)``).
    kv_scale: fp32 [1] or None, the fp8 pool's dequantisation scale (required for an fp8 pool).
    out: [T, H, Dv] in q's dtype, written and returned; allocated when None.

    Query i of row r sits at position ``context_lens[r] - q_len + i`` and sees the keys at positions
    ``j <= p`` (bottom-right causal). Returns out.
    """
    return _attention("mla_prefill_attention", q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q,
                      context_lens, max_seqlen_q, max_seqlen_k, scale, kv_scale, out, backend)


def mla_decode_attention(q_nope: Tensor, q_pe: Tensor, mla_cache: Tensor, w_uk: Tensor, w_uv: Tensor,
                         block_tables: Tensor, cu_seqlens_q: Tensor, context_lens: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, *, scale: float, kv_scale: Tensor | None = None,
                         out: Tensor | None = None, backend: str | None = None) -> Tensor:
    """MLA attention, absorbed form: ``q_lat = q_nope @ w_uk`` ([T, H, L]), multi-query attention of
    ``[q_lat, q_pe]`` over the cached rows ``[c_kv, k_pe]`` with values ``c_kv``, then ``@ w_uv^T``
    (never expands the context: the decode path). Arguments, result and mask as in
    :func:`mla_prefill_attention`, which it equals up to rounding.
    """
    return _attention("mla_decode_attention", q_nope, q_pe, mla_cache, w_uk, w_uv, block_tables, cu_seqlens_q,
                      context_lens, max_seqlen_q, max_seqlen_k, scale, kv_scale, out, backend)
