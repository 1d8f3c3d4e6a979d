"""Triton fused experts for a few tokens with fp8 expert weights: GEMV kernels, no sort, no sum launch.

At decode sizes (a few tokens, each choosing K distinct experts) the grouped GEMMs of
``atom_core.ops.triton.fused_moe`` spend most of their time outside the weight stream: the sort by
expert, the sum over choices and 16-row MMA tiles of which one row is used. Here each (token, choice)
pair is its own row and reads its expert's weights itself, in four launches:

1. hidden quantized to fp8 (``fused_moe._quantize_input``: 1 x 128 groups for fp8_block, one scale per
   row for fp8_channel; the twin's values bit for bit);
2. gate/up — program (choice, column tile) streams [BLOCK_N, BLOCK_K] fp8 tiles of the expert's gate
   rows and of the matching up rows, multiplying by the fp8 row in fp32 without tensor cores into
   [BLOCK_N, BLOCK_K] accumulators summed once after the loop (fp8_block: the activation group's and the
   weight block's scales folded into the activation per k, as ``triton.scaled_mm``'s GEMV does), then the
   biases and the activation: act [T * K, I] in hidden's dtype (the intermediate the twin rounds to);
3. act quantized the same way;
4. down and the sum — program (token, column tile) runs the K steps of the token's K choices in one
   loop, each streaming w2's tile of its expert against its act row with the routing weight folded into
   the activation, into one fp32 accumulator (biases added after), stored once in out's dtype.

Choices with ids outside [0, E) are skipped (their act rows are never written; quantized, never read).
An expert chosen by several tokens is read once per choice, so this path serves few tokens
(``fused_moe.GEMV_MAX_TOKENS``), where choices rarely share an expert.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_core.ops.triton.fused_moe import (SILU, SWIGLU_ALPHA, SWIGLU_CLAMPED, SWIGLU_LIMIT, _quantize_input,
                                            _round_to_bf16_values, activate)
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, num_sms
from atom_core.ops.triton.moe_quant_tiles import FORMAT_CODES, FP8_BLOCK, W_FP8_BLOCK


@dataclass(frozen=True)
class GemvConfig:
    gate_up_block_n: int  # intermediate columns per gate/up program (gate and up rows each)
    gate_up_block_k: int  # hidden columns per K step of the gate/up kernel (a multiple of 128)
    down_block_n: int  # hidden columns per down program
    down_block_k: int  # intermediate columns per K step of the down kernel (a multiple of 128)
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def gemv_config(num_tokens: int, hidden_size: int, inter: int, num_sms: int) -> GemvConfig:
    """Column tiles that give every multiprocessor programs at one token: the gate/up grid has T * K
    rows of tiles, the down grid T (its programs walk the K choices), so down tiles are narrower."""
    down_block_n = 8 if cdiv(hidden_size, 16) * num_tokens < 2 * num_sms else 16
    return GemvConfig(16, 256, down_block_n, 256, 4, 3)


@triton.jit
def _k_step(x_row, xs_row, w_ptrs, col_ok, kk, length, stride_xsg, ws_row, stride_wsk, W_FORMAT: tl.constexpr,
            EVEN_K: tl.constexpr):
    """One K step of a GEMV: (fp32 weight tile [BLOCK_N, BLOCK_K], the fp8 activation columns kk as fp32 with,
    for fp8_block, the activation group's and the tile's weight block's scales folded in: ``x[k] *
    xs[k // 128] * ws[k // 128]``; fp8_channel scales in the epilogue)."""
    if EVEN_K:
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0).to(tl.float32)
        x = tl.load(x_row + kk).to(tl.float32)
    else:
        k_ok = kk < length
        w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
    if W_FORMAT == W_FP8_BLOCK:
        group = kk // FP8_BLOCK  # (scales are [., ceil(length / 128)]: every kk < length has its group)
        x = x * tl.load(xs_row + group * stride_xsg, mask=kk < length, other=0.0) \
            * tl.load(ws_row + group * stride_wsk, mask=kk < length, other=0.0)
    return w, x


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, act_ptr, ids_ptr, num_experts, hidden, inter, gate_row_step, up_row_offset,
    alpha, limit,
    stride_xt, stride_xst, stride_xsg, stride_it, stride_ik, stride_we, stride_wn, stride_se, stride_sn, stride_sh,
    stride_be, stride_bn, stride_an,
    TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, W_FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """act[entry, j] = act(x[entry // K] · w13[e, gate_row(j)] + b, x · w13[e, up_row(j)] + b) for the choice
    entry = program_id(0) of expert e (rows as in ``fused_moe._gate_up_kernel``; x: hidden quantized to fp8,
    xs its scales). fp8_block: the tile's gate rows lie in one 128-row weight block, and so do its up rows
    (``gemv_serves``), whose scales fold into the activation per k."""
    entry = tl.program_id(0)
    token = (entry // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + token * stride_it + (entry % TOP_K) * stride_ik).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return
    first = tl.program_id(1) * BLOCK_N
    cols = first + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_rows = cols.to(tl.int64) * gate_row_step
    up_rows = gate_rows + up_row_offset
    k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + token * stride_xt
    xs_row = xs_ptr + token * stride_xst
    gate_ptrs = w_ptr + expert * stride_we + gate_rows[:, None] * stride_wn + k[None, :]
    up_ptrs = gate_ptrs + up_row_offset * stride_wn
    s_expert = ws_ptr + expert * stride_se
    gate_s_row = s_expert + (first * gate_row_step // FP8_BLOCK) * stride_sn  # (fp8_block: one block row each)
    up_s_row = s_expert + ((first * gate_row_step + up_row_offset) // FP8_BLOCK) * stride_sn
    gate_lanes = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_lanes = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        w_gate, x_gate = _k_step(x_row, xs_row, gate_ptrs, col_ok, k0 + k, hidden, stride_xsg, gate_s_row, stride_sh,
                                 W_FORMAT, EVEN_K)
        w_up, x_up = _k_step(x_row, xs_row, up_ptrs, col_ok, k0 + k, hidden, stride_xsg, up_s_row, stride_sh,
                             W_FORMAT, EVEN_K)
        gate_lanes += w_gate * x_gate[None, :]
        up_lanes += w_up * x_up[None, :]
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    acc_gate = tl.sum(gate_lanes, axis=1)
    acc_up = tl.sum(up_lanes, axis=1)
    if W_FORMAT != W_FP8_BLOCK:
        x_scale = tl.load(xs_row)
        acc_gate = acc_gate * x_scale * tl.load(s_expert + gate_rows * stride_sn, mask=col_ok, other=0.0)
        acc_up = acc_up * x_scale * tl.load(s_expert + up_rows * stride_sn, mask=col_ok, other=0.0)
    if HAS_BIAS:
        b_expert = b_ptr + expert * stride_be
        acc_gate += tl.load(b_expert + gate_rows * stride_bn, mask=col_ok, other=0.0).to(tl.float32)
        acc_up += tl.load(b_expert + up_rows * stride_bn, mask=col_ok, other=0.0).to(tl.float32)
    act = activate(acc_gate, acc_up, ACT, alpha, limit)
    if ROUND_BF16:
        act = _round_to_bf16_values(act)
    tl.store(act_ptr + entry.to(tl.int64) * stride_an + cols, act.to(act_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _gemv_down_sum_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, topk_weights_ptr, ids_ptr, out_ptr, num_experts, hidden, inter,
    stride_an, stride_asn, stride_asg, stride_we, stride_wn, stride_se, stride_sn, stride_si, stride_be, stride_bn,
    stride_tw_t, stride_tw_k, stride_it, stride_ik, stride_ot, stride_oh,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, W_FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[t, h] = sum over the token's valid choices c of topk_weight[t, c] * (a[t * K + c] · w2[e_c, h]
    + b2[e_c, h]) in fp32, rounded once to out's dtype (a: the activation quantized to fp8, as its scales).

    One loop runs the K choices' K steps back to back (so the pipeliner streams across choices): each step
    folds the routing weight and the scales into the activation (fp8_block: the group's and the tile's weight
    block's, BLOCK_N dividing 128; fp8_channel: the row's, with the weight rows' scales on the tile). A
    dropped choice's steps load nothing and add zeros."""
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK_N
    cols = first + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    k = tl.arange(0, BLOCK_K)
    steps = tl.cdiv(inter, BLOCK_K)
    lanes = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in range(0, TOP_K * steps):
        c = step // steps
        kk = (step - c * steps) * BLOCK_K + k
        expert = tl.load(ids_ptr + t * stride_it + c * stride_ik).to(tl.int64)
        valid = (expert >= 0) & (expert < num_experts)
        k_ok = kk < tl.where(valid, inter, 0)  # (a dropped choice: no column)
        entry = t * TOP_K + c
        w = tl.load(w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(a_ptr + entry * stride_an + kk, mask=k_ok, other=0.0).to(tl.float32) \
            * tl.load(topk_weights_ptr + t * stride_tw_t + c * stride_tw_k).to(tl.float32)
        s_expert = ws_ptr + expert * stride_se
        if W_FORMAT == W_FP8_BLOCK:
            group = kk // FP8_BLOCK
            x = x * tl.load(as_ptr + entry * stride_asn + group * stride_asg, mask=k_ok, other=0.0) \
                * tl.load(s_expert + (first // FP8_BLOCK) * stride_sn + group * stride_si, mask=k_ok, other=0.0)
        else:
            x = x * tl.load(as_ptr + entry * stride_asn)
            w = w * tl.load(s_expert + cols * stride_sn, mask=cols < tl.where(valid, hidden, 0), other=0.0)[:, None]
        lanes += w * x[None, :]
    acc = tl.sum(lanes, axis=1)
    if HAS_BIAS:
        for c in tl.static_range(TOP_K):
            expert = tl.load(ids_ptr + t * stride_it + c * stride_ik).to(tl.int64)
            valid = (expert >= 0) & (expert < num_experts)
            bias = tl.load(b_ptr + expert * stride_be + cols * stride_bn, mask=cols < tl.where(valid, hidden, 0),
                           other=0.0)
            acc += bias.to(tl.float32) * tl.load(topk_weights_ptr + t * stride_tw_t + c * stride_tw_k).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def device_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (1 for the CPU interpreter: its grids are kept small)."""
    return 1 if device.type == "cpu" else num_sms(device.index or 0)


def fused_experts_gemv(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, activation,
                       w13_bias, w2_bias, out, config: GemvConfig | None = None, interpret: bool = False) -> None:
    """The four launches (module docstring) for fp8 expert weights (``fp8_block`` / ``fp8_channel``) into out
    [T, H]; ``config`` overrides :func:`gemv_config`."""
    if weight_format not in ("fp8_block", "fp8_channel"):
        raise ValueError(f"the GEMV path serves fp8_block and fp8_channel experts, got {weight_format!r}")
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if config is None:
        config = gemv_config(num_tokens, hidden_size, inter, device_sms(hidden.device))
    swiglu = activation == "swiglu_clamped"
    if weight_format == "fp8_block" and (FP8_BLOCK.value % (config.gate_up_block_n * (2 if swiglu else 1)) or inter % config.gate_up_block_n
                or FP8_BLOCK.value % config.down_block_n):
        raise ValueError(f"fp8_block needs each GEMV tile's rows inside one 128-row weight block: block_n dividing "
                         f"128 (gate/up: 64 for swiglu's interleaved rows) and the intermediate size "
                         f"{inter}; got {config}")
    w_format = FORMAT_CODES[weight_format]
    x, x_scale = _quantize_input(hidden, weight_format, w13.dtype)
    act = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    b13 = w13_bias if w13_bias is not None else w13  # any pointer; never read without HAS_BIAS
    _gemv_gate_up_kernel[(num_tokens * top_k, cdiv(inter, config.gate_up_block_n))](
        x, x_scale, w13, w13_scale, b13, act, topk_ids, num_experts, hidden_size, inter, 2 if swiglu else 1,
        1 if swiglu else inter, SWIGLU_ALPHA, SWIGLU_LIMIT,
        x.stride(0), *x_scale.stride(), *topk_ids.stride(), w13.stride(0), w13.stride(1), *w13_scale.stride(),
        *(w13_bias.stride() if w13_bias is not None else (0, 0)), act.stride(0),
        TOP_K=top_k, ACT=SWIGLU_CLAMPED if swiglu else SILU, HAS_BIAS=w13_bias is not None, W_FORMAT=w_format,
        BLOCK_N=config.gate_up_block_n, BLOCK_K=config.gate_up_block_k,
        EVEN_K=hidden_size % config.gate_up_block_k == 0, ROUND_BF16=interpret and hidden.dtype == torch.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    a, a_scale = _quantize_input(act, weight_format, w2.dtype)
    b2 = w2_bias if w2_bias is not None else w2
    _gemv_down_sum_kernel[(num_tokens, cdiv(hidden_size, config.down_block_n))](
        a, a_scale, w2, w2_scale, b2, topk_weights, topk_ids, out, num_experts, hidden_size, inter,
        a.stride(0), *a_scale.stride(), w2.stride(0), w2.stride(1), *w2_scale.stride(),
        *(w2_bias.stride() if w2_bias is not None else (0, 0)), *topk_weights.stride(), *topk_ids.stride(),
        *out.stride(),
        TOP_K=top_k, HAS_BIAS=w2_bias is not None, W_FORMAT=w_format, BLOCK_N=config.down_block_n,
        BLOCK_K=config.down_block_k, num_warps=config.num_warps, num_stages=config.num_stages,
    )
