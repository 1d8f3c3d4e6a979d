"""Host overhead of the public ops: microseconds of OUR Python per call, kernel launches stubbed out.

Every public op is called on small CPU tensors with the Triton backend chosen (its kernels run in
the CPU interpreter, ``TRITON_INTERPRET=1``), but each ``@triton.jit`` kernel's ``run`` is replaced
by a no-op, so neither the interpreter nor Triton's own launcher is timed: what remains is the
backend choice, the argument checks, the allocations of outputs and the wrapper's launch arithmetic.
The torch work some wrappers do before a launch (e.g. ``sample``'s filter cut-off, ``fused_experts``'
scratch buffers) is real host work and stays in.

Prints a table of µs per call with the debug checks on and off (``atom_core.ops.set_debug``; on a
tree without the switch the checks always run and both columns say so).

    python benchmarks/ops_overhead.py [--calls 2000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import timeit

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit runs: CPU tensors can take the triton backend

import torch  # noqa: E402

from atom_core import ops  # noqa: E402

_KERNEL_MODULES = ("norm", "activation", "rope", "kv_cache", "attention_unified", "attention_decode", "sampling",
                   "moe_align", "moe_routing", "fused_moe", "quant", "norm_quant", "scaled_mm")


def _noop(*args, **kwargs):
    return None


def stub_kernel_launches() -> int:
    """Replace ``run`` of every Triton kernel in atom_core.ops.triton by a no-op; returns how many.

    ``kernel[grid](...)`` calls ``kernel.run(...)`` (Triton's KernelInterface), so an instance
    attribute ``run`` makes the launch free while the wrapper around it runs as usual.
    """
    from triton.runtime.jit import KernelInterface

    import atom_core.ops.triton as package

    names = {m.name for m in pkgutil.iter_modules(package.__path__)} & set(_KERNEL_MODULES)
    stubbed = 0
    for name in sorted(names):
        module = importlib.import_module(f"atom_core.ops.triton.{name}")
        for value in vars(module).values():
            if isinstance(value, KernelInterface):
                value.run = _noop
                stubbed += 1
    return stubbed


def cases() -> dict[str, callable]:
    """op label -> a no-argument call of the op on small CPU tensors (decode-like sizes)."""
    g = torch.Generator().manual_seed(0)
    T, D, Hq, Hk, Dh, I, V, E, K = 4, 256, 8, 2, 64, 512, 1024, 16, 2

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    x, w, b, r = randn(T, D), randn(D), randn(D), randn(T, D)
    gate_up = randn(T, 2 * I)
    q, k = randn(T, Hq, Dh), randn(T, Hk, Dh)
    positions = torch.arange(T)
    cos_sin_cache, _ = ops.rope_cos_sin_cache(Dh, 128, 10000.0)
    num_blocks, block_size = 8, 16
    k_cache, v_cache = randn(num_blocks, block_size, Hk, Dh), randn(num_blocks, block_size, Hk, Dh)
    slot_mapping = torch.arange(T) * 3
    block_tables = torch.arange(T * 2, dtype=torch.int32).view(T, 2)
    cu_seqlens_q = torch.arange(T + 1, dtype=torch.int32)
    context_lens = torch.full((T,), 20, dtype=torch.int32)
    logits = randn(T, V)
    temperature, seeds, offsets = torch.ones(T), torch.arange(T), torch.zeros(T, dtype=torch.int64)
    drafts = torch.randint(0, V, (T, 3), generator=g)
    target_logits = randn(T * 4, V)
    router_logits = randn(T, E)
    topk_weights, topk_ids = ops.topk_softmax(router_logits, K, renormalize=True, backend="torch")
    w13, w2 = randn(E, 2 * 64, D), randn(E, D, 64)
    fp8 = torch.float8_e4m3fn
    xb = x.to(torch.bfloat16)
    xq, xq_group = ops.per_group_quant(xb, dtype=fp8, group_size=128, backend="torch")
    xq_token, xq_token_scale = ops.per_token_quant(xb, dtype=fp8, backend="torch")
    w_fp8 = randn(2 * D, D).to(fp8)
    w_block, w_channel = torch.ones(2 * D // 128, D // 128), torch.ones(2 * D, 1)
    return {
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-6),
        "rms_norm + residual": lambda: ops.rms_norm(x, w, 1e-6, residual=r),
        "layer_norm": lambda: ops.layer_norm(x, w, b, 1e-5),
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up),
        "gelu_and_mul": lambda: ops.gelu_and_mul(gate_up, approximate="tanh"),
        "swiglu_clamped": lambda: ops.swiglu_clamped(gate_up),
        "apply_rope_": lambda: ops.apply_rope_(q, k, positions, cos_sin_cache),
        "store_kv_": lambda: ops.store_kv_(k, k, k_cache, v_cache, slot_mapping),
        "paged_attention (decode)": lambda: ops.paged_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, 1, 32, scale=Dh ** -0.5),
        "sample (temperature only)": lambda: ops.sample(logits, temperature, None, None, None, seeds, offsets),
        "rejection_sample_greedy": lambda: ops.rejection_sample_greedy(drafts, target_logits),
        "topk_softmax": lambda: ops.topk_softmax(router_logits, K, renormalize=True),
        "grouped_topk": lambda: ops.grouped_topk(router_logits, K, num_expert_group=4, topk_group=2,
                                                 renormalize=True, scoring="sigmoid",
                                                 e_score_correction_bias=torch.zeros(E)),
        "gpt_oss_topk": lambda: ops.gpt_oss_topk(router_logits, K),
        "fused_experts": lambda: ops.fused_experts(x, w13, w2, topk_weights, topk_ids),
        "per_group_quant (fp8, 128)": lambda: ops.per_group_quant(xb, dtype=fp8, group_size=128),
        "per_token_quant (fp8)": lambda: ops.per_token_quant(xb, dtype=fp8),
        "rms_norm_quant (fp8, 128)": lambda: ops.rms_norm_quant(xb, w.to(torch.bfloat16), 1e-6, group_size=128),
        "silu_and_mul_quant (fp8)": lambda: ops.silu_and_mul_quant(gate_up.to(torch.bfloat16)),
        "scaled_mm_block": lambda: ops.scaled_mm_block(xq, xq_group, w_fp8, w_block, out_dtype=torch.bfloat16),
        "scaled_mm_per_token": lambda: ops.scaled_mm_per_token(xq_token, xq_token_scale, w_fp8, w_channel,
                                                               out_dtype=torch.bfloat16),
    }


def us_per_call(fn, calls: int, repeats: int) -> float:
    fn()  # first call: imports, choice, caches
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    stubbed = stub_kernel_launches()
    set_debug = getattr(ops, "set_debug", None)
    print(f"atom_core from {os.path.dirname(ops.__file__)}; {stubbed} Triton kernels stubbed; "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread; {args.calls} calls, best of {args.repeats}")
    print(f"{'op':28s} {'served by':>10s} {'debug on µs':>12s} {'debug off µs':>13s}")
    for label, fn in cases().items():
        with ops.trace_backends() as served:
            fn()
        backends = ",".join(sorted({backend for _, backend in served}))
        if set_debug is None:  # a tree without the switch: the checks always run
            on = off = us_per_call(fn, args.calls, args.repeats)
        else:
            set_debug(True)
            on = us_per_call(fn, args.calls, args.repeats)
            set_debug(False)
            off = us_per_call(fn, args.calls, args.repeats)
        print(f"{label:28s} {backends:>10s} {on:12.1f} {off:13.1f}")


if __name__ == "__main__":
    main()
