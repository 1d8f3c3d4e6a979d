"""Attention over the paged KV pool: ``paged_attention`` and ``paged_attention_from_layout``.

One op serves prefill, chunked prefill on a cached prefix, decode, multi-token decode and mixed
batches: the query tokens of row r are the last ``q_len`` tokens of its ``context_lens[r]``-token
context, already written into the pool by ``store_kv_``; the causal mask is aligned bottom-right.
The exact semantics (mask inequalities, softcap, sinks, fp8 scales) are stated in
``atom_core.ops.reference.attention``, the definition of correct.

Backends: ``torch`` (the reference twin), ``triton`` (a unified flash-attention kernel for
prefill and mixed batches, a split-K flash-decoding kernel for decode batches; the choice depends
only on shapes and on ``max_seqlen_q``), ``aiter`` (AITER's paged decode and varlen flash kernels).
Outside debug mode nothing here reads tensor contents on the host, so the op can be captured in a
CUDA graph (debug mode reads the layout, but not during a capture); the launch grid and the number
of KV splits follow from shapes and the ``max_seqlen_*`` ints.

Legend: T = query tokens of the step, B = rows, Hq / Hk = query / kv heads, D = head dim,
NB = pool blocks, BS = tokens per block, P = pages per row.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import Tensor

from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import attention as reference_attention
from atom_core.ops.reference import quant as reference_quant
from atom_core.ops.validation import (FLOAT_DTYPES, check_out, check_out_shape, check_same_device, check_shape,
                                      check_tensor, debug_enabled)
from atom_core.ops.value_checks import check_attention_layout, check_permutation

PAGED_ATTENTION = Op("paged_attention")

FP8_KV_DTYPES = (torch.float8_e4m3fn,)
FP8_OUT_DTYPE = reference_quant.FP8_DTYPE  # paged_attention(quantize=True)'s output
# The Triton kernels keep one head (padded to a power of two) in registers per row.
TRITON_MAX_HEAD_DIM = 256
# A batch whose queries are this short takes the split-K decode kernel (all query tokens of a row
# and all q heads of a kv group share one program, up to this many rows of the q tile).
DECODE_MAX_QLEN = 8
DECODE_MAX_TILE_ROWS = 128


def _torch_paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                           scale, sliding_window, logit_softcap, sinks, k_scale, v_scale, out, out_scale, row_order):
    result = reference_attention.paged_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale=scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    if out_scale is None:
        out.copy_(result)
        return
    num_tokens, _, head_dim = q.shape
    got_q, got_scale = reference_quant.per_group_quant(result.reshape(num_tokens, -1), out.dtype, head_dim)
    out.copy_(got_q.view(q.shape))
    out_scale.copy_(got_scale)


def uses_split_k_decode(max_seqlen_q: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether the Triton backend runs the split-K decode kernel (else the unified kernel).

    Depends only on ints fixed for a CUDA-graph bucket: short queries whose q tile (all query
    tokens of a row times the q heads of one kv head) stays small.
    """
    group = num_heads // num_kv_heads
    return 0 < max_seqlen_q <= DECODE_MAX_QLEN and max_seqlen_q * group <= DECODE_MAX_TILE_ROWS


def _triton_paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                            scale, sliding_window, logit_softcap, sinks, k_scale, v_scale, out, out_scale, row_order):
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale,
            sliding_window, logit_softcap, sinks, k_scale, v_scale)
    if uses_split_k_decode(max_seqlen_q, q.shape[1], k_cache.shape[2]):  # quantizes as it sees fit
        importlib.import_module("atom_core.ops.triton.attention_decode").paged_attention_decode(
            *args, out, out_scale, row_order=row_order)
        return
    unified = importlib.import_module("atom_core.ops.triton.attention_unified").paged_attention_unified
    if out_scale is None:
        unified(*args, out)
        return
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # prefill: the output, then its quantization
    unified(*args, result)
    importlib.import_module("atom_core.ops.triton.quant").per_head_quant(result, out, out_scale)


def _triton_supports(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                     scale, sliding_window, logit_softcap, sinks, k_scale, v_scale, out, out_scale,
                     row_order) -> str | None:
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, out)):
        return "triton attention needs the head dim (last dim) of q, out and the caches contiguous"
    if out_scale is not None and (not out.is_contiguous() or out_scale.stride(-1) != 1):
        return "triton attention quantizing its output needs out contiguous and out_scale's last dim contiguous"
    if q.shape[-1] > TRITON_MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} exceeds {TRITON_MAX_HEAD_DIM}"
    if (k_cache.dtype in FP8_KV_DTYPES or out_scale is not None) and q.is_cuda and \
            torch.cuda.get_device_capability(q.device) < (8, 9):
        return "fp8 (e4m3) caches and outputs need a GPU of compute capability 8.9 or newer"
    return None


