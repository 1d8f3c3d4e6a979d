"""The selftest's cases for the communication ops (``atom_core.ops.comm``): the single-rank contract.

The selftest runs in one process, so these cases pass ``group=None`` (one rank): every backend must
return the input unchanged (``all_reduce`` and ``all_gather`` over one rank, an ``all_to_all`` whose one
split is all the rows), as the ``torch`` backend does without touching ``torch.distributed``. What a
collective computes over several ranks is not something one process can check: tests/ops/test_comm.py
runs the ops over gloo process groups, and a future GPU backend (one-shot all-reduce, AITER's custom
all-reduce) needs a multi-GPU check of its own before ``auto`` may choose it (see the ``comm`` docstring:
every rank of a group must choose the same backend).

Legend: T rows, D hidden.
"""

from __future__ import annotations

from atom_core import ops
from atom_core.ops.selftest_cases import BF16, Case, equal_outputs, grid_dtypes, seeded_randn


def comm_cases(grid: str, device) -> list[Case]:
    shapes = [(5, 24)] if grid == "quick" else [(1, 128), (7, 4096), (256, 4096)]
    cases = []
    for rows, hidden in shapes:
        for dtype in grid_dtypes(grid):
            tag = f"T={rows} D={hidden} {str(dtype).removeprefix('torch.')}"

            def x(dtype=dtype, rows=rows, hidden=hidden):
                """[T, D], rebuilt from the seed at each run (all_reduce may write into it)."""
                return seeded_randn(7, rows, hidden, dtype=dtype, device=device)

            def reduce_run(backend, x=x):
                return (ops.all_reduce(x(), None, backend=backend),)

            def gather_run(backend, x=x):
                return (ops.all_gather(x(), None, 0, backend=backend), ops.all_gather(x(), None, -1, backend=backend))

            def to_all_run(backend, x=x, rows=rows):
                return (ops.all_to_all(x(), None, [rows], [rows], backend=backend),
                        ops.all_to_all(x(), None, backend=backend))

            cases += [Case("all_reduce", f"one rank {tag}", reduce_run, equal_outputs),
                      Case("all_gather", f"one rank {tag}", gather_run, equal_outputs),
                      Case("all_to_all", f"one rank {tag}", to_all_run, equal_outputs)]
    def counts_run(backend):  # expert parallelism's row counts: int64, one per rank
        counts = seeded_randn(9, 1, dtype=BF16, device=device).abs().mul(100).long()
        return (ops.all_to_all(counts, None, backend=backend),)

    cases.append(Case("all_to_all", "one rank int64 [1] counts", counts_run, equal_outputs))
    if grid != "quick":  # 3-D, the middle dim
        def gather_3d(backend):
            return (ops.all_gather(seeded_randn(8, 3, 5, 16, dtype=BF16, device=device), None, 1, backend=backend),)

        cases.append(Case("all_gather", "one rank [3, 5, 16] dim 1", gather_3d, equal_outputs))
    return cases
