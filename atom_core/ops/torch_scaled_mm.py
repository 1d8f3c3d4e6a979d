"""The ``scaled_mm`` backend: the scaled GEMMs on ``torch._scaled_mm`` (cuBLASLt on NVIDIA, hipBLASLt
on AMD), and the block format on ``torch.nn.functional.scaled_mm``'s block-wise recipes (cuBLAS 12.9+).

It is its own backend, not part of ``torch``: the ``torch`` backend is the twin, the definition every
other backend is checked against. It serves CUDA tensors only (``dispatch.on_device_for``): on the
CPU, ``torch._scaled_mm`` runs (these adapters are tested there) but is slower than the twin, so
auto would gain nothing. It is also the benchmark baseline of the Triton GEMMs.

What it serves, all fp8 e4m3fn (``torch._scaled_mm`` takes no int8) on a GPU whose fp8 is e4m3fn
(NVIDIA sm89+, AMD gfx95x), with a [M, K] and w [N, K] contiguous (``w.t()`` is the column-major
operand cuBLAS wants) and K, N multiples of 16:

- per-tensor: bf16 or fp16 output, the bias in cuBLAS's epilogue. Not fp32: on an H200 its fp8
  products are not summed to fp32 accuracy (7e-4 off the twin at K = 160 for outputs of order 1,
  where the fp32 tolerance is 1e-4); bf16/fp16 rounding hides that;
- per-token x per-channel (row-wise scales): NVIDIA sm90+, bf16 output (the row-wise kernels write
  bf16 only); not used on AMD (unverified);
- block: NVIDIA sm90+, K and N multiples of 128, M a multiple of 4 (M = 1 fails in cuBLAS on an H200),
  bf16 output. cuBLAS wants the scales in other
  layouts (a_scale column-major; w_scale transposed, its K-groups padded to a multiple of 4), so each
  call re-lays them: two small copies of M * K/128 and N/128 * K/128 floats. The bias is added
  afterwards. **Never run**: the CPU build has no block-wise kernel; tests check the re-layout
  against the layout rules of torch's meta registration.

Legend: M tokens, N output features, K input features.
"""

from __future__ import annotations

import functools

import torch

from atom_core.ops.quant import fp8_e4m3fn_native
from atom_core.ops.reference.quant import FP8_DTYPE
from atom_core.ops.reference.scaled_mm import BLOCK


@functools.lru_cache(maxsize=None)
def _nvidia_sm90(index: int | None) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def _is_nvidia_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and _nvidia_sm90(device.index)


def _common(a, w) -> str | None:
    if a.dtype != FP8_DTYPE:
        return f"torch._scaled_mm takes fp8 operands only, got {a.dtype}"
    if not fp8_e4m3fn_native(a.device):
        return "torch._scaled_mm with float8_e4m3fn needs an NVIDIA GPU of compute capability 8.9+ or an AMD gfx95x"
    if not (a.is_contiguous() and w.is_contiguous()):
        return "torch._scaled_mm needs a row-major a and a contiguous w [N, K]"
    if a.shape[1] % 16 or w.shape[0] % 16:
        return f"torch._scaled_mm needs K and N multiples of 16, got K = {a.shape[1]}, N = {w.shape[0]}"
    return None


def _common_key(a, w) -> tuple:
    return a.dtype, a.is_contiguous(), w.is_contiguous(), a.shape[1] % 16 == 0, w.shape[0] % 16 == 0


def supports_per_tensor(a, a_scale, w, w_scale, bias, out_dtype) -> str | None:
    if out_dtype == torch.float32:
        return "torch._scaled_mm does not sum fp8 products to fp32 accuracy: fp32 outputs are left to the others"
    return _common(a, w)


def key_per_tensor(a, a_scale, w, w_scale, bias, out_dtype):
    """What :func:`supports_per_tensor` reads (the device is part of every call's signature)."""
    return _common_key(a, w), out_dtype == torch.float32


