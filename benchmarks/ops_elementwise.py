"""Memory-bound ops at Llama-8B-like sizes: rms_norm (+ residual), silu_and_mul, per_token_quant (fp8, the
input of a per-token GEMM), apply_rope_, qk_norm_rope_, store_kv_, and rms_norm_quant / silu_and_mul_quant /
rope_store_kv_ beside their unfused pairs.

The fused quantizing ops run at Llama-3-8B's D = 4096 and I = 14336, fp8 in groups of 128, each next to
the same computation as two ops (``rms_norm`` + ``per_group_quant``, ``silu_and_mul`` + ``per_group_quant``);
both rows have the fused op's twin as their baseline, and the pair's ``ms`` columns compare the two.

For each op and token count: median time of the op's kernel backend, bandwidth achieved (bytes read +
written, counted by hand below), that bandwidth as a share of a device-to-device copy measured in the
same run, and the speedup over the plain-torch twin, eager and under ``torch.compile``.

Ours and both baselines are timed the same way: on a GPU, GPU time inside CUDA-graph replays (what
the engine pays); a figure whose capture fails falls back to eager calls, and the row's ``timing``
column says which figure and why (``benchmarks.common.timing_column``).

    python -m benchmarks.ops_elementwise [--device cuda] [--json out.json] [--smoke]

``--smoke`` runs tiny sizes (and no torch.compile) so the script can be checked on a CPU, where the
kernels run in Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

TOKENS = [1, 64, 4096, 16384]
HIDDEN = 4096
INTERMEDIATE = 14336  # Llama-3-8B's MLP
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
MAX_POSITION = 8192
BLOCK_SIZE = 16
SMOKE = dict(tokens=[1, 8], hidden=64, inter=96, q_heads=4, kv_heads=2, head_size=16)


@dataclass
class Case:
    op: str
    tokens: int
    shape: str
    nbytes: int  # bytes read + written by one call
    run: Callable[[], object]  # the op through atom_core's dispatch
    twin: Callable[[], object]  # the reference twin, same inputs


def _rms_norm_case(tokens, hidden, dtype, device, backend):
    from atom_core.ops import reference
    from atom_core.ops.norm import rms_norm

    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    elt = x.element_size()
    # read x, residual, weight; write out, residual_out
    nbytes = (4 * tokens * hidden + hidden) * elt
    return Case("rms_norm+residual", tokens, f"[{tokens}, {hidden}]", nbytes,
                lambda: rms_norm(x, weight, 1e-6, residual=residual, out=out, residual_out=residual_out,
                                 backend=backend),
                lambda: reference.rms_norm(x, weight, 1e-6, residual))


def _silu_and_mul_case(tokens, hidden, dtype, device, backend):
    from atom_core.ops.activation import silu_and_mul
    from atom_core.ops.reference import activation as reference

    x = torch.randn(tokens, 2 * hidden, dtype=dtype, device=device)
    out = torch.empty(tokens, hidden, dtype=dtype, device=device)
    nbytes = 3 * tokens * hidden * x.element_size()  # read gate and up, write out
    return Case("silu_and_mul", tokens, f"[{tokens}, {2 * hidden}] -> [{tokens}, {hidden}]", nbytes,
                lambda: silu_and_mul(x, out=out, backend=backend),
                lambda: reference.silu_and_mul(x))


def _per_token_quant_case(tokens, hidden, dtype, device, backend):
    from atom_core.ops.quant import per_token_quant
    from atom_core.ops.reference import quant as reference

    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    nbytes = tokens * hidden * (x.element_size() + 1) + 4 * tokens  # read x; write q and one fp32 scale a row
    return Case("per_token_quant", tokens, f"[{tokens}, {hidden}]", nbytes,
                lambda: per_token_quant(x, backend=backend), lambda: reference.per_token_quant(x))


def _quant_bytes(tokens, cols):
    """Bytes written by quantizing [tokens, cols] to fp8 in groups of 128: q (1 byte a value) and fp32 scales."""
    return tokens * cols + 4 * tokens * -(-cols // 128)


def _rms_norm_quant_cases(tokens, hidden, dtype, device, backend):
    """rms_norm (+ residual) quantized per 1 x 128 group: as two ops, then fused."""
    from atom_core.ops.norm import rms_norm
    from atom_core.ops.norm_quant import rms_norm_quant
    from atom_core.ops.quant import per_group_quant
    from atom_core.ops.reference import norm_quant as reference

    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    elt = x.element_size()
    # read x, residual, weight; write residual_out, q and the scales (two ops: out also written and read back)
    nbytes = (3 * tokens * hidden + hidden) * elt + _quant_bytes(tokens, hidden)

    def two_ops():
        rms_norm(x, weight, 1e-6, residual=residual, out=out, residual_out=residual_out, backend=backend)
        return per_group_quant(out, backend=backend)

    shape = f"[{tokens}, {hidden}] -> fp8 / 128"

    def twin():
        return reference.rms_norm_quant(x, weight, 1e-6, residual)

    yield Case("rms_norm+per_group_quant", tokens, shape, nbytes + 2 * tokens * hidden * elt, two_ops, twin)
    yield Case("rms_norm_quant", tokens, shape, nbytes,
               lambda: rms_norm_quant(x, weight, 1e-6, residual=residual, backend=backend), twin)


def _silu_and_mul_quant_cases(tokens, inter, dtype, device, backend):
    """silu_and_mul quantized per 1 x 128 group: as two ops, then fused."""
    from atom_core.ops.activation import silu_and_mul
    from atom_core.ops.norm_quant import silu_and_mul_quant
    from atom_core.ops.quant import per_group_quant
    from atom_core.ops.reference import norm_quant as reference

    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)
    out = torch.empty(tokens, inter, dtype=dtype, device=device)
    elt = x.element_size()
    # read gate and up; write q and the scales (two ops: out also written and read back)
    nbytes = 2 * tokens * inter * elt + _quant_bytes(tokens, inter)
    shape = f"[{tokens}, {2 * inter}] -> fp8 [{tokens}, {inter}] / 128"

    def twin():
        return reference.silu_and_mul_quant(x)

    yield Case("silu_and_mul+per_group_quant", tokens, shape, nbytes + 2 * tokens * inter * elt,
               lambda: per_group_quant(silu_and_mul(x, out=out, backend=backend), backend=backend), twin)
    yield Case("silu_and_mul_quant", tokens, shape, nbytes, lambda: silu_and_mul_quant(x, backend=backend), twin)


def _fused_qkv(tokens, q_heads, kv_heads, head_size, dtype, device):
    """q, k, v as head views into one [T, (Hq + 2 Hk) D] buffer, as a model's fused projection gives them."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_size, dtype=dtype, device=device)
    q = qkv[:, : q_heads * head_size].view(tokens, q_heads, head_size)
    k = qkv[:, q_heads * head_size: (q_heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    v = qkv[:, (q_heads + kv_heads) * head_size:].view(tokens, kv_heads, head_size)
    return q, k, v


def _rope_case(tokens, q_heads, kv_heads, head_size, dtype, device, backend):
    from atom_core.ops.reference import rope as reference
    from atom_core.ops.rope import apply_rope_, rope_cos_sin_cache

    q, k, _ = _fused_qkv(tokens, q_heads, kv_heads, head_size, dtype, device)
    cache, _ = rope_cos_sin_cache(head_size, MAX_POSITION, 500000.0, device=device)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=device)
    elt = q.element_size()
    # read + write every rotated q/k element; read positions (int64) and one fp32 cos/sin row per token
    nbytes = 2 * tokens * (q_heads + kv_heads) * head_size * elt + tokens * 8 + tokens * head_size * 4
    return Case("apply_rope_", tokens, f"q [{tokens}, {q_heads}, {head_size}] k [{tokens}, {kv_heads}, {head_size}]",
                nbytes,
                lambda: apply_rope_(q, k, positions, cache, backend=backend),
                lambda: reference.apply_rope_(q, k, positions, cache))


def _qk_norm_rope_case(tokens, q_heads, kv_heads, head_size, dtype, device, backend):
    from atom_core.ops.qk_norm_rope import qk_norm_rope_
    from atom_core.ops.reference import qk_norm_rope as reference
    from atom_core.ops.rope import rope_cos_sin_cache

    q, k, _ = _fused_qkv(tokens, q_heads, kv_heads, head_size, dtype, device)
    q_weight, k_weight = (torch.rand(head_size, dtype=dtype, device=device) for _ in range(2))
    cache, _ = rope_cos_sin_cache(head_size, MAX_POSITION, 500000.0, device=device)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=device)
    elt = q.element_size()
    # as apply_rope_ (every q/k element read and written once), plus the two weights
    nbytes = 2 * tokens * (q_heads + kv_heads) * head_size * elt + tokens * 8 + tokens * head_size * 4 \
        + 2 * head_size * elt
    return Case("qk_norm_rope_", tokens,
                f"q [{tokens}, {q_heads}, {head_size}] k [{tokens}, {kv_heads}, {head_size}]", nbytes,
                lambda: qk_norm_rope_(q, k, q_weight, k_weight, positions, cache, eps=1e-6, backend=backend),
                lambda: reference.qk_norm_rope_(q, k, q_weight, k_weight, positions, cache, eps=1e-6))


