"""Triton scaled GEMM: out [M, N] = (a * a_scale) @ (w * w_scale)^T (+ bias), a [M, K], w [N, K].

One kernel for the three scale formats (``SCALES``): [BLOCK_M, BLOCK_N] output tiles, a loop over K
in BLOCK_K steps with ``tl.dot`` on the fp8 (fp32 accumulator) or int8 (int32 accumulator) tiles.

- per-tensor and per-token x per-channel: the scales are applied once, in the epilogue
  (``acc * a_scale[m] * w_scale[n]``);
- block (1 x 128 activation groups, 128 x 128 weight blocks): each K step covers part of one
  128-wide group (BLOCK_K divides 128), so its partial product is scaled by that group's
  ``a_scale[m, k // 128] * w_scale[n // 128, k // 128]`` before it joins the fp32 accumulator
  (which also bounds how long any low-precision tensor-core accumulation runs: one K step).

On sm90 (H100/H200) the fp8 tensor cores sum their products at reduced precision, and Triton lets a
chained fp8 ``tl.dot`` accumulate that way over the whole K by default (measured on an H200: 8e-3 off
the twin at K = 1024 for outputs of order 1; 1e-3 within one 128-wide step). ``MAX_IMPRECISE`` bounds
that run (``launch_config`` picks it per output dtype): 0 promotes every instruction's partial sum of 32
products into the fp32 accumulator (fp32 outputs), BLOCK_K once per K step (as DeepGEMM does; fp16
outputs), None never within the K loop (bf16 outputs: the speed of cuBLAS, within bf16's tolerance).

``SPLIT_K`` > 1 (few output tiles: small M and N) gives each program a K range of its tile; the
partial products, already scaled, go to an fp32 workspace [SPLIT_K, M, N] that a second kernel sums
into the output, so that enough programs stream the weight to fill every SM.

Programs walk the tiles in groups of GROUP_M row tiles per column tile, so neighbouring programs
share weight tiles in L2. Row offsets are int64 (M * K can pass 2**31).
The CPU interpreter runs fp8 and int8 ``tl.dot`` exactly (tests/ops/test_scaled_mm.py pins it
against float64), so no upcast is needed there.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from atom_core.ops.dispatch import triton_interpret
from atom_core.ops.reference.quant import INT8_DTYPE
from atom_core.ops.reference.scaled_mm import BLOCK
from atom_core.ops.triton.dependent_launch import launch_kwargs, wait_for_inputs
from atom_core.ops.triton.launch import LAUNCH_CACHE_SIZE, cdiv, next_power_of_2, num_sms

GEMV_LANES_PER_THREAD = 64  # the GEMV kernel's 2D accumulator up to this many fp32 values a thread
MID_M_TILES_PER_SM = 3  # 16 < M < 1024, few tiles: 64-row tiles while at most this many a multiprocessor
MID_M_MAX_K = 8192  # ... and K at most this (launch_config)
PER_TENSOR = tl.constexpr(0)  # values of SCALES (tl.constexpr: read inside the kernel)
PER_TOKEN = tl.constexpr(1)
BLOCKWISE = tl.constexpr(2)


@triton.jit
def _scaled_mm_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, K_PER_SPLIT,
    stride_am, stride_ak, stride_wn, stride_wk, stride_as_m, stride_as_k, stride_ws_n, stride_ws_k, stride_om,
    stride_osplit,
    SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, IS_INT8: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)  # this program's K range: [split * K_PER_SPLIT, + K_PER_SPLIT)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (k_start + offs_k[None, :]) * stride_ak
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_start + offs_k[:, None]) * stride_wk  # w^T [K, N]
    if IS_INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = offs_k < k_end - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALES == BLOCKWISE:
            group = k0 // SCALE_BLOCK
            a_scale = tl.load(a_scale_ptr + offs_m * stride_as_m + group * stride_as_k, mask=m_ok, other=0.0)
            w_scale = tl.load(w_scale_ptr + (offs_n // SCALE_BLOCK) * stride_ws_n + group * stride_ws_k,
                              mask=n_ok, other=0.0)
            acc += tl.dot(a, w, max_num_imprecise_acc=MAX_IMPRECISE) * a_scale[:, None] * w_scale[None, :]
        elif IS_INT8:
            acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        else:  # fp8: partial sums join the fp32 accumulator every MAX_IMPRECISE products (module docstring)
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=MAX_IMPRECISE)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    out = acc.to(tl.float32)
    if SCALES == PER_TENSOR:
        out = out * (tl.load(a_scale_ptr) * tl.load(w_scale_ptr))
    elif SCALES == PER_TOKEN:
        a_scale = tl.load(a_scale_ptr + offs_m * stride_as_m, mask=m_ok, other=0.0)
        w_scale = tl.load(w_scale_ptr + offs_n * stride_ws_n, mask=n_ok, other=0.0)
        out = out * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:  # (once: by the first K range)
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        out += tl.where(split == 0, bias, 0.0)[None, :]
    out_ptrs = out_ptr + split.to(tl.int64) * stride_osplit + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, N, K,
    stride_ak, stride_wn, stride_wk, stride_as_k, stride_ws_n, stride_ws_k,
    SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr,
    PDL: tl.constexpr,
):
    """One fp8 row a [1, K] times w [N, K]^T without tensor cores: program p owns output columns
    [p * BLOCK_N, + BLOCK_N) and streams their weight rows in [BLOCK_N, BLOCK_K] tiles, multiplying in fp32.
    LANES (tiles of at most 64 fp32 values a thread): the products join a [BLOCK_N, BLOCK_K] accumulator,
    summed over K once after the loop (no cross-thread reduction inside it); larger tiles, whose
    accumulator would cost the registers that keep loads in flight, sum each step's products over K
    (``tl.sum``). Block format: BLOCK_N divides 128, so the tile's rows share one weight block row and the
    scales of k, ``a_scale[k // 128] * w_scale[n // 128, k // 128]``, fold into the activation (one vector
    per K step) whatever BLOCK_K; the other formats scale in the epilogue."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    w_scale_row = w_scale_ptr + (pid * BLOCK_N // SCALE_BLOCK) * stride_ws_n
    lanes = tl.zeros((BLOCK_N, BLOCK_K if LANES else 1), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
            x = tl.load(a_ptr + k * stride_ak).to(tl.float32)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(a_ptr + k * stride_ak, mask=k < K, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        if SCALES == BLOCKWISE:
            group = k // SCALE_BLOCK  # (the scales are [., ceil(K / 128)]: every k < K has its group)
            if EVEN:  # (unmasked: 2.6% off a 32-layer bs-1 chain of the four GEMVs)
                x = x * tl.load(a_scale_ptr + group * stride_as_k) * tl.load(w_scale_row + group * stride_ws_k)
            else:
                x = x * tl.load(a_scale_ptr + group * stride_as_k, mask=k < K, other=0.0) \
                    * tl.load(w_scale_row + group * stride_ws_k, mask=k < K, other=0.0)
        if LANES:
            lanes += w.to(tl.float32) * x[None, :]
        else:
            lanes += tl.sum(w.to(tl.float32) * x[None, :], axis=1, keep_dims=True)
        w_ptrs += BLOCK_K * stride_wk
    acc = tl.sum(lanes, axis=1)
    if SCALES == PER_TENSOR:
        acc = acc * (tl.load(a_scale_ptr) * tl.load(w_scale_ptr))
    elif SCALES == PER_TOKEN:
        acc = acc * tl.load(a_scale_ptr) * tl.load(w_scale_ptr + offs_n * stride_ws_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _sum_splits_kernel(ws_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[i] = sum over s of ws[s, i] (fp32), in out's dtype."""
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        total += tl.load(ws_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One launch of ``_scaled_mm_kernel``: tile sizes, warps, pipeline stages, K ranges per tile, and how
    many fp8 products the tensor cores may sum before promotion (module docstring)."""
    block_m: int  # 1: the GEMV kernel (one fp8 row; no tensor cores, no split-K)
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    max_imprecise: int | None = 0  # <= block_k; None: Triton's default (no promotion within the K loop)


def _gemv_tile(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of the GEMV kernel on an H200, each weight timed out of L2 (copies of it read
    in turn, as a model's layers read theirs; docs/benchmarks.md, "FP8 GEMV tiles, and dependent launch kernel
    by kernel"), us per call and % of copy bandwidth on one machine (another ran some up to 16% slower),
    Llama-3-8B / Qwen3-30B-A3B:
    - N >= 16,384: 8 x 2048 on 4 warps (Llama gate_up 28.6, 97%; 4 x 2048 on 2 warps took 29.3, and 0.016 ms
      more a Llama-3-8B FP8 bs-1 step, in the same process);
    - N >= 5120: 4 x 2048 on 2 warps (Llama qkv 8.4, 71%; Qwen3 qkv 4.9, 50%);
    - N >= 4096, K <= 4096: 8 rows of the whole K in one step on 8 warps (Llama o_proj 6.2, 64%);
    - N >= 4096, longer K: 4 x 1024 on 2 warps (Llama down_proj 17.3, 80%);
    - else 4 x 2048 on 4 warps (Qwen3 o_proj 4.2, 48%)."""
    if n >= 16384:
        return 8, 2048, 4
    if n >= 5120:
        return 4, 2048, 2
    if n >= 4096:
        return (8, max(128, next_power_of_2(k)), 8) if k <= 4096 else (4, 1024, 2)
    return 4, 2048, 4


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def launch_config(m: int, n: int, k: int, out_dtype: torch.dtype, scales: int, num_sms: int,
                  interpret: bool, int8: bool = False) -> LaunchConfig:
    """The launch for an [m, k] x [n, k] GEMM into ``out_dtype`` in the ``scales`` format, on ``num_sms``
    multiprocessors (``int8``: int8 operands, else fp8). BLOCK_K divides the 128 of the block format,
    except for the GEMV kernel (BLOCK_M = 1), whose K steps span whole groups.

    GPU choices are the best rows of ``benchmarks/ops_scaled_mm_sweep.py`` on an H200 (docs/benchmarks.md,
    "FP8 GEMM launch sweep"):
    - M = 1, fp8, N >= 8 x the multiprocessors (bs 1 decode): the GEMV kernel (no split-K, no second
      launch), its tile from ``_gemv_tile``;
    - M <= 16 (decode): 16 x 64 tiles, and K split so that about two programs per multiprocessor stream
      the weight (at most 4 ranges: more only adds partials to sum);
    - larger M: 128 x 256 tiles where they give at least two tiles per multiprocessor, else 128 x 128
      (and smaller row tiles for M < 128); for 16 < M < 1024, where that leaves fewer tiles than
      multiprocessors (the first launch ran llama's qkv_proj at M = 128 on 48 programs, 0.3x of cuBLAS),
      64-wide tiles and then K ranges, as for M <= 16 (M = 128 with these launches: 0.68-1.71x of cuBLAS
      over the Llama-3-8B and Qwen3-30B-A3B projections, ``benchmarks.ops_scaled_mm``);
    - there, fp8 with per-token or per-tensor scales and K <= ``MID_M_MAX_K`` takes 4 warps and 4 stages, and
      64-row tiles while those number at most ``MID_M_TILES_PER_SM`` a multiprocessor (more of them re-read each weight
      stripe once per row tile: Qwen3-30B-A3B's qkv_proj at M = 384 took 14.5 us on 64-row tiles, 10.5 on 128).
      Over the Llama-3-8B and Qwen3-30B-A3B projections at M = 32-512 the 25 launches this changed took 0.88x
      the time of the launch before (128-row tiles on 8 warps and 3 stages) in total, 0.69-0.98x each
      (Qwen3-30B-A3B's qkv_proj at M = 128: 8.0 against 11.4 us; ``benchmarks/results/h200_ops_scaled_mm_mid_m.json``).
      Longer K keeps the launch before: more row tiles leave fewer K ranges, and each range is one chain of
      fast accumulation (Llama-3-8B's down_proj, K = 14,336, at M = 256 on one range: 0.025 off the twin,
      past the bf16 tolerance of 0.016; on the two ranges before, within it). So do the block format and int8;
    - promotion (module docstring): fp32 outputs every instruction, fp16 once per K step, bf16 never
      within the K loop (the tensor cores' own accumulation, as cuBLAS's and CUTLASS's "fast accumulation"
      fp8 kernels do: measured 4e-3 of max |out| at K = 4096 and 1e-2 at K = 14336, against 1.5e-4 when
      promoting once per K step, which costs ~40% of the speed). The block format's dot spans one
      128-wide group, so its promotion is per group whatever the setting.
    The interpreter gets few, larger programs (each program costs numpy overhead, not FLOPs)."""
    if interpret:
        return LaunchConfig(max(16, min(next_power_of_2(m), 64)), 64, 128, 4, 1)
    block_k = 128
    max_imprecise = 0 if out_dtype == torch.float32 else block_k if out_dtype == torch.float16 else None
    if m == 1 and not int8 and cdiv(n, 8) >= num_sms:
        return LaunchConfig(1, *_gemv_tile(n, k), 4)
    if m <= 16:
        tiles = cdiv(n, 64)
        split_k = min(4, cdiv(k, block_k), next_power_of_2(cdiv(2 * num_sms, tiles)))
        return LaunchConfig(16, 64, block_k, 4, 4, split_k=split_k, max_imprecise=max_imprecise)
    block_m = max(16, min(next_power_of_2(m), 128))
    wide = scales != BLOCKWISE.value and block_m == 128 and cdiv(m, 128) * cdiv(n, 256) >= 2 * num_sms
    block_n, split_k = 256 if wide else 128, 1
    warps, stages = 4 if block_m <= 64 else 8, 3
    if m < 1024 and cdiv(m, block_m) * cdiv(n, block_n) < num_sms:  # fewer tiles than multiprocessors:
        block_n = 64                                                  # narrower tiles, then K ranges
        if scales != BLOCKWISE.value and not int8 and k <= MID_M_MAX_K:
            warps, stages = 4, 4
            if cdiv(m, 64) * cdiv(n, 64) <= MID_M_TILES_PER_SM * num_sms:
                block_m = min(block_m, 64)
        tiles = cdiv(m, block_m) * cdiv(n, block_n)
        if tiles < num_sms:
            split_k = min(4, cdiv(k, block_k), next_power_of_2(cdiv(num_sms, tiles)))
    return LaunchConfig(block_m, block_n, block_k, warps, stages, split_k=split_k, max_imprecise=max_imprecise)


def _scaled_mm(scales, a, a_scale, w, w_scale, bias, out_dtype, config: LaunchConfig | None = None):
    (m, k), n = a.shape, w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum: the bias alone
        return out.copy_(bias.float().expand(m, n)) if bias is not None else out.zero_()
    if bias is not None:
        bias = bias.contiguous()  # the kernels read it at unit stride
    if config is None:
        interpret = triton_interpret()
        sms = 1 if interpret else num_sms(a.device.index or 0)
        config = launch_config(m, n, k, out_dtype, scales, sms, interpret, a.dtype == INT8_DTYPE)
    if config.block_m == 1:
        _gemv(scales, a, a_scale, w, w_scale, bias, out, config)
        return out
    if scales == PER_TOKEN.value:
        scale_strides = (a_scale.stride(0), 0, w_scale.stride(0), 0)
    elif scales == BLOCKWISE.value:
        scale_strides = (*a_scale.stride(), *w_scale.stride())
    else:
        scale_strides = (0, 0, 0, 0)
    # K ranges of whole 128-wide groups (the block format's scales), at most split_k of them
    k_per_split = cdiv(cdiv(k, BLOCK), config.split_k) * BLOCK
    splits = cdiv(k, k_per_split)
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=a.device)
    grid = (cdiv(m, config.block_m) * cdiv(n, config.block_n), splits)
    pdl = launch_kwargs(a, m)
    _scaled_mm_kernel[grid](
        a, w, a_scale, w_scale, bias if bias is not None else out, target, m, n, k, k_per_split,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), *scale_strides, target.stride(-2),
        target.stride(0) if splits > 1 else 0,
        SCALES=scales, HAS_BIAS=bias is not None, IS_INT8=a.dtype == INT8_DTYPE, SCALE_BLOCK=BLOCK,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=8,
        MAX_IMPRECISE=config.max_imprecise, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl,
    )
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(cdiv(m * n, block),)](target, out, m * n, SPLIT_K=splits, BLOCK=block, num_warps=4, **pdl)
    return out


def _gemv(scales, a, a_scale, w, w_scale, bias, out, config: LaunchConfig) -> None:
    """``_gemv_kernel`` into out [1, N] (fp8 a and w; block format: BLOCK_N divides 128)."""
    (_, k), n = a.shape, w.shape[0]
    if a.shape[0] != 1 or a.dtype == INT8_DTYPE or (scales == BLOCKWISE.value and BLOCK % config.block_n):
        raise ValueError(f"the GEMV launch (block_m = 1) serves one fp8 row, block_n dividing {BLOCK} for the block "
                         f"format; got a {tuple(a.shape)} {a.dtype}, block_n {config.block_n}")
    _gemv_kernel[(cdiv(n, config.block_n),)](
        a, w, a_scale, w_scale, bias if bias is not None else out, out, n, k,
        a.stride(1), w.stride(0), w.stride(1), a_scale.stride(-1) if scales == BLOCKWISE.value else 0,
        w_scale.stride(0) if scales != PER_TENSOR.value else 0, w_scale.stride(1) if scales == BLOCKWISE.value else 0,
        SCALES=scales, HAS_BIAS=bias is not None, SCALE_BLOCK=BLOCK, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN=n % config.block_n == 0 and k % config.block_k == 0,
        LANES=config.block_n * config.block_k <= GEMV_LANES_PER_THREAD * 32 * config.num_warps,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_kwargs(a, 1),
    )


def scaled_mm_per_tensor(a, a_scale, w, w_scale, bias, out_dtype):
    return _scaled_mm(PER_TENSOR.value, a, a_scale, w, w_scale, bias, out_dtype)


def scaled_mm_per_token(a, a_scale, w, w_scale, bias, out_dtype):
    return _scaled_mm(PER_TOKEN.value, a, a_scale, w, w_scale, bias, out_dtype)


def scaled_mm_block(a, a_scale, w, w_scale, bias, out_dtype):
    return _scaled_mm(BLOCKWISE.value, a, a_scale, w, w_scale, bias, out_dtype)
