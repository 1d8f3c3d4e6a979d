"""The per-call argument checks run in debug mode only; the few out-of-bounds guards always run."""

import importlib
import os
import subprocess
import sys

import pytest
import torch

from atom_core import ops

# One valid call per public op (torch backend: the point is the checks around it, not the kernel).
T, D, H, DH, E = 3, 8, 2, 8, 4
CALLS = {
    "norm": lambda: ops.rms_norm(torch.randn(T, D), torch.ones(D), backend="torch"),
    "activation": lambda: ops.silu_and_mul(torch.randn(T, 2 * D), backend="torch"),
    "norm_quant:rms_norm_quant": lambda: ops.rms_norm_quant(torch.randn(T, D), torch.ones(D), 1e-6,
                                                            residual=torch.randn(T, D), backend="torch"),
    "norm_quant:silu_and_mul_quant": lambda: ops.silu_and_mul_quant(torch.randn(T, 2 * D), backend="torch"),
    "rope": lambda: ops.apply_rope_(torch.randn(T, H, DH), torch.randn(T, H, DH), torch.arange(T),
                                    ops.rope_cos_sin_cache(DH, 16, 10000.0)[0], backend="torch"),
    "qk_norm_rope": lambda: ops.qk_norm_rope_(torch.randn(T, H, DH), torch.randn(T, H, DH), torch.ones(DH),
                                              torch.ones(DH), torch.arange(T),
                                              ops.rope_cos_sin_cache(DH, 16, 10000.0)[0], eps=1e-6, backend="torch"),
    "kv_cache": lambda: ops.store_kv_(torch.randn(T, H, DH), torch.randn(T, H, DH), torch.zeros(2, 4, H, DH),
                                      torch.zeros(2, 4, H, DH), torch.arange(T), backend="torch"),
    "attention": lambda: ops.paged_attention(
        torch.randn(T, H, DH), torch.randn(2, 4, H, DH), torch.randn(2, 4, H, DH),
        torch.tensor([[0, 1]] * T, dtype=torch.int32), torch.arange(T + 1, dtype=torch.int32),
        torch.full((T,), 5, dtype=torch.int32), 1, 5, scale=DH ** -0.5, backend="torch"),
    "sampling": lambda: ops.sample(torch.randn(T, 16), torch.ones(T), None, None, None, torch.arange(T),
                                   torch.zeros(T, dtype=torch.int64), backend="torch"),
    "moe_routing": lambda: ops.grouped_topk(torch.randn(T, E), 2, num_expert_group=2, topk_group=1,
                                            renormalize=True, backend="torch"),
    "fused_moe": lambda: ops.fused_experts(torch.randn(T, D), torch.randn(E, 2 * D, D), torch.randn(E, D, D),
                                           torch.rand(T, 2), torch.randint(0, E, (T, 2), dtype=torch.int32),
                                           backend="torch"),
}


@pytest.fixture
def check_calls(request, monkeypatch):
    """Counts the calls of ``check_tensor`` (every op's checks use it) in the op's module (the key before a
    ``:``, where a module holds several ops)."""
    module = importlib.import_module(f"atom_core.ops.{request.param.partition(':')[0]}")
    calls = []
    check_tensor = module.check_tensor

    def counting_check_tensor(name, *args, **kwargs):
        calls.append(name)
        return check_tensor(name, *args, **kwargs)

    monkeypatch.setattr(module, "check_tensor", counting_check_tensor)
    return calls


@pytest.mark.parametrize("check_calls", sorted(CALLS), indirect=True)
def test_checks_run_with_debug_on_and_are_skipped_with_it_off(check_calls, request):
    call = CALLS[request.node.callspec.params["check_calls"]]
    with ops.debug_checks(False):
        call()
    assert check_calls == []
    with ops.debug_checks():
        call()
    assert check_calls


def test_a_bad_argument_raises_with_debug_on_and_passes_unchecked_with_it_off():
    x, weight_2d = torch.randn(T, D), torch.ones(1, D)  # weight must be [D]; the twin broadcasts [1, D]
    with ops.debug_checks(True), pytest.raises(ValueError, match="weight must have 1 dims"):
        ops.rms_norm(x, weight_2d, backend="torch")
    with ops.debug_checks(False):
        got = ops.rms_norm(x, weight_2d, backend="torch")
    torch.testing.assert_close(got, ops.reference.rms_norm(x, torch.ones(D), 1e-6))


def test_set_debug_and_the_context_restore_the_previous_setting():
    assert ops.debug_enabled()  # the test suite turns the checks on (tests/conftest.py)
    with ops.debug_checks(False):
        assert not ops.debug_enabled()
        with ops.debug_checks():
            assert ops.debug_enabled()
        assert not ops.debug_enabled()
    assert ops.debug_enabled()
    ops.set_debug(False)
    try:
        assert not ops.debug_enabled()
    finally:
        ops.set_debug(True)


@pytest.mark.parametrize("value, enabled", [("1", True), ("0", False), ("", False)])
def test_env_var_turns_debug_on_at_import(value, enabled):
    code = "import os, atom_core.ops as ops; os.environ['ATOM_CORE_DEBUG'] = '1'; print(ops.debug_enabled())"
    env = {**os.environ, "ATOM_CORE_DEBUG": value}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == str(enabled)  # set after import: read once, not again


@pytest.mark.parametrize("call, message", [
    (lambda: ops.rms_norm(torch.randn(2, 4), torch.ones(4), out=torch.empty(1, 4)), "out must have shape"),
    (lambda: ops.rms_norm(torch.randn(2, 4), torch.ones(4), residual=torch.randn(2, 4), residual_out=torch.empty(1, 4)),
     "residual_out must have shape"),
    # (a twin would write row 1 of its one output into residual_out and row 0 into every row of out)
    (lambda: ops.rms_norm(torch.randn(2, 4), torch.ones(4), out=torch.empty(2, 4), residual_out=torch.empty(2, 4)),
     "residual_out given without residual"),
    (lambda: ops.layer_norm(torch.randn(1, 4), torch.ones(4), None, residual_out=torch.empty(1, 4)),
     "residual_out given without residual"),
    (lambda: ops.silu_and_mul(torch.randn(2, 8), out=torch.empty(2, 3)), "out must have shape"),
    (lambda: ops.fused_experts(torch.randn(2, 4), torch.randn(2, 8, 4), torch.randn(2, 4, 4), torch.rand(2, 1),
                               torch.zeros(2, 1, dtype=torch.int32), out=torch.empty(1, 4)), "out must have shape"),
    (lambda: ops.store_kv_(torch.randn(3, 1, 4), torch.randn(3, 1, 4), torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4),
                           torch.arange(2)), "one slot per token"),
])
def test_out_of_bounds_guards_run_with_debug_off(call, message):
    with ops.debug_checks(False), pytest.raises(ValueError, match=message):
        call()