def _store_kv_case(tokens, q_heads, kv_heads, head_size, dtype, device, backend):
    from atom_core.ops.kv_cache import store_kv_
    from atom_core.ops.reference import kv_cache as reference

    _, k, v = _fused_qkv(tokens, q_heads, kv_heads, head_size, dtype, device)
    num_blocks = 2 * (tokens // BLOCK_SIZE + 1)
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, head_size, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    # Tokens fill whole blocks in order; the blocks themselves are scattered over the pool.
    blocks = torch.randperm(num_blocks, device=device)[: tokens // BLOCK_SIZE + 1]
    t = torch.arange(tokens, device=device)
    slot_mapping = blocks[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    # read k and v, write them to the caches; read slot_mapping
    nbytes = 4 * tokens * kv_heads * head_size * k.element_size() + tokens * 8
    return Case("store_kv_", tokens, f"k, v [{tokens}, {kv_heads}, {head_size}] -> NHD pages of {BLOCK_SIZE}",
                nbytes,
                lambda: store_kv_(k, v, k_cache, v_cache, slot_mapping, backend=backend),
                lambda: reference.store_kv_(k, v, k_cache, v_cache, slot_mapping))


def _rope_store_kv_cases(tokens, q_heads, kv_heads, head_size, dtype, device, backend):
    """RoPE then the KV store: as two ops (``apply_rope_``, ``store_kv_``), then as one (``rope_store_kv_``)."""
    from atom_core.ops.kv_cache import store_kv_
    from atom_core.ops.reference import rope_kv as reference
    from atom_core.ops.rope import apply_rope_, rope_cos_sin_cache
    from atom_core.ops.rope_kv import rope_store_kv_

    q, k, v = _fused_qkv(tokens, q_heads, kv_heads, head_size, dtype, device)
    cache, _ = rope_cos_sin_cache(head_size, MAX_POSITION, 500000.0, device=device)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=device)
    k_cache = torch.zeros(tokens + BLOCK_SIZE, 1, kv_heads, head_size, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.randperm(tokens + BLOCK_SIZE, device=device)[:tokens]  # one-slot blocks, scattered
    elt = q.element_size()
    # the RoPE bytes (q and k read and written, positions, cos/sin rows), then k and v read and written to the pool
    nbytes = (2 * tokens * (q_heads + kv_heads) * head_size * elt + tokens * 8 + tokens * head_size * 4
              + 4 * tokens * kv_heads * head_size * elt + tokens * 8)
    shape = f"q [{tokens}, {q_heads}, {head_size}] k, v [{tokens}, {kv_heads}, {head_size}] -> pool"

    def two_ops():
        apply_rope_(q, k, positions, cache, backend=backend)
        store_kv_(k, v, k_cache, v_cache, slot_mapping, backend=backend)

    def twin():
        reference.rope_store_kv_(q, k, v, positions, cache, k_cache, v_cache, slot_mapping)

    yield Case("apply_rope_+store_kv_", tokens, shape, nbytes, two_ops, twin)
    yield Case("rope_store_kv_", tokens, shape, nbytes,
               lambda: rope_store_kv_(q, k, v, positions, cache, k_cache, v_cache, slot_mapping, backend=backend),
               twin)


def _cases(device, smoke, backend, dtype):
    sizes = SMOKE if smoke else dict(tokens=TOKENS, hidden=HIDDEN, inter=INTERMEDIATE, q_heads=NUM_Q_HEADS,
                                     kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE)
    for tokens in sizes["tokens"]:
        yield _rms_norm_case(tokens, sizes["hidden"], dtype, device, backend)
        yield _silu_and_mul_case(tokens, sizes["hidden"], dtype, device, backend)
        yield _per_token_quant_case(tokens, sizes["hidden"], dtype, device, backend)
        yield from _rms_norm_quant_cases(tokens, sizes["hidden"], dtype, device, backend)
        yield from _silu_and_mul_quant_cases(tokens, sizes["inter"], dtype, device, backend)
        yield _rope_case(tokens, sizes["q_heads"], sizes["kv_heads"], sizes["head_size"], dtype, device, backend)
        yield _qk_norm_rope_case(tokens, sizes["q_heads"], sizes["kv_heads"], sizes["head_size"], dtype, device,
                                 backend)
        yield _store_kv_case(tokens, sizes["q_heads"], sizes["kv_heads"], sizes["head_size"], dtype, device, backend)
        yield from _rope_store_kv_cases(tokens, sizes["q_heads"], sizes["kv_heads"], sizes["head_size"], dtype,
                                        device, backend)


def run(device: str = "cuda", smoke: bool = False) -> list[dict]:
    """One row per (op, token count). Times in ms; bandwidth in GB/s (1e9 bytes/s)."""
    from benchmarks.common import (bandwidth_row, bench_timed, copy_bandwidth_gbs, guarded, kernel_backend, ms_of,
                                   timing_column)

    backend = kernel_backend(device)
    dtype = torch.bfloat16
    iters = dict(warmup=1, iters=3) if smoke else dict(warmup=10, iters=100)

    def timer(fn):
        # Ours and the baselines alike: GPU time inside a CUDA graph where capture works.
        return bench_timed(fn, device=device, graph=True, **iters)

    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 20 if smoke else 2 << 30)
    rows = []
    for case in _cases(device, smoke, backend, dtype):
        ours = timer(case.run)
        eager = timer(case.twin)
        compiled = None if smoke else guarded(timer, lambda: torch.compile(case.twin))
        rows.append(bandwidth_row({"op": case.op, "tokens": case.tokens, "shape": case.shape, "backend": backend},
                                  ms=ours.ms, nbytes=case.nbytes, copy_gbs=copy_gbs, eager_ms=eager.ms,
                                  compile_ms=ms_of(compiled),
                                  timing=timing_column({"ms": ours, "eager_ms": eager, "compile_ms": compiled})))
    return rows


COLUMNS = ["op", "tokens", "backend", "ms", "GB/s", "%copy", "x_eager", "x_compile", "shape", "timing"]


def main() -> None:
    from benchmarks.common import op_bench_args, report

    args = op_bench_args(__doc__.splitlines()[0])
    report(run(args.device, smoke=args.smoke), COLUMNS, args.json)


if __name__ == "__main__":
    main()