def _triton_key(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k,
                scale, sliding_window, logit_softcap, sinks, k_scale, v_scale, out, out_scale, row_order):
    """What :func:`_triton_supports` reads (the compute capability follows from q's device, in the signature)."""
    quant = out_scale is not None and (out.is_contiguous(), out_scale.stride()[-1] == 1)
    return (q.stride()[-1] == 1, k_cache.stride()[-1] == 1, v_cache.stride()[-1] == 1, out.stride()[-1] == 1,
            q.shape[-1] > TRITON_MAX_HEAD_DIM, k_cache.dtype, quant)


def _aiter_supports(*args) -> str | None:
    return importlib.import_module("atom_core.ops.aiter.attention").supports(*args)


PAGED_ATTENTION.register("torch", _torch_paged_attention)
PAGED_ATTENTION.register("triton", _triton_paged_attention, _triton_supports, _triton_key)
# The AITER key lives next to its rule in the adapter module, imported only where AITER runs.
PAGED_ATTENTION.register("aiter", "atom_core.ops.aiter.attention:paged_attention", _aiter_supports,
                         "atom_core.ops.aiter.attention:supports_key")


@custom_op("paged_attention", mutates_args=("out", "out_scale"))
def _paged_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor,
                        context_lens: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                        sliding_window: Optional[int], logit_softcap: float, sinks: Optional[Tensor],
                        k_scale: Optional[Tensor], v_scale: Optional[Tensor], out: Tensor, out_scale: Optional[Tensor],
                        row_order: Optional[Tensor], backend: Optional[str]) -> None:
    PAGED_ATTENTION(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale,
                    sliding_window, logit_softcap, sinks, k_scale, v_scale, out, out_scale, row_order, backend=backend)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale,
      sliding_window, logit_softcap, sinks, k_scale, v_scale, out, out_scale, row_order, backend) -> None:
    return None


def _check_int(name: str, value, minimum: int) -> int:
    # torch.SymInt: an int made symbolic by torch.compile (dynamic shapes).
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_scale_tensor(name: str, t: Tensor | None) -> None:
    if t is None:
        return
    check_tensor(name, t, dtypes=(torch.float32,))
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one value (shape [1]), got shape {tuple(t.shape)}")


