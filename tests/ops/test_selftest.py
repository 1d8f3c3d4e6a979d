"""The selftest (python -m atom_core.ops.selftest) and the record it writes, and auto's choice following
that record: AITER (the stand-in module here) only with a passing record for the op on this device and
these versions, Triton unless the record says it failed, a named backend regardless."""

import json
import os

import pytest
import torch

from atom_core import ops
from atom_core.ops import dispatch, selftest, verified
from atom_core.ops.reference import norm as reference_norm
from tests.ops import fake_aiter
from atom_core.ops.selftest_cases import all_cases
from tests.ops.conftest import DEVICE, needs_triton
from tests.ops.test_dispatch_cache import OPS as REAL_OPS  # every Op defined by a module of atom_core.ops

PASSED = {"passed": True, "cases": 2, "refused": 0, "failures": []}
FAILED = {"passed": False, "cases": 2, "refused": 0, "failures": ["T=7 D=96: mismatch"]}


@needs_triton
def test_quick_selftest_passes_torch_and_triton_on_every_op_and_writes_the_record_keyed_by_device_and_versions(
        selftest_record, capsys):
    path = verified.record_path()
    assert selftest.main(["--grid", "quick", "--backends", "torch", "triton"]) == 0
    record = json.loads(path.read_text())
    assert record["format"] == verified.FORMAT
    (entry,) = record["entries"].values()
    triton_version = verified.library_versions()["triton"]
    here = torch.device(DEVICE)  # the selftest's default: the GPU where there is one
    assert entry["key"] == {"device": verified.device_name(here), "torch": torch.__version__, "triton": triton_version,
                            "aiter": None}
    assert set(entry["results"]) == set(REAL_OPS)
    for op_name, by_backend in entry["results"].items():  # every backend the op has, of the two asked for
        assert set(by_backend) == {"torch", "triton"} & set(REAL_OPS[op_name].backends), op_name
        for result in by_backend.values():
            assert result["passed"] is True and result["cases"] > 0 and result["failures"] == [], op_name
    assert verified.verdict("paged_attention", "triton", here) is True
    assert f"record written to {path}" in capsys.readouterr().out


@pytest.mark.parametrize("grid", ["quick", "full"])
def test_the_grid_has_cases_for_every_op(grid):
    assert set(all_cases(grid, torch.device("cpu"))) == set(REAL_OPS)


@pytest.fixture
def broken_rms_norm_kernel():
    """rms_norm's triton backend writes zeros (a stand-in for a kernel that is wrong on this machine)."""
    impl = dispatch.OPS["rms_norm"]._impls["triton"]
    saved = impl.target
    impl.target = lambda x, weight, eps, residual, gemma, out, residual_out: out.zero_()
    dispatch.clear_choices()
    yield
    impl.target = saved
    dispatch.clear_choices()


@needs_triton
def test_a_wrong_backend_fails_the_selftest_and_the_record_names_the_case(selftest_record, broken_rms_norm_kernel):
    results = selftest.run_selftest(grid="quick", backends=["triton"], ops=["rms_norm"])
    result = results["rms_norm"]["triton"]
    assert result["passed"] is False and result["cases"] == 2 and len(result["failures"]) == 2
    assert result["failures"][0].startswith("T=7 D=96 torch.float32: output 0")
    selftest_record(results, device=DEVICE)
    assert verified.verdict("rms_norm", "triton", torch.device(DEVICE)) is False


def test_an_unreadable_record_counts_as_empty(tmp_path):
    path = tmp_path / "selftest.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        assert verified.read_record(path) == {"format": verified.FORMAT, "entries": {}}


def test_record_path_env_var_then_xdg_cache_home_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv(verified.PATH_ENV_VAR, str(tmp_path / "x.json"))
    assert verified.record_path() == tmp_path / "x.json"
    monkeypatch.delenv(verified.PATH_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert verified.record_path() == tmp_path / "atom_core" / "selftest.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert verified.record_path() == tmp_path / "home" / ".cache" / "atom_core" / "selftest.json"


def test_write_results_merges_into_the_entry_and_keeps_other_devices(selftest_record):
    selftest_record({"rms_norm": {"triton": PASSED}})
    selftest_record({"rms_norm": {"aiter": FAILED}, "sample": {"triton": PASSED}})
    path = selftest_record({"rms_norm": {"aiter": PASSED}}, device="meta")
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 2
    cpu = entries[verified.key_string(verified.record_key(torch.device("cpu")))]
    assert cpu["results"] == {"rms_norm": {"triton": PASSED, "aiter": FAILED}, "sample": {"triton": PASSED}}


# --- auto follows the record, with the stand-in aiter module ------------------------------------------------

def _rmsnorm2d_fwd(input, weight, epsilon, use_model_sensitive_rmsnorm):
    return reference_norm.rms_norm(input, weight, epsilon)


def _rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon, use_model_sensitive_rmsnorm):
    o, r = reference_norm.rms_norm(input, weight, epsilon, residual_in)
    out.copy_(o)
    residual_out.copy_(r)


