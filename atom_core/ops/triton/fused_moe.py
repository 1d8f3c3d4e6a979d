"""Triton fused experts: sort the choices by expert (``moe_align``), then two grouped GEMMs and a sum.

1. ``moe_align`` — choices sorted by expert, each expert's run padded to BLOCK_M rows. A batch of at most
   BLOCK_M choices (decode of one or two tokens at top-8) skips this launch: each GEMM program derives its
   block from topk_ids itself (``moe_align.block_of``).
2. gate/up GEMM — program (block, n-tile) multiplies BLOCK_M rows of one expert by the gate rows
   AND the matching up rows of w13 (two accumulators), adds the biases and applies the activation
   in the epilogue: act [N, I] in hidden's dtype, one row per choice (N = T * K).
3. down GEMM — act rows by w2 of the same expert, plus bias, times the choice's routing weight:
   y [N, H] fp32.
4. sum over the K choices of each token in fp32 (dropped choices, ids outside [0, E), skipped).

The grid is sized by the worst case of the routing (``align_sizes``), never by E x T; programs past
the used blocks return at once, so a decode step with most experts idle launches few programs.
Block sizes come from :func:`block_config`, keyed by tokens per expert.

Quantized expert weights (:func:`fused_experts_quant`: fp8 per-channel, fp8 block-128, MXFP4 kept
packed) go through the same two kernels with ``W_FORMAT`` set: each K step loads the weight tile in
its stored format and dequantizes it in registers (``atom_core.ops.triton.moe_quant_tiles``; MXFP4 in a K
loop of its own, with tiles from :data:`MXFP4_BLOCK_CONFIGS`). With fp8
weights each GEMM's input is quantized to fp8 once, by one launch of ``triton.quant``'s
``per_group_quant`` (groups of 128) or ``per_token_quant`` before it (hidden before step 2, act before
step 3), and the GEMM loads fp8 rows and their scales. Tiles of fewer than 64 rows by at least 64 columns
(decode) multiply transposed (``swaps_ab``, ``moe_quant_tiles.fp8_step``): on sm90 that is fp8 wgmma
instead of fp16 mma.sync on widened tiles. ``W_PLAIN`` compiles to the unquantized kernel.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_core.ops.dispatch import triton_interpret
from atom_core.ops.reference.quant import GROUP_SIZE
from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2
from atom_core.ops.triton.moe_align import align_sizes, block_of, moe_align
from atom_core.ops.triton.moe_quant_tiles import (
    FORMAT_CODES,
    FP8_BLOCK,
    W_FP8_BLOCK,
    W_FP8_CHANNEL,
    W_MXFP4,
    W_PLAIN,
    fp8_acc,
    fp8_step,
    mxfp4_down_loop,
    mxfp4_gate_up_loop,
)
from atom_core.ops.triton.quant import per_group_quant, per_token_quant

SILU = tl.constexpr(0)
SWIGLU_CLAMPED = tl.constexpr(1)
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


@dataclass(frozen=True)
class BlockConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def rows_per_expert(num_tokens: int, top_k: int, num_experts: int) -> float:
    """m = T * K / E, the mean rows an expert sees: what every tile rule here is keyed by."""
    return num_tokens * top_k / max(num_experts, 1)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def block_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> BlockConfig:
    """Tile sizes by the mean rows per expert, m = T * K / E.

    | m         | BLOCK_M | BLOCK_N | BLOCK_K | GROUP_M | warps | stages | regime                          |
    |-----------|---------|---------|---------|---------|-------|--------|---------------------------------|
    | <= 12     | 16      | 32      | 128     | 1       | 4     | 3      | decode: weight-bandwidth bound  |
    | <= 28     | 32      | 64      | 128     | 1       | 4     | 3      | decode, experts past 16 rows    |
    | <= 64     | 32      | 64      | 64      | 4       | 4     | 4      | small batches                   |
    | <= 512    | 64      | 64      | 64      | 8       | 4     | 3      | prefill                         |
    | > 512     | 128     | 64      | 64      | 8       | 8     | 3      | long prefill                    |

    BLOCK_M is the padding unit of an expert's rows: small when experts see few rows (decode pads
    each hit expert to 16 rows, the smallest tensor-core tile), large when they see many (fewer
    reloads of the weights). An expert with more rows than BLOCK_M has its weights read once per
    BLOCK_M block: routed tokens do not spread evenly, so from a mean of 12 rows many experts pass 16
    and 32-row blocks read less (Qwen3-30B-A3B's layer on an H200, random routing: at 256 tokens, m = 16,
    the experts hit need 180 blocks of 16 rows but 128 of 32, and the layer takes 0.305 ms instead of
    0.336; at 192, m = 12, the two are within 1%; ``benchmarks/results/h200_ops_moe_row_blocks.json``).
    Shared memory (Triton 3.6, compiled for each target off the GPU): the most any of these takes on sm86 /
    sm89, whose programs get ~99 KB, is the 32 x 64 x 128 gate/up kernel's 80 KB (Triton stages one buffer
    fewer than ``num_stages`` there); on sm90, 96 KB (128 x 64 x 64).
    GROUP_M > 1 walks several M blocks over one N stripe for L2 reuse.
    Decode reads each hit expert's weights once and does little math, so it wants many programs in
    flight: BLOCK_N = 32 gives 2 x the programs of 64 (T = 1, K = 8, I = 768: 8 x 24 gate/up programs).
    The gate/up kernel holds two [BLOCK_M, BLOCK_N] accumulators, hence BLOCK_N <= 64 throughout.
    fp32 (full-precision dot, twice the bytes per element) halves BLOCK_K.
    These are starting values; ``benchmarks/ops_moe.py`` measures them on the target GPU.
    """
    m = rows_per_expert(num_tokens, top_k, num_experts)
    if m <= 12:
        config = BlockConfig(16, 32, 128, 1, 4, 3)
    elif m <= 28:
        config = BlockConfig(32, 64, 128, 1, 4, 3)
    elif m <= 64:
        config = BlockConfig(32, 64, 64, 4, 4, 4)
    elif m <= 512:
        config = BlockConfig(64, 64, 64, 8, 4, 3)
    else:
        config = BlockConfig(128, 64, 64, 8, 8, 3)
    if dtype == torch.float32:
        config = BlockConfig(config.block_m, config.block_n, config.block_k // 2, config.group_m,
                             config.num_warps, config.num_stages)
    return config


@triton.jit
def _tile_of(pid, num_blocks, num_n_tiles, GROUP_M: tl.constexpr):
    """Program id → (M block, N tile), GROUP_M blocks at a time over each N stripe."""
    per_group = GROUP_M * num_n_tiles
    first_block = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_block, GROUP_M)
    return first_block + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _k_step_masks(row_ok, col_ok, k, remaining, EVEN_K: tl.constexpr):
    """(activation mask, weight mask) of one K step of a [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tile with
    ``remaining`` columns of K left (EVEN_K: every step is whole, only rows and columns are masked)."""
    if EVEN_K:
        a_mask = row_ok[:, None]
        w_mask = col_ok[None, :]
    else:
        k_ok = k < remaining
        a_mask = row_ok[:, None] & k_ok[None, :]
        w_mask = k_ok[:, None] & col_ok[None, :]
    return a_mask, w_mask


@triton.jit
def _round_to_bf16_values(x):
    """fp32 → the fp32 holding x rounded to bf16, to nearest even (for the interpreter, whose fp32 → bf16
    cast truncates: its 1-ulp error in the activation between the GEMMs would move fp8-quantized values
    by a whole fp8 step where a GPU, rounding to nearest, does not)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, act_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr,
    num_entries, num_experts, hidden, inter, num_blocks, gate_row_step, up_row_offset, alpha, limit,
    stride_it, stride_ik,
    stride_xt, stride_xh, stride_xst, stride_xsg, stride_we, stride_wn, stride_wh, stride_se, stride_sn, stride_sh,
    stride_be, stride_bn, stride_an,
    TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, W_FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, ROUND_BF16: tl.constexpr, SWAP_AB: tl.constexpr,
    SORT_HERE: tl.constexpr, PDL: tl.constexpr,
):
    """act[entry, j] = act(x[entry // K] · w13[e, gate_row(j)] + b, x · w13[e, up_row(j)] + b).

    gate_row(j) = j * gate_row_step, up_row(j) = gate_row(j) + up_row_offset:
    silu (halves) step 1, offset I; swiglu_clamped (interleaved) step 2, offset 1.
    Quantized weights (``W_FORMAT``): ws_ptr is w13's scale, strides (expert, row, column);
    MXFP4's stride_wh is that of w13's bytes (two elements each). fp8 formats: x is hidden quantized to
    fp8 and xs_ptr its fp32 scales, strides (token, group): [T, ceil(H / 128)] for fp8_block (group =
    K step), [T, 1] for fp8_channel; the plain and MXFP4 formats never read xs_ptr. SWAP_AB (fp8 formats):
    the tiles are multiplied transposed (``moe_quant_tiles.fp8_step``).
    """
    wait_for_inputs(PDL)
    pid_m, pid_n = _tile_of(tl.program_id(0), num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    expert, entry = block_of(pid_m, sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr, stride_it, stride_ik,
                              num_entries, num_experts, TOP_K, BLOCK_M, SORT_HERE)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    row_ok = entry < num_entries
    token = (entry // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_rows = cols.to(tl.int64) * gate_row_step
    up_rows = gate_rows + up_row_offset
    k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + token[:, None] * stride_xt + k[None, :] * stride_xh
    w_expert = w_ptr + expert * stride_we
    s_expert = ws_ptr + expert * stride_se
    gate_ptrs = w_expert + gate_rows[None, :] * stride_wn + k[:, None] * stride_wh
    up_ptrs = gate_ptrs + up_row_offset * stride_wn
    xs_ptrs = xs_ptr + token * stride_xst
    acc_gate = fp8_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_up = fp8_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    # MXFP4 runs a K loop of its own (moe_quant_tiles.mxfp4_gate_up_loop): whole steps unmasked, then the tail.
    if W_FORMAT == W_MXFP4:
        acc_gate, acc_up = mxfp4_gate_up_loop(x_ptrs, w_expert + gate_rows[None, :] * stride_wn,
                                              s_expert + gate_rows[None, :] * stride_sn, up_row_offset * stride_wn,
                                              up_row_offset * stride_sn, row_ok, col_ok, hidden, stride_xh, stride_wh,
                                              stride_sh, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, UPCAST_DOT)
    else:
        for step in range(tl.cdiv(hidden, BLOCK_K)):
            a_mask, w_mask = _k_step_masks(row_ok, col_ok, k, hidden - step * BLOCK_K, EVEN_K)
            a = tl.load(x_ptrs, mask=a_mask, other=0.0)
            if W_FORMAT == W_PLAIN:
                w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
                w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
                if UPCAST_DOT:
                    a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
                acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
            else:
                w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
                w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
                a_scale, gate_s, up_s = row_ok, col_ok, col_ok  # (stand-ins: read only by the block format)
                if W_FORMAT == W_FP8_BLOCK:  # BLOCK_K == 128: this step is block column `step`, activation group `step`
                    a_scale = tl.load(xs_ptrs + step * stride_xsg, mask=row_ok, other=0.0)
                    gate_s = tl.load(s_expert + (gate_rows // FP8_BLOCK) * stride_sn + step * stride_sh, mask=col_ok,
                                     other=0.0)
                    up_s = tl.load(s_expert + (up_rows // FP8_BLOCK) * stride_sn + step * stride_sh, mask=col_ok,
                                   other=0.0)
                acc_gate = fp8_step(acc_gate, a, w_gate, a_scale, gate_s, W_FORMAT == W_FP8_BLOCK, SWAP_AB)
                acc_up = fp8_step(acc_up, a, w_up, a_scale, up_s, W_FORMAT == W_FP8_BLOCK, SWAP_AB)
            x_ptrs += BLOCK_K * stride_xh
            gate_ptrs += BLOCK_K * stride_wh
            up_ptrs += BLOCK_K * stride_wh
    if SWAP_AB:
        acc_gate = tl.trans(acc_gate)
        acc_up = tl.trans(acc_up)

    if W_FORMAT == W_FP8_CHANNEL:
        a_scale = tl.load(xs_ptrs, mask=row_ok, other=0.0)
        gate_s = tl.load(s_expert + gate_rows * stride_sn, mask=col_ok, other=0.0)
        up_s = tl.load(s_expert + up_rows * stride_sn, mask=col_ok, other=0.0)
        acc_gate = acc_gate * a_scale[:, None] * gate_s[None, :]
        acc_up = acc_up * a_scale[:, None] * up_s[None, :]
    if HAS_BIAS:
        b_expert = b_ptr + expert * stride_be + gate_rows * stride_bn
        acc_gate += tl.load(b_expert, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_expert + up_row_offset * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACT == SILU:
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    else:
        gate = tl.minimum(acc_gate, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        act = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    if ROUND_BF16:
        act = _round_to_bf16_values(act)
    out_ptrs = act_ptr + entry.to(tl.int64)[:, None] * stride_an + cols[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, topk_weights_ptr, y_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr,
    ids_ptr, num_entries, num_experts, hidden, inter, num_blocks, stride_it, stride_ik,
    stride_an, stride_asn, stride_asg, stride_we, stride_wn, stride_wi, stride_se, stride_sn, stride_si,
    stride_be, stride_bn, stride_tw_t, stride_tw_k, stride_yn,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, W_FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, SWAP_AB: tl.constexpr, SORT_HERE: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[entry, h] = topk_weight[entry] * (act[entry] · w2[e, h] + b2[e, h]) (formats and SWAP_AB as the gate/up
    kernel: for fp8, act is the activation quantized to fp8 and as_ptr its scales [N, ceil(I / 128)] or [N, 1])."""
    wait_for_inputs(PDL)
    pid_m, pid_n = _tile_of(tl.program_id(0), num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert, entry = block_of(pid_m, sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr, stride_it, stride_ik,
                              num_entries, num_experts, TOP_K, BLOCK_M, SORT_HERE)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    row_ok = entry < num_entries
    entry = entry.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    k = tl.arange(0, BLOCK_K)

    a_ptrs = act_ptr + entry[:, None] * stride_an + k[None, :]
    s_expert = ws_ptr + expert * stride_se
    w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    w_ptrs = w_rows + k[:, None] * stride_wi
    as_ptrs = as_ptr + entry * stride_asn
    acc = fp8_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    # MXFP4: a K loop of its own (moe_quant_tiles.mxfp4_down_loop), as in the gate/up kernel
    if W_FORMAT == W_MXFP4:
        acc = mxfp4_down_loop(a_ptrs, w_rows, s_expert + cols.to(tl.int64)[None, :] * stride_sn, row_ok, col_ok,
                              inter, stride_wi, stride_si, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
                              UPCAST_DOT)
    else:
        for step in range(tl.cdiv(inter, BLOCK_K)):
            a_mask, w_mask = _k_step_masks(row_ok, col_ok, k, inter - step * BLOCK_K, EVEN_K)
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            if W_FORMAT == W_PLAIN:
                w = tl.load(w_ptrs, mask=w_mask, other=0.0)
                if UPCAST_DOT:
                    a, w = a.to(tl.float32), w.to(tl.float32)
                acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            else:
                w = tl.load(w_ptrs, mask=w_mask, other=0.0)
                a_scale, w_s = row_ok, col_ok  # (stand-ins: read only by the block format)
                if W_FORMAT == W_FP8_BLOCK:
                    a_scale = tl.load(as_ptrs + step * stride_asg, mask=row_ok, other=0.0)
                    w_s = tl.load(s_expert + (cols // FP8_BLOCK) * stride_sn + step * stride_si, mask=col_ok, other=0.0)
                acc = fp8_step(acc, a, w, a_scale, w_s, W_FORMAT == W_FP8_BLOCK, SWAP_AB)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wi
    if SWAP_AB:
        acc = tl.trans(acc)

    if W_FORMAT == W_FP8_CHANNEL:
        a_scale = tl.load(as_ptrs, mask=row_ok, other=0.0)
        acc = acc * a_scale[:, None] * tl.load(s_expert + cols * stride_sn, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + cols * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    route = tl.load(topk_weights_ptr + (entry // TOP_K) * stride_tw_t + (entry % TOP_K) * stride_tw_k,
                    mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * route[:, None]
    tl.store(y_ptr + entry[:, None] * stride_yn + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_choices_kernel(
    y_ptr, ids_ptr, out_ptr, hidden, num_experts, stride_yn, stride_it, stride_ik, stride_ot, stride_oh,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    """out[t] = sum over the token's valid choices k of y[t * K + k], in fp32."""
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + t * stride_it + k * stride_ik)
        # a dropped choice reads no column: its row of y was never written
        width = tl.where((expert >= 0) & (expert < num_experts), hidden, 0)
        acc += tl.load(y_ptr + (t * TOP_K + k) * stride_yn + cols, mask=cols < width, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@dataclass(frozen=True)
class LaunchShape:
    """What the launches of one call derive from its sizes alone."""
    num_entries: int  # N = T * K choices
    num_blocks: int  # BLOCK_M blocks of the aligned choices (worst case)
    sorts_in_program: bool  # N <= BLOCK_M: no moe_align launch, each GEMM program finds its block (block_of)
    gate_up_grid: tuple[int]
    down_grid: tuple[int]
    sum_grid: tuple[int, int]
    block_h: int  # columns per program of the sum over K
    even_hidden: bool  # H a multiple of BLOCK_K (no K masks in the gate/up GEMM)
    even_inter: bool  # I a multiple of BLOCK_K (no K masks in the down GEMM)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def launch_shape(num_tokens: int, top_k: int, num_experts: int, hidden_size: int, inter: int,
                 cfg: BlockConfig) -> LaunchShape:
    """The grids and flags of :func:`fused_experts`' launches, per shape and block config."""
    num_entries = num_tokens * top_k
    sorts_in_program = num_entries <= cfg.block_m
    # in-program: at most one block per choice (one per distinct expert)
    num_blocks = num_entries if sorts_in_program else align_sizes(num_entries, num_experts, cfg.block_m)[1]
    block_h = min(next_power_of_2(hidden_size), 1024)
    return LaunchShape(
        num_entries, num_blocks, sorts_in_program,
        gate_up_grid=(num_blocks * cdiv(inter, cfg.block_n),),
        down_grid=(num_blocks * cdiv(hidden_size, cfg.block_n),),
        sum_grid=(num_tokens, cdiv(hidden_size, block_h)), block_h=block_h,
        even_hidden=hidden_size % cfg.block_k == 0, even_inter=inter % cfg.block_k == 0)


def fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out, config=None):
    """Backend entry of ``ops.fused_experts`` (shapes checked by the public op); ``config`` overrides
    :func:`block_config`."""
    if hidden.shape[0] == 0:
        return
    cfg = config or block_config(hidden.shape[0], topk_ids.shape[1], w13.shape[0], hidden.dtype)
    _launch(hidden, w13, None, w2, None, topk_weights, topk_ids, None, activation, w13_bias, w2_bias, out, cfg)


# MXFP4 launch candidates per regime of rows per expert, m = T * K / E (GPT-OSS-20B, E 32 and K 4: m = T / 8).
# The first of each regime is quant_block_config's choice; ``benchmarks/ops_moe.py --sweep mxfp4`` times them
# all on the target GPU (and ``fused_experts_quant(..., config=...)`` takes any of them); the defaults are that
# table's fastest on an H200 (docs/benchmarks.md: decode 16x32x64 with 4 stages at 1, 8 and 64 tokens).
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages); sm_90 compiles of the GPT-OSS
# layer (H = I = 2880, bf16) use at most 255 registers without spills and at most 128 KB of shared memory.
# The decode costs 8 to 13 instructions per weight element and step (sm_90 code of the K loops, loads and
# MMAs included) and is repeated for every BLOCK_M block of an expert, so many rows per expert want tall
# tiles (BLOCK_M 128 / 256: one decoded weight tile serves more rows); few want BLOCK_M = 16 (the smallest
# MMA tile) and enough programs to keep every SM busy (BLOCK_N 32: 90 N tiles per expert at H = 2880).
MXFP4_BLOCK_CONFIGS = {
    # m <= 16: each hit expert's weights are read and decoded once (BLOCK_M is the MMA minimum)
    "decode": (
        BlockConfig(16, 32, 64, 1, 4, 4), BlockConfig(16, 64, 64, 1, 4, 4), BlockConfig(16, 32, 128, 1, 4, 3),
        BlockConfig(16, 64, 128, 1, 4, 3), BlockConfig(16, 64, 128, 1, 8, 3), BlockConfig(16, 32, 256, 1, 4, 3),
    ),
    # m <= 64: one or two BLOCK_M blocks per expert
    "small": (
        BlockConfig(64, 64, 64, 4, 4, 3), BlockConfig(32, 64, 64, 4, 4, 4), BlockConfig(64, 64, 128, 4, 4, 3),
        BlockConfig(64, 128, 64, 4, 8, 3), BlockConfig(128, 64, 64, 4, 8, 3), BlockConfig(128, 128, 64, 4, 8, 3),
    ),
    # m <= 256
    "prefill": (
        BlockConfig(128, 64, 64, 8, 8, 3), BlockConfig(128, 128, 64, 8, 8, 3), BlockConfig(64, 128, 64, 8, 8, 3),
        BlockConfig(64, 64, 64, 8, 4, 3), BlockConfig(256, 64, 64, 8, 8, 3),
    ),
    # m > 256: compute bound; the decode per MMA falls with BLOCK_M * BLOCK_N
    "long": (
        BlockConfig(128, 128, 64, 8, 8, 3), BlockConfig(256, 64, 64, 8, 8, 3), BlockConfig(128, 64, 64, 8, 8, 3),
        BlockConfig(128, 128, 64, 8, 8, 4), BlockConfig(128, 64, 128, 8, 8, 3),
    ),
}
MXFP4_REGIMES = ((16, "decode"), (64, "small"), (256, "prefill"), (float("inf"), "long"))  # (largest m, regime)


def mxfp4_regime(num_tokens: int, top_k: int, num_experts: int) -> str:
    """The :data:`MXFP4_BLOCK_CONFIGS` regime of a call: by the mean rows per expert m = T * K / E."""
    m = rows_per_expert(num_tokens, top_k, num_experts)
    return next(name for largest, name in MXFP4_REGIMES if m <= largest)


def check_mxfp4_block_k(block_k: int) -> None:
    """MXFP4 tiles cover whole E8M0 blocks (32 elements) along K and, as every Triton tile, a power of two:
    BLOCK_K in 32, 64, 128, 256, ... (its BLOCK_K / 32 scales per column are one power-of-two tile)."""
    if block_k < 32 or block_k & (block_k - 1):
        raise ValueError(f"mxfp4 needs BLOCK_K a power of two and a multiple of 32 (whole E8M0 scale blocks per "
                         f"K step), got {block_k}")


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def quant_block_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype,
                       weight_format: str) -> BlockConfig:
    """:func:`block_config` with BLOCK_K = 128 for fp8 weights (one block column / activation group
    per K step; 128 fp8 bytes, as many as 64 bf16 ones), and at up to 14 rows per expert 16 x 64 tiles,
    multiplied transposed (:func:`swaps_ab`), with 3 stages from 8 tokens, 4 at 2-4 tokens and at one token in
    fp8_block, 6 at one token in fp8_channel: on an H200 (Qwen3-30B-A3B's layer) 0.082 / 0.149 ms at 8 / 32
    tokens in fp8_channel (0-2% slower with 4 stages at 8-256 tokens), 20 us at one token against 25 for the
    16 x 32 tiles of the plain regime; at 1 / 2 / 4 tokens, 3 / 4 / 6 stages: fp8_channel 20.5 / 18.6 / 18.2,
    31.8 / 31.7 / 34.8, 53.0 / 51.9 / 54.6 us; fp8_block 20.2 / 20.2 / 20.8, 32.6 / 32.2 / 35.3,
    51.8 / 51.4 / 55.1 (``benchmarks/results/h200_ops_moe_sort_in_program.json``); from 14 to 28 rows per expert
    32 x 64 tiles, also transposed, which read the weights of an expert of 17-32 rows once (fp8_block
    0.187 against 0.195 ms at 256 tokens, 0.202 against 0.219 for 64 x 64 at 384; equal at 240 and 512;
    ``benchmarks/results/h200_ops_moe_row_blocks.json``); from 28 to 64 rows per expert the 64 x 64 tiles
    of the regime above
    (``python -m benchmarks.ops_moe --sweep fp8_block``: 1.27x / 1.46x faster than 32 x 64 at 512 / 1,024
    tokens, 1.09x / 1.44x for fp8_channel; docs/benchmarks.md). MXFP4: the first candidate of its regime in
    :data:`MXFP4_BLOCK_CONFIGS` (fp32 halves BLOCK_K, as in :func:`block_config`, down to 32)."""
    if weight_format == "mxfp4":
        cfg = MXFP4_BLOCK_CONFIGS[mxfp4_regime(num_tokens, top_k, num_experts)][0]
        if dtype == torch.float32:
            cfg = BlockConfig(cfg.block_m, cfg.block_n, max(cfg.block_k // 2, 32), cfg.group_m, cfg.num_warps,
                              cfg.num_stages)
        return cfg
    cfg = block_config(num_tokens, top_k, num_experts, dtype)
    if weight_format.startswith("fp8"):
        m = rows_per_expert(num_tokens, top_k, num_experts)
        if m <= 14:  # decode: 64-wide N tiles, multiplied transposed; stages by tokens (docstring)
            stages = 3 if num_tokens > 4 else 6 if num_tokens == 1 and weight_format == "fp8_channel" else 4
            return BlockConfig(16, 64, 128, 1, 4, stages)
        if m <= 28:  # 32-row blocks, multiplied transposed
            return BlockConfig(32, 64, 128, 4, 4, 3)
        if m <= 64:  # the next regime's 64 x 64 tiles (docstring)
            return BlockConfig(64, 64, 128, 8, 4, 3)
        return BlockConfig(cfg.block_m, cfg.block_n, 128, cfg.group_m, cfg.num_warps, cfg.num_stages)
    return cfg


def fused_experts_quant(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, activation,
                        w13_bias, w2_bias, out, hidden_q=None, hidden_scale=None, config=None):
    """Backend entry of ``ops.fused_experts_quant`` (hidden_q / hidden_scale: hidden quantized by the caller, read
    instead of quantizing it); ``config`` overrides :func:`quant_block_config`
    (fp8_block needs BLOCK_K = 128, MXFP4 a power of two >= 32: :func:`check_mxfp4_block_k`)."""
    if hidden.shape[0] == 0:
        return
    cfg = config or quant_block_config(hidden.shape[0], topk_ids.shape[1], w13.shape[0], hidden.dtype, weight_format)
    if weight_format == "fp8_block" and cfg.block_k != 128:
        raise ValueError(f"fp8_block needs BLOCK_K = 128 (one scale block per K step), got {cfg.block_k}")
    if weight_format == "mxfp4":
        check_mxfp4_block_k(cfg.block_k)
    _launch(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, activation, w13_bias,
            w2_bias, out, cfg, hidden_q, hidden_scale)


def swaps_ab(cfg: BlockConfig) -> bool:
    """Whether the fp8 GEMMs of ``cfg`` multiply their tiles transposed (``moe_quant_tiles.fp8_step``): rows
    of fewer than 64 (the least M of sm90's wgmma) by columns of at least 64."""
    return cfg.block_m < 64 <= cfg.block_n


def _quantize_input(x, weight_format, fp8_dtype, tokens):
    """One GEMM input x [R, C] → (fp8 [R, C] of ``fp8_dtype``, fp32 scales) in one launch, as the twin's
    ``activation_quantizer``: fp8_block per 1 x 128 group (scales [R, ceil(C / 128)]), fp8_channel per
    row (scales [R, 1]); ``tokens``: the tokens the layer serves (dependent launch)."""
    if x.stride(1) != 1:  # the quantization kernels read each row as contiguous
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=fp8_dtype, device=x.device)
    if weight_format == "fp8_block":
        scale = torch.empty(rows, cdiv(cols, GROUP_SIZE), dtype=torch.float32, device=x.device)
        per_group_quant(x, GROUP_SIZE, q, scale, tokens)
    else:
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        per_token_quant(x, q, scale, tokens)
    return q, scale


def _launch(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, activation, w13_bias,
            w2_bias, out, cfg, hidden_q=None, hidden_scale=None):
    """Align, gate/up, down, sum; every launch dependent (``dependent_launch``) on the layer's token count.
    hidden_q / hidden_scale: hidden's fp8 [T, H] and scales from the caller (fp8 formats; else quantized here).
    Strides are passed as ``*t.stride()`` (one call per tensor; ``t.stride(i)`` costs as much each)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    shape = launch_shape(num_tokens, top_k, num_experts, hidden_size, inter, cfg)
    num_entries, num_blocks = shape.num_entries, shape.num_blocks
    # fp32 operands: full-precision dot, not TF32; 16-bit operands: the target's default.
    precision = "ieee" if hidden.dtype == torch.float32 else None
    # Triton's CPU interpreter multiplies bf16 dot operands wrongly and casts fp32 to bf16 by truncation:
    # there (only) dot operands go up to fp32 and the activation between the GEMMs is rounded by hand.
    upcast = triton_interpret() and hidden.dtype == torch.bfloat16
    w_format = FORMAT_CODES[weight_format]
    fp8 = weight_format in ("fp8_block", "fp8_channel")
    swap_ab = fp8 and swaps_ab(cfg)
    if shape.sorts_in_program:  # the GEMM programs read topk_ids themselves; the sort's pointers are never read
        sorted_entries = block_experts = num_padded = topk_ids
    else:
        sorted_entries, block_experts, num_padded = moe_align(topk_ids, num_experts, cfg.block_m)
    pdl = launch_kwargs(hidden, num_tokens)

    # fp8 weights: the GEMM reads hidden quantized (fp8 of w13's dtype) with its scales; other formats
    # read hidden itself, and x_scale is any pointer, never read.
    if not fp8:
        x, x_scale = hidden, hidden
    elif hidden_q is not None:
        x, x_scale = hidden_q, hidden_scale
    else:
        x, x_scale = _quantize_input(hidden, weight_format, w13.dtype, num_tokens)
    act = torch.empty(num_entries, inter, dtype=hidden.dtype, device=hidden.device)
    swiglu = activation == "swiglu_clamped"
    b13 = w13_bias if w13_bias is not None else w13  # any pointer; never read without HAS_BIAS
    s13 = w13_scale if w13_scale is not None else w13  # never read by the plain format
    _gate_up_kernel[shape.gate_up_grid](
        x, x_scale, w13, s13, b13, act, sorted_entries, block_experts, num_padded, topk_ids,
        num_entries, num_experts, hidden_size, inter, num_blocks, 2 if swiglu else 1, 1 if swiglu else inter,
        SWIGLU_ALPHA, SWIGLU_LIMIT, *topk_ids.stride(),
        *x.stride(), *(x_scale.stride() if fp8 else (0, 0)),
        *w13.stride(), *(w13_scale.stride() if w13_scale is not None else (0, 0, 0)),
        *(w13_bias.stride() if w13_bias is not None else (0, 0)), act.stride(0),
        TOP_K=top_k, ACT=SWIGLU_CLAMPED if swiglu else SILU, HAS_BIAS=w13_bias is not None,
        EVEN_K=shape.even_hidden, W_FORMAT=w_format, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, DOT_PRECISION=precision, UPCAST_DOT=upcast, ROUND_BF16=upcast, SWAP_AB=swap_ab,
        SORT_HERE=shape.sorts_in_program, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )

    # fp32 rows: the sum over K is rounded once, as in the twin (costs 2x the bytes of a 16-bit y,
    # a few % of a prefill, nothing at decode).
    y = torch.empty(num_entries, hidden_size, dtype=torch.float32, device=hidden.device)
    # Rows of dropped choices were never written: they are quantized too (each row on its own) and never read.
    a, a_scale = _quantize_input(act, weight_format, w2.dtype, num_tokens) if fp8 else (act, act)
    b2 = w2_bias if w2_bias is not None else w2
    s2 = w2_scale if w2_scale is not None else w2
    _down_kernel[shape.down_grid](
        a, a_scale, w2, s2, b2, topk_weights, y, sorted_entries, block_experts, num_padded, topk_ids,
        num_entries, num_experts, hidden_size, inter, num_blocks, *topk_ids.stride(),
        a.stride(0), *(a_scale.stride() if fp8 else (0, 0)),
        *w2.stride(), *(w2_scale.stride() if w2_scale is not None else (0, 0, 0)),
        *(w2_bias.stride() if w2_bias is not None else (0, 0)), *topk_weights.stride(), y.stride(0),
        TOP_K=top_k, HAS_BIAS=w2_bias is not None, EVEN_K=shape.even_inter, W_FORMAT=w_format,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PRECISION=precision, UPCAST_DOT=upcast, SWAP_AB=swap_ab, SORT_HERE=shape.sorts_in_program,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )

    _sum_choices_kernel[shape.sum_grid](
        y, topk_ids, out, hidden_size, num_experts, y.stride(0), *topk_ids.stride(), *out.stride(),
        TOP_K=top_k, BLOCK_H=shape.block_h, num_warps=4, **pdl,
    )