def _check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale,
                sliding_window, logit_softcap, sinks, k_scale, v_scale, out, quantize=False, row_order=None) -> None:
    """The per-call checks, run in debug mode only (atom_core.ops.validation)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _, num_heads, head_dim = q.shape
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype, *FP8_KV_DTYPES))
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head dim {k_cache.shape[3]} differs from q's {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of k_cache heads ({num_kv_heads})")
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    num_rows = block_tables.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,))
    check_shape("cu_seqlens_q", cu_seqlens_q, (num_rows + 1,))
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,))
    check_shape("context_lens", context_lens, (num_rows,))
    _check_int("max_seqlen_q", max_seqlen_q, 0)
    _check_int("max_seqlen_k", max_seqlen_k, 0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if sliding_window is not None:
        _check_int("sliding_window", sliding_window, 1)
    if not isinstance(logit_softcap, (int, float)) or logit_softcap < 0:
        raise ValueError(f"logit_softcap must be a float >= 0, got {logit_softcap!r}")
    if sinks is not None:
        check_tensor("sinks", sinks, ndim=1, dtypes=(torch.float32,))
        check_shape("sinks", sinks, (num_heads,))
    _check_scale_tensor("k_scale", k_scale)
    _check_scale_tensor("v_scale", v_scale)
    if not quantize:
        check_out("out", out, q.shape, q.dtype, q.device)
    if row_order is not None:
        check_tensor("row_order", row_order, ndim=1, dtypes=(torch.int32,))
        check_shape("row_order", row_order, (num_rows,))
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
                      context_lens=context_lens, sinks=sinks, k_scale=k_scale, v_scale=v_scale, row_order=row_order)
    check_attention_layout(q.shape[0], k_cache.shape[0], k_cache.shape[1], block_tables, cu_seqlens_q, context_lens,
                           max_seqlen_q, max_seqlen_k)
    if row_order is not None:
        check_permutation("row_order", row_order)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor,
                    context_lens: Tensor, max_seqlen_q: int, max_seqlen_k: int, *, scale: float,
                    sliding_window: int | None = None, logit_softcap: float = 0.0, sinks: Tensor | None = None,
                    k_scale: Tensor | None = None, v_scale: Tensor | None = None, out: Tensor | None = None,
                    quantize: bool = False, row_order: Tensor | None = None,
                    backend: str | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Causal attention of each row's query tokens over its context in the paged KV pool.

    q: [T, Hq, D] fp32/fp16/bf16 (any strides with the last dim contiguous for Triton, e.g. a view
        of a fused qkv projection); row r's tokens are ``q[cu_seqlens_q[r]:cu_seqlens_q[r+1]]``.
    k_cache, v_cache: [NB, BS, Hk, D] in q's dtype, or float8_e4m3fn holding ``k / k_scale``.
    block_tables: int32 [B, P], pool block (in [0, NB)) of each page of a row, -1 past its last page.
    cu_seqlens_q: int32 [B+1], prefix sums of the query lengths (0 first, T last).
    context_lens: int32 [B], tokens of each row in the pool (cached + this step's, so at least the
        row's query tokens); 0 = padding row (any query count, output zeros).
    max_seqlen_q, max_seqlen_k: ints, upper bounds of the query lengths and of ``context_lens``
        (a CUDA-graph bucket passes fixed bounds); they size the launch, never a result.
    scale: softmax scale applied to q.k (usually D ** -0.5).
    sliding_window: W or None; query at position p sees keys p-W+1 .. p (``j > p - W``, as in
        transformers' sliding-window mask).
    logit_softcap: c > 0 maps logits s to ``c * tanh(s / c)`` before masking (Gemma 2); 0 = off.
    sinks: fp32 [Hq] or None, one extra logit per head in the softmax denominator (GPT-OSS).
    k_scale, v_scale: fp32 [1] or None, dequantisation scales applied to the cached keys / values.
    out: [T, Hq, D] in q's dtype, written and returned; allocated when None.
    quantize: return ``(out, out_scale)`` instead: the output quantized to float8_e4m3fn with one fp32
        scale per head, out [T, Hq, D] and out_scale [T, Hq] (allocated; ``out`` must be None). They are
        exactly ``per_group_quant`` of the output (in q's dtype) viewed as [T, Hq * D] with
        ``group_size=D``: with D = 128 the 1 x 128 groups of a block-FP8 o_proj's input. Triton: a decode
        split over the context quantizes in its reduce kernel's epilogue (one launch fewer); one split and
        prefill quantize after the kernel.
    row_order: int32 [B] or None, a permutation of the rows: the order the Triton split-K decode kernel
        launches them in (None: 0 .. B-1). The output does not depend on it. Rows by descending
        context (``StepLayout.row_order``) let the long rows start first and the short ones fill in
        behind them (256 decode rows of uneven context on an H200: 1.18-1.40x faster).

    Query i of row r sits at position ``p = context_lens[r] - q_len + i`` and sees keys
    ``j <= p`` (bottom-right causal). GQA / MQA: query head h reads kv head ``h // (Hq // Hk)``.
    Rows with ``context_lens == 0`` get zeros. Returns out. Debug mode checks the layout's contents
    (``atom_core.ops.value_checks.check_attention_layout``); docs/ops.md says what happens without.
    """
    if quantize and out is not None:
        raise ValueError("paged_attention(quantize=True) allocates its fp8 output and scales: pass out=None")
    if debug_enabled():
        _check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, scale,
                    sliding_window, logit_softcap, sinks, k_scale, v_scale, out, quantize, row_order)
    elif out is not None:  # always on (see check_out_shape)
        check_out_shape("out", out, q.shape)
    out_scale = None
    if quantize:
        out = torch.empty(q.shape, dtype=FP8_OUT_DTYPE, device=q.device)
        out_scale = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    elif out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    call_op("paged_attention", q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
            max_seqlen_k, float(scale), sliding_window, float(logit_softcap), sinks, k_scale, v_scale, out, out_scale,
            row_order, backend)
    return (out, out_scale) if quantize else out


def paged_attention_from_layout(q: Tensor, k_cache: Tensor, v_cache: Tensor, layout, **kwargs) -> Tensor:
    """:func:`paged_attention` with the step's metadata taken from ``layout``.

    layout: an ``atom_core.cache.StepLayout`` on q's device (or any object with ``block_tables``,
    ``cu_seqlens_q``, ``context_lens``, ``max_seqlen_q``, ``max_seqlen_k`` and ``row_order``); kwargs as in
    :func:`paged_attention` (``scale`` is required). A ``StepLayout`` built for another block size than the
    pool's is refused (ValueError).
    """
    check_block_size = getattr(layout, "check_pool_block_size", None)
    if check_block_size is not None:
        check_block_size(k_cache.shape[1], "k_cache")
    return paged_attention(q, k_cache, v_cache, layout.block_tables, layout.cu_seqlens_q, layout.context_lens,
                           layout.max_seqlen_q, layout.max_seqlen_k, row_order=layout.row_order, **kwargs)
