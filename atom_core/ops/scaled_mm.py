"""Scaled GEMMs of quantized linear layers: ``scaled_mm_per_tensor``, ``scaled_mm_per_token`` and
``scaled_mm_block``.

Legend: M = tokens, N = output features, K = input features. ``out [M, N] = (a * a_scale) @ (w * w_scale)^T
(+ bias)`` with w stored [N, K] like ``nn.Linear.weight``, fp32 accumulation, output in ``out_dtype``
(bf16, fp16 or fp32). The scale layouts (table in ``atom_core.ops.reference.scaled_mm``) are what
``atom_core.ops.quant`` returns for the activation:

| op | a, w | a_scale | w_scale |
|---|---|---|---|
| scaled_mm_per_tensor | fp8 e4m3fn or int8 | one element | one element |
| scaled_mm_per_token | fp8 e4m3fn or int8 | [M, 1] (per_token_quant) | [N, 1] per output channel |
| scaled_mm_block | fp8 e4m3fn | [M, ceil(K/128)] (per_group_quant) | [ceil(N/128), ceil(K/128)] (``weight_scale_inv``) |

A per-tensor weight scale used with per-token activations is expanded to [N, 1] once, at load time.
Backends: torch (the twin), triton, aiter (``gemm_a8w8_CK``, ``gemm_a8w8_blockscale``) and
scaled_mm (``torch._scaled_mm``, cuBLASLt / hipBLASLt; ``atom_core.ops.torch_scaled_mm``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops import torch_scaled_mm
from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.quant import fp8_e4m3fn_native
from atom_core.ops.reference import scaled_mm as reference_scaled_mm
from atom_core.ops.reference.quant import FP8_DTYPE, INT8_DTYPE
from atom_core.ops.reference.scaled_mm import BLOCK
from atom_core.ops.validation import FLOAT_DTYPES, check_same_device, check_shape, check_tensor, debug_enabled

SCALED_MM_PER_TENSOR = Op("scaled_mm_per_tensor")
SCALED_MM_PER_TOKEN = Op("scaled_mm_per_token")
SCALED_MM_BLOCK = Op("scaled_mm_block")
_OPS = {"per_tensor": SCALED_MM_PER_TENSOR, "per_token": SCALED_MM_PER_TOKEN, "block": SCALED_MM_BLOCK}


def _triton_supports(a, a_scale, w, w_scale, bias, out_dtype) -> str | None:
    if a.dtype == FP8_DTYPE and a.is_cuda and not fp8_e4m3fn_native(a.device):
        return "triton fp8 e4m3fn GEMMs need an NVIDIA GPU of compute capability 8.9+ or an AMD gfx95x"
    return None


def _triton_key(a, a_scale, w, w_scale, bias, out_dtype):
    """What :func:`_triton_supports` reads (the device is part of every call's signature)."""
    return a.dtype


def _aiter_supports(a, a_scale, w, w_scale, bias, out_dtype) -> str | None:
    if a.dtype == FP8_DTYPE and not fp8_e4m3fn_native(a.device):
        return "aiter's fp8 on this GPU is e4m3fnuz, not torch.float8_e4m3fn"
    if out_dtype not in (torch.bfloat16, torch.float16):
        return f"aiter a8w8 GEMMs write bf16 or fp16, not {out_dtype}"
    if not (a.is_contiguous() and w.is_contiguous() and a_scale.is_contiguous() and w_scale.is_contiguous()):
        return "aiter a8w8 GEMMs need contiguous a, w and scales"
    return None


def _aiter_key(a, a_scale, w, w_scale, bias, out_dtype):
    """What :func:`_aiter_supports` reads."""
    return (a.dtype, out_dtype, a.is_contiguous(), w.is_contiguous(), a_scale.is_contiguous(),
            w_scale.is_contiguous())


def _aiter_block_supports(a, a_scale, w, w_scale, bias, out_dtype) -> str | None:
    reason = _aiter_supports(a, a_scale, w, w_scale, bias, out_dtype)
    if reason is None and a.shape[1] % BLOCK:
        return f"aiter gemm_a8w8_blockscale needs K a multiple of {BLOCK}, got K = {a.shape[1]}"
    return reason


def _aiter_block_key(a, a_scale, w, w_scale, bias, out_dtype):
    return _aiter_key(a, a_scale, w, w_scale, bias, out_dtype), a.shape[1] % BLOCK == 0


for _name, _op in _OPS.items():
    _op.register("torch", getattr(reference_scaled_mm, f"scaled_mm_{_name}"))
    _op.register("triton", f"atom_core.ops.triton.scaled_mm:scaled_mm_{_name}", _triton_supports, _triton_key)
    _op.register("scaled_mm", getattr(torch_scaled_mm, f"scaled_mm_{_name}"),
                 getattr(torch_scaled_mm, f"supports_{_name}"), getattr(torch_scaled_mm, f"key_{_name}"))
SCALED_MM_PER_TENSOR.register("aiter", "atom_core.ops.aiter.scaled_mm:scaled_mm_per_tensor", _aiter_supports,
                              _aiter_key)
SCALED_MM_PER_TOKEN.register("aiter", "atom_core.ops.aiter.scaled_mm:scaled_mm_per_token", _aiter_supports, _aiter_key)
SCALED_MM_BLOCK.register("aiter", "atom_core.ops.aiter.scaled_mm:scaled_mm_block", _aiter_block_supports,
                         _aiter_block_key)

# From M = 256 rows the block format runs faster on cuBLAS's block-wise kernel (the scaled_mm backend) than
# on the Triton kernel, whose per-K-step scaling holds it near 600 TFLOP/s: on an H200, over the Llama-3-8B
# and Qwen3-30B-A3B projections, cuBLAS takes 1/1.24-1/2.41 of the time at M = 256-4096, except one (Qwen3's
# 2048 x 4096 o_proj at M = 256: 1.23x the time); at M = 128 three of six are faster on Triton, and at decode
# sizes Triton is up to 2.5x faster (cuBLAS refuses M = 1 outright). docs/benchmarks.md has the table.
CUBLAS_BLOCK_FROM_ROWS = 256


def _many_rows(a, a_scale, w, w_scale, bias, out_dtype) -> bool:
    return a.shape[0] >= CUBLAS_BLOCK_FROM_ROWS


SCALED_MM_BLOCK.prefer("scaled_mm", _many_rows)


def _fake(a, a_scale, w, w_scale, bias, out_dtype, backend):
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


@custom_op("scaled_mm_per_tensor", mutates_args=())
def _scaled_mm_per_tensor_op(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                             out_dtype: torch.dtype, backend: str | None) -> Tensor:
    return SCALED_MM_PER_TENSOR(a, a_scale, w, w_scale, bias, out_dtype, backend=backend)


@custom_op("scaled_mm_per_token", mutates_args=())
def _scaled_mm_per_token_op(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                            out_dtype: torch.dtype, backend: str | None) -> Tensor:
    return SCALED_MM_PER_TOKEN(a, a_scale, w, w_scale, bias, out_dtype, backend=backend)


@custom_op("scaled_mm_block", mutates_args=())
def _scaled_mm_block_op(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                        out_dtype: torch.dtype, backend: str | None) -> Tensor:
    return SCALED_MM_BLOCK(a, a_scale, w, w_scale, bias, out_dtype, backend=backend)


for _registered in (_scaled_mm_per_tensor_op, _scaled_mm_per_token_op, _scaled_mm_block_op):
    _registered.register_fake(_fake)


def _check(a, a_scale, w, w_scale, bias, out_dtype, *, dtypes, a_scale_shape, w_scale_shape) -> None:
    """Debug-mode checks (without them a wrong scale shape makes a kernel read past the scale)."""
    check_tensor("a", a, ndim=2, dtypes=dtypes)
    check_tensor("w", w, ndim=2, dtypes=(a.dtype,))
    if w.shape[1] != a.shape[1]:
        raise ValueError(f"a [M, K] and w [N, K] must share K, got {tuple(a.shape)} and {tuple(w.shape)}")
    for name, scale, shape in (("a_scale", a_scale, a_scale_shape), ("w_scale", w_scale, w_scale_shape)):
        check_tensor(name, scale, dtypes=(torch.float32,))
        if shape is None:
            if scale.numel() != 1:
                raise ValueError(f"{name} must hold one element (per-tensor), got shape {tuple(scale.shape)}")
        else:
            check_shape(name, scale, shape)
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES)
        check_shape("bias", bias, (w.shape[0],))
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {out_dtype}")
    check_same_device(a=a, a_scale=a_scale, w=w, w_scale=w_scale, bias=bias)


