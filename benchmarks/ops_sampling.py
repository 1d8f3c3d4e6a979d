"""Sampling at the Qwen3 vocabulary: ``sample`` (with and without top-k/top-p) and ``rejection_sample_greedy``.

For each case and batch size: median time of the op's kernel backend, bandwidth achieved counting the
logits read (the only large traffic: one fp32 row of V per sampled row), that bandwidth as a share of
a device-to-device copy measured in the same run, and the speedup over the plain-torch twin, eager
and under ``torch.compile`` (ours and both baselines timed the same way: on a GPU, inside CUDA-graph
replays where capture works; the row's ``timing`` column names any figure that fell back to eager
calls, and why). Cases:

* ``temperature``: T = 0.7 per row, no filters (``top_k = top_p = min_p = None``) — the fused pass alone;
* ``top_k+top_p``: T = 0.7, top_k = 50, top_p = 0.9 per row — adds the torch sort for the cut-off;
* ``greedy``: T = 0 (the argmax pass, no noise);
* ``rejection K=4``: greedy acceptance of 4 draft tokens, logits of B * 5 target rows.

    python -m benchmarks.ops_sampling [--device cuda] [--json out.json] [--smoke]

``--smoke`` runs tiny sizes (and no torch.compile) so the script can be checked on a CPU, where the
kernels run in Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

VOCAB = 151936  # Qwen3
BATCHES = [1, 64, 256]
DRAFT_TOKENS = 4
SMOKE = dict(vocab=1000, batches=[1, 4])


@dataclass
class Case:
    op: str
    rows: int
    nbytes: int  # logits bytes read by one call
    run: Callable[[], object]  # the op through atom_core's dispatch
    twin: Callable[[], object]  # the reference twin, same inputs


def _sample_case(name, rows, vocab, device, backend, *, temperature, top_k=None, top_p=None):
    from atom_core.ops.reference import sampling as reference
    from atom_core.ops.sampling import sample

    logits = torch.randn(rows, vocab, dtype=torch.float32, device=device)

    def per_row(value, dtype):
        return None if value is None else torch.full((rows,), value, dtype=dtype, device=device)

    args = (logits, per_row(temperature, torch.float32), per_row(top_k, torch.int32), per_row(top_p, torch.float32),
            None, torch.randint(0, 2**62, (rows,), device=device), torch.arange(rows, device=device))
    return Case(f"sample {name}", rows, logits.numel() * logits.element_size(),
                lambda: sample(*args, backend=backend), lambda: reference.sample(*args))


def _rejection_case(rows, vocab, device, backend):
    from atom_core.ops.reference import sampling as reference
    from atom_core.ops.sampling import rejection_sample_greedy

    target_logits = torch.randn(rows * (DRAFT_TOKENS + 1), vocab, dtype=torch.float32, device=device)
    draft = target_logits.argmax(-1).view(rows, DRAFT_TOKENS + 1)[:, :DRAFT_TOKENS].contiguous()
    draft[:, DRAFT_TOKENS // 2:] = 0  # accept about half, as speculative decoding typically does
    return Case(f"rejection K={DRAFT_TOKENS}", rows, target_logits.numel() * target_logits.element_size(),
                lambda: rejection_sample_greedy(draft, target_logits, backend=backend),
                lambda: reference.rejection_sample_greedy(draft, target_logits))


def _cases(device, smoke, backend):
    vocab = SMOKE["vocab"] if smoke else VOCAB
    for rows in SMOKE["batches"] if smoke else BATCHES:
        yield _sample_case("temperature", rows, vocab, device, backend, temperature=0.7)
        yield _sample_case("top_k+top_p", rows, vocab, device, backend, temperature=0.7, top_k=50, top_p=0.9)
        yield _sample_case("greedy", rows, vocab, device, backend, temperature=0.0)
        yield _rejection_case(rows, vocab, device, backend)


def run(device: str = "cuda", smoke: bool = False) -> list[dict]:
    """One row per (case, batch size). Times in ms; bandwidth in GB/s (1e9 bytes/s) of logits read."""
    from benchmarks.common import (bandwidth_row, bench_timed, copy_bandwidth_gbs, guarded, kernel_backend, ms_of,
                                   timing_column)

    backend = kernel_backend(device)
    iters = dict(warmup=1, iters=3) if smoke else dict(warmup=10, iters=100)

    def timer(fn):
        # Ours and the baselines alike: GPU time inside a CUDA graph where capture works.
        return bench_timed(fn, device=device, graph=True, **iters)

    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 20 if smoke else 2 << 30)
    rows = []
    for case in _cases(device, smoke, backend):
        ours = timer(case.run)
        eager = timer(case.twin)
        compiled = None if smoke else guarded(timer, lambda: torch.compile(case.twin))
        labels = {"op": case.op, "rows": case.rows, "vocab": SMOKE["vocab"] if smoke else VOCAB, "backend": backend}
        rows.append(bandwidth_row(labels, ms=ours.ms, nbytes=case.nbytes, copy_gbs=copy_gbs, eager_ms=eager.ms,
                                  compile_ms=ms_of(compiled),
                                  timing=timing_column({"ms": ours, "eager_ms": eager, "compile_ms": compiled})))
    return rows


COLUMNS = ["op", "rows", "vocab", "backend", "ms", "GB/s", "%copy", "x_eager", "x_compile", "timing"]


def main() -> None:
    from benchmarks.common import op_bench_args, report

    args = op_bench_args(__doc__.splitlines()[0])
    report(run(args.device, smoke=args.smoke), COLUMNS, args.json)


if __name__ == "__main__":
    main()
