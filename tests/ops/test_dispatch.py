import os

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


def test_auto_order_and_fall_through(all_available, selftest_record):
    x = torch.zeros(1)
    selftest_record({"probe": {"aiter": {"passed": True, "cases": 1, "refused": 0, "failures": []}}})
    assert make_op({"torch": None, "triton": None, "aiter": None})(x) == "aiter"
    assert make_op({"torch": None, "triton": None, "aiter": "no fp32"})(x) == "triton"
    assert make_op({"torch": None, "triton": "odd head size", "aiter": "no fp32"})(x) == "torch"


def test_auto_skips_aiter_without_a_passing_selftest_record(all_available):
    assert make_op({"torch": None, "triton": None, "aiter": None})(torch.zeros(1)) == "triton"
    assert make_op({"torch": None, "aiter": None})(torch.zeros(1)) == "torch"


def test_explicit_backend_is_strict_and_says_why(all_available):
    op = make_op({"torch": None, "triton": "head size 96 unsupported"})
    with pytest.raises(BackendUnavailable, match="head size 96 unsupported"):
        op(torch.zeros(1), backend="triton")
    with pytest.raises(BackendUnavailable, match="no aiter implementation"):
        op(torch.zeros(1), backend="aiter")
    assert op(torch.zeros(1), backend="torch") == "torch"


@pytest.fixture
def restore_default_backend():
    saved = ops.default_backend()
    yield
    dispatch._default_backend = saved  # may be a name set_default_backend would refuse (a bad env value)


def test_context_beats_default_and_both_fall_through(all_available, restore_default_backend):
    op = make_op({"torch": None, "triton": None, "aiter": "refuses"})
    x = torch.zeros(1)
    ops.set_default_backend("torch")
    assert op(x) == "torch"
    with ops.use_backend("triton"):
        assert op(x) == "triton"
        assert op(x, backend="torch") == "torch"  # argument beats context
    with ops.use_backend("aiter"):
        assert op(x) == "triton"  # preferred one refuses: auto order continues
    ops.set_default_backend(None)
    assert op(x) == "triton"


def test_set_default_backend_rejects_unknown_names(restore_default_backend):
    with pytest.raises(ValueError, match="unknown backend"):
        ops.set_default_backend("cuda")


def test_env_var_is_read_once_at_import_and_set_default_backend_replaces_it():
    import subprocess
    import sys

    code = (
        "import os, torch, atom_core.ops as ops\n"
        "first = ops.default_backend()\n"
        "os.environ['ATOM_CORE_BACKEND'] = 'triton'\n"  # too late: read once at import
        "x = torch.randn(2, 8)\n"
        "with ops.trace_backends() as calls:\n"
        "    ops.rms_norm(x, torch.ones(8))\n"
        "ops.set_default_backend(None)\n"
        "print(first, ops.default_backend(), calls[0][1])\n"
    )
    env = {**os.environ, dispatch.ENV_VAR: "torch"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["torch", "None", "torch"]


def test_unknown_env_backend_fails_the_import_naming_the_variable():
    import subprocess
    import sys

    env = {**os.environ, dispatch.ENV_VAR: "cuda"}
    out = subprocess.run([sys.executable, "-c", "import atom_core.ops"], capture_output=True, text=True, env=env)
    assert out.returncode != 0
    assert "ATOM_CORE_BACKEND='cuda' is not a backend" in out.stderr


def test_rules_run_once_per_signature_and_preference(all_available):
    asked = []
    op = Op("probe")
    op.register("torch", lambda x: "torch")
    op.register("triton", lambda x: "triton", lambda x: asked.append(x.dtype) or None, key=lambda x: x.dtype)
    for _ in range(3):
        assert op(torch.zeros(2)) == "triton"
        assert op(torch.zeros(5)) == "triton"  # other shape, same signature
    assert asked == [torch.float32]
    op(torch.zeros(2, dtype=torch.float16))
    with ops.use_backend("aiter"):  # another preference is another entry (here it falls through to triton)
        op(torch.zeros(2))
    assert asked == [torch.float32, torch.float16, torch.float32]


def _prefer_scaled_mm_from_4_rows():
    op = make_op({"torch": None, "triton": None, "scaled_mm": None})
    op.prefer("scaled_mm", lambda x: x.shape[0] >= 4)
    return op


def test_a_preference_rule_puts_its_backend_first_only_where_the_rule_holds(all_available):
    op = _prefer_scaled_mm_from_4_rows()
    assert [op(torch.zeros(m)) for m in (1, 3, 4, 9, 3)] == ["triton", "triton", "scaled_mm", "scaled_mm", "triton"]
    assert [op.choose_uncached(torch.zeros(m)) for m in (3, 4)] == ["triton", "scaled_mm"]


def test_a_preference_rule_yields_to_named_backends_refusals_and_a_failed_record(all_available, selftest_record,
                                                                              restore_default_backend):
    op = _prefer_scaled_mm_from_4_rows()
    big = torch.zeros(8)
    assert op(big, backend="triton") == "triton"  # backend= is strict, the rule does not apply
    with ops.use_backend("torch"):
        assert op(big) == "torch"  # a named preference comes before the rule's backend
    ops.set_default_backend("triton")
    assert op(big) == "triton"
    ops.set_default_backend(None)
    refusing = make_op({"torch": None, "triton": None, "scaled_mm": "needs K a multiple of 128"})
    refusing.prefer("scaled_mm", lambda x: True)
    assert refusing(big) == "triton"  # the rule's backend cannot serve: the auto order goes on
    selftest_record({"probe": {"scaled_mm": {"passed": False, "cases": 1, "refused": 0, "failures": ["x"]}}})
    assert op(big) == "triton"  # a record that says it failed keeps auto off it, rule or not


def test_a_preference_rule_is_part_of_the_signature_and_runs_once_per_value(all_available):
    asked = []
    op = make_op({"torch": None, "triton": None, "scaled_mm": None})
    op.prefer("scaled_mm", lambda x: asked.append(x.shape[0]) or x.shape[0] >= 4)
    assert [op(torch.zeros(m)) for m in (2, 8)] == ["triton", "scaled_mm"]
    asked.clear()
    for _ in range(3):  # known signatures: the rule runs once a call, as the key, and the choice is cached
        assert [op(torch.zeros(m)) for m in (2, 8)] == ["triton", "scaled_mm"]
    assert asked == [2, 8] * 3


def test_cached_strict_refusal_raises_with_the_reason_every_time(all_available):
    op = make_op({"torch": None, "triton": "head size 96 unsupported"})
    for _ in range(2):
        with pytest.raises(BackendUnavailable, match="head size 96 unsupported"):
            op(torch.zeros(1), backend="triton")


def test_trace_records_each_call_including_cached_choices(all_available):
    op = make_op({"torch": None, "triton": None})
    with ops.trace_backends() as calls:
        op(torch.zeros(1))
        op(torch.zeros(1), backend="torch")
        op(torch.zeros(1))
        with ops.use_backend("torch"):
            op(torch.zeros(1))
    assert calls == [("probe", "triton"), ("probe", "torch"), ("probe", "triton"), ("probe", "torch")]


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