def supports_per_token(a, a_scale, w, w_scale, bias, out_dtype) -> str | None:
    reason = _common(a, w)
    if reason is not None:
        return reason
    if not _is_nvidia_sm90(a.device):
        return "torch._scaled_mm row-wise scaling is used on NVIDIA sm90+ only"
    if out_dtype != torch.bfloat16:
        return f"torch._scaled_mm row-wise scaling writes bf16 only, not {out_dtype}"
    if not (a_scale.is_contiguous() and w_scale.is_contiguous()):
        return "torch._scaled_mm row-wise scaling needs contiguous scales"
    return None


def key_per_token(a, a_scale, w, w_scale, bias, out_dtype):
    return _common_key(a, w), out_dtype, a_scale.is_contiguous(), w_scale.is_contiguous()


def supports_block(a, a_scale, w, w_scale, bias, out_dtype) -> str | None:
    reason = _common(a, w)
    if reason is not None:
        return reason
    if not _is_nvidia_sm90(a.device) or not hasattr(torch.nn.functional, "scaled_mm"):
        return "block-wise torch scaled_mm is used on NVIDIA sm90+ (cuBLAS 12.9+) only"
    if a.shape[1] % BLOCK or w.shape[0] % BLOCK:
        return f"block-wise torch scaled_mm needs K and N multiples of {BLOCK}, got K = {a.shape[1]}, N = {w.shape[0]}"
    if out_dtype != torch.bfloat16:
        return f"block-wise torch scaled_mm writes bf16 only, not {out_dtype}"
    if a.shape[0] % 4:
        return (f"block-wise torch scaled_mm is used for M a multiple of 4 only (M = 1 is not supported by cuBLAS's "
                f"heuristic on an H200; M = 300 runs), got M = {a.shape[0]}")
    return None


def key_block(a, a_scale, w, w_scale, bias, out_dtype):
    return (_common_key(a, w), a.shape[1] % BLOCK == 0, w.shape[0] % BLOCK == 0, out_dtype,
            a.shape[0] % 4 == 0)


def _epilogue_bias(bias, out_dtype):
    """The bias cuBLAS adds in its epilogue, in the output dtype (bf16 / fp16 here)."""
    return None if bias is None else bias.to(out_dtype)


def scaled_mm_per_tensor(a, a_scale, w, w_scale, bias, out_dtype):
    return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale, bias=_epilogue_bias(bias, out_dtype),
                            out_dtype=out_dtype)


def scaled_mm_per_token(a, a_scale, w, w_scale, bias, out_dtype):
    # w_scale [N, 1] -> [1, N]: the scale of mat2 = w^T [K, N] runs along its columns.
    return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale.t(), bias=_epilogue_bias(bias, out_dtype),
                            out_dtype=out_dtype)


def block_scales_for_cublas(a_scale, w_scale):
    """Our layouts → cuBLAS's: a_scale [M, K/128] column-major (stride [1, M]); w_scale
    [N/128, K/128] → [L4, N/128] with stride [1, L4], L4 = K/128 rounded up to a multiple of 4
    (the torch meta registration's rules for BlockWise1x128 x BlockWise128x128)."""
    groups = a_scale.shape[1]
    padded = -(-groups // 4) * 4
    scale_a = torch.empty_strided(a_scale.shape, (1, a_scale.shape[0]), dtype=a_scale.dtype, device=a_scale.device)
    scale_a.copy_(a_scale)  # strides (1, M) exactly: .t().contiguous().t() keeps a size-1 dim's stride
    scale_b = w_scale.new_zeros(w_scale.shape[0], padded)
    scale_b[:, :groups] = w_scale
    return scale_a, scale_b.t()


def scaled_mm_block(a, a_scale, w, w_scale, bias, out_dtype):
    functional = torch.nn.functional
    scale_a, scale_b = block_scales_for_cublas(a_scale, w_scale)
    out = functional.scaled_mm(a, w.t(), scale_a, functional.ScalingType.BlockWise1x128, scale_b,
                               functional.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    if bias is not None:
        out += bias.to(out_dtype)
    return out
