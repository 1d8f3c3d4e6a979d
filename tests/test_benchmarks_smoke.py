"""The op benchmark scripts run end to end at their ``--smoke`` sizes on a CPU (Triton in the
interpreter) and give complete rows: the scripts that produce docs/benchmarks.md do not rot."""

import math

import pytest

from benchmarks import ops_attention, ops_elementwise, ops_moe, ops_sampling


@pytest.mark.parametrize("script, columns", [
    (ops_elementwise, {"op", "tokens", "backend", "ms", "GB/s", "%copy", "eager_ms", "x_eager"}),
    (ops_sampling, {"op", "rows", "vocab", "backend", "ms", "GB/s", "%copy", "eager_ms", "x_eager"}),
    (ops_moe, {"op", "tokens", "backend", "ms", "x_twin"}),
    (ops_attention, {"case", "batch", "ms"}),
], ids=lambda v: getattr(v, "__name__", "").rpartition(".")[2])
def test_smoke_run_gives_complete_rows(script, columns):
    rows = script.run("cpu", smoke=True)
    assert rows
    for row in rows:
        assert columns <= set(row), f"missing {sorted(columns - set(row))} in {row}"
        assert row["ms"] > 0 and math.isfinite(row["ms"])
