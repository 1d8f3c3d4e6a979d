"""AITER adapters for the scaled GEMMs (aiter/ops/gemm_op_a8w8.py). AITER allocates the output.

- per-token x per-channel: ``gemm_a8w8_CK(XQ, WQ, x_scale [M, 1], w_scale [N, 1], bias [1, N], dtype)``
  (AITER's own test passes these layouts), fp8 or int8, bf16/fp16 out, the bias in the output dtype;
- per-tensor: the same kernel with the two scalars broadcast to [M, 1] and [N, 1] (two tiny copies);
- block: ``gemm_a8w8_blockscale(XQ, WQ, x_scale [M, K/128] row-major, w_scale [N/128, K/128], dtype)``
  (the non-preshuffled kernel; the ``bpreshuffle`` variants need a weight shuffled at load time and
  a column-major x_scale, a layout choice of the linear method, not served here). It takes no bias:
  added afterwards.

Legend: M tokens, N output features, K input features.
"""

from __future__ import annotations

import aiter


def _bias(bias, out_dtype):
    return None if bias is None else bias.to(out_dtype).view(1, -1)


def scaled_mm_per_token(a, a_scale, w, w_scale, bias, out_dtype):
    return aiter.gemm_a8w8_CK(a, w, a_scale, w_scale, _bias(bias, out_dtype), out_dtype)


def scaled_mm_per_tensor(a, a_scale, w, w_scale, bias, out_dtype):
    a_rows = a_scale.reshape(1, 1).expand(a.shape[0], 1).contiguous()
    w_rows = w_scale.reshape(1, 1).expand(w.shape[0], 1).contiguous()
    return aiter.gemm_a8w8_CK(a, w, a_rows, w_rows, _bias(bias, out_dtype), out_dtype)


def scaled_mm_block(a, a_scale, w, w_scale, bias, out_dtype):
    out = aiter.gemm_a8w8_blockscale(a, w, a_scale, w_scale, out_dtype)
    if bias is not None:
        out += bias.to(out_dtype)
    return out