def scaled_mm_per_tensor(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, *,
                         out_dtype: torch.dtype = torch.bfloat16, bias: Tensor | None = None,
                         backend: str | None = None) -> Tensor:
    """a [M, K] and w [N, K], both fp8 e4m3fn or both int8, with one-element fp32 scales
    (``per_tensor_quant``'s [1]) → out [M, N] of ``out_dtype``; bias [N] (any float dtype) is added in fp32."""
    if debug_enabled():
        _check(a, a_scale, w, w_scale, bias, out_dtype, dtypes=(FP8_DTYPE, INT8_DTYPE), a_scale_shape=None,
               w_scale_shape=None)
    return call_op("scaled_mm_per_tensor", a, a_scale, w, w_scale, bias, out_dtype, backend)


def scaled_mm_per_token(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, *,
                        out_dtype: torch.dtype = torch.bfloat16, bias: Tensor | None = None,
                        backend: str | None = None) -> Tensor:
    """a [M, K] with a_scale [M, 1] (per token, ``per_token_quant``) and w [N, K] with w_scale [N, 1]
    (per output channel), both fp8 e4m3fn or both int8 → out [M, N] of ``out_dtype``; bias [N] in fp32."""
    if debug_enabled():
        _check(a, a_scale, w, w_scale, bias, out_dtype, dtypes=(FP8_DTYPE, INT8_DTYPE),
               a_scale_shape=(a.shape[0], 1), w_scale_shape=(w.shape[0], 1))
    return call_op("scaled_mm_per_token", a, a_scale, w, w_scale, bias, out_dtype, backend)


def scaled_mm_block(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, *,
                    out_dtype: torch.dtype = torch.bfloat16, bias: Tensor | None = None,
                    backend: str | None = None) -> Tensor:
    """a [M, K] fp8 e4m3fn with a_scale [M, ceil(K/128)] (1 x 128 groups, ``per_group_quant``) and
    w [N, K] fp8 e4m3fn with w_scale [ceil(N/128), ceil(K/128)] (128 x 128 blocks, DeepSeek's
    ``weight_scale_inv`` as stored: it multiplies) → out [M, N] of ``out_dtype``; bias [N] in fp32."""
    if debug_enabled():
        groups = -(-a.shape[1] // BLOCK)
        _check(a, a_scale, w, w_scale, bias, out_dtype, dtypes=(FP8_DTYPE,), a_scale_shape=(a.shape[0], groups),
               w_scale_shape=(-(-w.shape[0] // BLOCK), groups))
    return call_op("scaled_mm_block", a, a_scale, w, w_scale, bias, out_dtype, backend)
