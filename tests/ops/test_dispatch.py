import pytest
import torch

from atom_core import ops
from atom_core.ops import dispatch
from atom_core.ops.dispatch import BackendUnavailable, Op


def make_op(serving: dict):
    """An op whose backends return their own name; ``serving[b]`` is None (serves) or a refusal reason."""
    op = Op("probe")
    for backend, reason in serving.items():
        op.register(backend, (lambda b: lambda x: b)(backend), (lambda r: lambda x: r)(reason))
    return op


@pytest.fixture
def all_available(monkeypatch):
    monkeypatch.setattr(dispatch, "backend_available", lambda name: True)
    monkeypatch.setattr(dispatch, "on_device_for", lambda backend, *t: None)


def test_auto_order_and_fall_through(all_available):
    x = torch.zeros(1)
    assert make_op({"torch": None, "triton": None, "aiter": None})(x) == "aiter"
    assert make_op({"torch": None, "triton": None, "aiter": "no fp32"})(x) == "triton"
    assert make_op({"torch": None, "triton": "odd head size", "aiter": "no fp32"})(x) == "torch"


def test_explicit_backend_is_strict_and_says_why(all_available):
    op = make_op({"torch": None, "triton": "head size 96 unsupported"})
    with pytest.raises(BackendUnavailable, match="head size 96 unsupported"):
        op(torch.zeros(1), backend="triton")
    with pytest.raises(BackendUnavailable, match="no aiter implementation"):
        op(torch.zeros(1), backend="aiter")
    assert op(torch.zeros(1), backend="torch") == "torch"


def test_context_beats_env_and_both_fall_through(all_available, monkeypatch):
    op = make_op({"torch": None, "triton": None, "aiter": "refuses"})
    x = torch.zeros(1)
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert op(x) == "torch"
    with ops.use_backend("triton"):
        assert op(x) == "triton"
        assert op(x, backend="torch") == "torch"  # argument beats context
    with ops.use_backend("aiter"):
        assert op(x) == "triton"  # preferred one refuses: auto order continues
    monkeypatch.delenv(dispatch.ENV_VAR)
    assert op(x) == "triton"


def test_trace_records_each_call(all_available):
    op = make_op({"torch": None, "triton": None})
    with ops.trace_backends() as calls:
        op(torch.zeros(1))
        op(torch.zeros(1), backend="torch")
    assert calls == [("probe", "triton"), ("probe", "torch")]


def test_unknown_backend_names_rejected():
    with pytest.raises(ValueError, match="unknown backend"):
        with ops.use_backend("cuda"):
            pass


def test_torch_is_always_available_and_aiter_not_off_rocm():
    assert "torch" in ops.available_backends()
    if torch.version.hip is None:
        assert not ops.backend_available("aiter")


def test_lazy_kernel_imports():
    # Registration names modules; nothing of triton/aiter is imported by `import atom_core.ops`.
    import subprocess
    import sys

    code = "import sys, atom_core.ops; print(any(m == 'triton' or m.startswith('triton.') or m == 'aiter' for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_compiled_graph_holds_the_custom_ops_and_matches_eager():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    def block(x, w, r):
        out, res = ops.rms_norm(x, w, 1e-6, residual=r)
        return ops.silu_and_mul(torch.cat([out, res], dim=-1))

    x, w, r = torch.randn(5, 16), torch.randn(16), torch.randn(5, 16)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=record, fullgraph=True)
    torch.testing.assert_close(compiled(x, w, r), block(x, w, r))
    assert "atom_core.rms_norm" in graphs[0] and "atom_core.silu_and_mul" in graphs[0]


def test_eager_calls_skip_the_custom_op_wrapper(monkeypatch):
    # Eagerly the registered function runs directly; only tracing goes through torch.ops.
    monkeypatch.setattr(torch.ops.atom_core, "rms_norm", None, raising=False)
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(ops.rms_norm(x, w), ops.reference.rms_norm(x, w, 1e-6))