@pytest.fixture
def aiter_stand_in(monkeypatch):
    """The stand-in aiter (rmsnorm behaves as AITER documents it), available and taking tensors on any device;
    triton counts as available too (its kernels run only if chosen: on the GPU, or on the CPU under the
    interpreter). The calls below put their tensors on DEVICE, where the selftest runs and its record is kept."""
    fake = fake_aiter.install(monkeypatch, {"rmsnorm2d_fwd": _rmsnorm2d_fwd,
                                            "rmsnorm2d_fwd_with_add": _rmsnorm2d_fwd_with_add})
    monkeypatch.setattr(dispatch, "backend_available", lambda name: True)
    monkeypatch.setattr(dispatch, "on_device_for", lambda backend, *tensors: None)
    targets = {name: {b: impl.target for b, impl in op._impls.items()} for name, op in dispatch.OPS.items()}
    dispatch.clear_choices()
    yield fake
    for name, op in dispatch.OPS.items():  # adapters loaded against the stand-in must not outlive it
        for backend, target in targets[name].items():
            op._impls[backend].target = target
    dispatch.clear_choices()


def served_by(call) -> str:
    with ops.trace_backends() as calls:
        call()
    (served,) = {backend for _, backend in calls}
    return served


def rms_norm_call():
    return ops.rms_norm(torch.randn(3, 8, device=DEVICE), torch.ones(8, device=DEVICE))


def test_auto_does_not_choose_aiter_without_a_record(aiter_stand_in, selftest_record):
    assert served_by(rms_norm_call) == "triton"
    assert aiter_stand_in.calls == []


def test_auto_chooses_aiter_for_an_op_once_the_selftest_in_this_process_passed_it(aiter_stand_in, selftest_record):
    assert served_by(rms_norm_call) == "triton"  # cached: the record must invalidate this choice
    results = selftest.run_selftest(grid="quick", backends=["aiter"], ops=["rms_norm"])
    assert results["rms_norm"]["aiter"]["passed"] is True
    selftest_record(results, device=DEVICE)
    assert served_by(rms_norm_call) == "aiter"
    assert served_by(lambda: ops.silu_and_mul(torch.randn(3, 8, device=DEVICE))) != "aiter"  # no record for that op


def test_auto_does_not_choose_aiter_where_the_selftest_failed_it(aiter_stand_in, selftest_record, monkeypatch):
    monkeypatch.setattr(aiter_stand_in, "rmsnorm2d_fwd", lambda *a, **kw: torch.zeros(3, 8, device=DEVICE))
    results = selftest.run_selftest(grid="quick", backends=["aiter"], ops=["rms_norm"])
    assert results["rms_norm"]["aiter"]["passed"] is False
    selftest_record(results, device=DEVICE)
    assert served_by(rms_norm_call) == "triton"


def test_a_passing_record_for_another_device_or_versions_does_not_count(aiter_stand_in, selftest_record, monkeypatch):
    selftest_record({"rms_norm": {"aiter": PASSED}}, device="meta")
    assert served_by(rms_norm_call) == "triton"
    selftest_record({"rms_norm": {"aiter": PASSED}}, device=DEVICE)
    assert served_by(rms_norm_call) == "aiter"
    monkeypatch.setattr(verified, "library_versions", lambda: {"torch": "0", "triton": None, "aiter": "0.1"})
    verified.reload()
    assert served_by(rms_norm_call) == "triton"


def test_a_named_backend_is_chosen_without_a_record(aiter_stand_in, selftest_record):
    x, weight = torch.randn(3, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    assert served_by(lambda: ops.rms_norm(x, weight, backend="aiter")) == "aiter"
    with ops.use_backend("aiter"):
        assert served_by(rms_norm_call) == "aiter"


def test_triton_is_chosen_without_a_record_and_not_where_the_record_says_it_failed(aiter_stand_in, selftest_record):
    assert served_by(rms_norm_call) == "triton"
    selftest_record({"rms_norm": {"triton": FAILED}}, device=DEVICE)
    assert served_by(rms_norm_call) == "torch"
    selftest_record({"rms_norm": {"triton": PASSED}}, device=DEVICE)
    assert served_by(rms_norm_call) == "triton"


def test_the_record_is_read_once_per_reload(selftest_record, monkeypatch):
    selftest_record({"rms_norm": {"triton": PASSED}})
    reads = []
    read_record = verified.read_record
    monkeypatch.setattr(verified, "read_record", lambda *a: reads.append(a) or read_record(*a))
    for _ in range(3):
        verified.verdict("rms_norm", "triton", torch.device("cpu"))
    assert len(reads) == 1
    verified.reload()
    verified.verdict("rms_norm", "triton", torch.device("cpu"))
    assert len(reads) == 2


def test_the_suite_runs_without_the_users_record():
    assert os.environ[verified.PATH_ENV_VAR].endswith("none.json")
