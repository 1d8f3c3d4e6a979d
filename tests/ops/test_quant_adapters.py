"""The quantization ops' and scaled GEMMs' other backends: the AITER adapters against the stand-in
module (AITER's real signatures; behaviours written from AITER's own torch references), the
``scaled_mm`` backend (torch._scaled_mm, run here on the CPU where it has a kernel), its rules, and
where auto places it."""

import importlib

import pytest
import torch

from atom_core import ops
from atom_core.ops import dispatch, quant, scaled_mm, torch_scaled_mm
from atom_core.ops.dispatch import BackendUnavailable
from atom_core.ops.reference import quant as reference_quant
from atom_core.ops.reference import scaled_mm as reference
from atom_core.ops.tolerances import SCALED_MM, tolerance
from tests.ops import fake_aiter, test_scaled_mm


def make_inputs(*args, **kwargs):
    """test_scaled_mm's inputs, on the CPU on every machine (a GPU one too): the AITER stand-in, the CPU counted
    as a GPU and torch's CPU kernel are what these tests exercise."""
    return tuple(None if t is None else t.cpu() for t in test_scaled_mm.make_inputs(*args, **kwargs))


FP8, INT8 = torch.float8_e4m3fn, torch.int8
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
QUANT_OPS = [quant.PER_TENSOR_QUANT, quant.PER_TOKEN_QUANT, quant.PER_GROUP_QUANT]
GEMM_OPS = [scaled_mm.SCALED_MM_PER_TENSOR, scaled_mm.SCALED_MM_PER_TOKEN, scaled_mm.SCALED_MM_BLOCK]


# --- behaviours of the stand-in, after AITER's torch references (aiter/ops/quant.py, op_tests/test_gemm_a8w8*.py)

def _dynamic_per_token_scaled_quant(out, input, scales, scale_ub, shuffle_scale, num_rows, num_rows_factor):
    assert scales.shape == (input.shape[0], 1) and not shuffle_scale and input.is_contiguous()
    q, scale = reference_quant.per_token_quant(input, out.dtype)
    out.copy_(q)
    scales.copy_(scale)


def _dynamic_per_tensor_quant(out, input, scale):
    q, s = reference_quant.per_tensor_quant(input, out.dtype)
    out.copy_(q)
    scale.copy_(s)


def _static_per_tensor_quant(out, input, scale):
    out.copy_(reference_quant.per_tensor_quant(input, out.dtype, scale)[0])


def _gemm_a8w8_ck(XQ, WQ, x_scale, w_scale, bias, dtype, splitK):
    m, n = XQ.shape[0], WQ.shape[0]
    assert x_scale.shape == (m, 1) and w_scale.shape == (n, 1) and x_scale.is_contiguous()
    out = (XQ.float() * x_scale) @ (WQ.float() * w_scale).t()
    if bias is not None:
        assert bias.shape == (1, n) and bias.dtype == dtype
        out = out + bias.float()
    return out.to(dtype)


def _gemm_a8w8_blockscale(XQ, WQ, x_scale, w_scale, dtype, isBpreshuffled):
    m, k = XQ.shape
    n = WQ.shape[0]
    assert k % 128 == 0 and x_scale.shape == (m, k // 128) and x_scale.is_contiguous() and not isBpreshuffled
    x = (XQ.float().view(m, k // 128, 128) * x_scale.unsqueeze(-1)).view(m, k)  # AITER's run_torch
    w = WQ.float() * reference.expand_block_scales(w_scale, n, k)
    return (x @ w.t()).to(dtype)


BEHAVIOURS = {
    "dynamic_per_token_scaled_quant": _dynamic_per_token_scaled_quant,
    "dynamic_per_tensor_quant": _dynamic_per_tensor_quant,
    "static_per_tensor_quant": _static_per_tensor_quant,
    "gemm_a8w8_CK": _gemm_a8w8_ck,
    "gemm_a8w8_blockscale": _gemm_a8w8_blockscale,
}


@pytest.fixture
def every_backend_here(monkeypatch):
    """AITER is the stand-in, every backend counts as available and takes CPU tensors, and the CPU
    counts as a GPU whose fp8 is e4m3fn (sm90); adapters loaded meanwhile are forgotten afterwards."""
    fake = fake_aiter.install(monkeypatch, BEHAVIOURS)
    monkeypatch.setattr(dispatch, "backend_available", lambda name: True)
    monkeypatch.setattr(dispatch, "on_device_for", lambda backend, *tensors: None)
    for module in (quant, scaled_mm, torch_scaled_mm):
        monkeypatch.setattr(module, "fp8_e4m3fn_native", lambda device: True)
    monkeypatch.setattr(torch_scaled_mm, "_is_nvidia_sm90", lambda device: True)
    saved = {op: {b: impl.target for b, impl in op._impls.items()} for op in QUANT_OPS + GEMM_OPS}
    dispatch.clear_choices()
    yield fake
    for op, targets in saved.items():
        for backend, target in targets.items():
            op._impls[backend].target = target
    dispatch.clear_choices()


def test_aiter_quantization_adapters_through_the_ops(every_backend_here):
    x = torch.randn(5, 256, dtype=BF16)
    x[2] = 0
    for name, twin in (("tensor", lambda t: reference_quant.per_tensor_quant(t, FP8)),
                       ("token", lambda t: reference_quant.per_token_quant(t, FP8)),
                       ("group", lambda t: reference_quant.per_group_quant(t, FP8, 64))):
        kwargs = {"group_size": 64} if name == "group" else {}
        q, scale = getattr(ops, f"per_{name}_quant")(x, backend="aiter", **kwargs)
        want_q, want_scale = twin(x)
        assert torch.equal(q.float(), want_q.float()) and torch.equal(scale, want_scale), name
    q, scale = ops.per_tensor_quant(x, scale=torch.tensor([0.01]), backend="aiter")
    assert scale.tolist() == [pytest.approx(0.01)] and torch.equal(
        q.float(), reference_quant.per_tensor_quant(x, FP8, torch.tensor([0.01]))[0].float())
    names = [name for name, _ in every_backend_here.calls]
    assert names == ["dynamic_per_tensor_quant", "dynamic_per_token_scaled_quant", "dynamic_per_token_scaled_quant",
                     "static_per_tensor_quant"]
    group_call = every_backend_here.calls[2][1]
    assert group_call["input"].shape == (5 * 4, 64) and group_call["scales"].shape == (5 * 4, 1)
    with pytest.raises(BackendUnavailable, match="rounding"):
        ops.per_token_quant(x, dtype=INT8, backend="aiter")


@pytest.mark.parametrize("out_dtype", [BF16, FP16])
@pytest.mark.parametrize("fmt, quant_dtype", [("per_tensor", FP8), ("per_token", FP8), ("per_token", INT8),
                                              ("block", FP8)])
def test_aiter_gemm_adapters_through_the_ops(every_backend_here, fmt, quant_dtype, out_dtype):
    a, a_scale, w, w_scale, bias = make_inputs(fmt, quant_dtype, 7, 200, 256, bias=True)
    got = getattr(ops, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, out_dtype=out_dtype, bias=bias, backend="aiter")
    want = getattr(reference, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, bias, out_dtype)
    torch.testing.assert_close(got, want, **tolerance(out_dtype, SCALED_MM))
    (name, arguments), = every_backend_here.calls
    assert name == ("gemm_a8w8_blockscale" if fmt == "block" else "gemm_a8w8_CK")
    assert arguments["dtype"] == out_dtype and arguments["XQ"] is a and arguments["WQ"] is w


def test_aiter_gemm_refusals(every_backend_here):
    a, a_scale, w, w_scale, _ = make_inputs("block", FP8, 3, 128, 200)
    with pytest.raises(BackendUnavailable, match="K a multiple of 128"):
        ops.scaled_mm_block(a, a_scale, w, w_scale, backend="aiter")
    a, a_scale, w, w_scale, _ = make_inputs("per_token", FP8, 3, 64, 128)
    with pytest.raises(BackendUnavailable, match="bf16 or fp16"):
        ops.scaled_mm_per_token(a, a_scale, w, w_scale, out_dtype=FP32, backend="aiter")
    with pytest.raises(BackendUnavailable, match="contiguous"):
        ops.scaled_mm_per_token(a, a_scale, w.t().contiguous().t(), w_scale, backend="aiter")


def _cpu_scaled_mm_takes_row_wise_scales() -> bool:
    a = torch.ones(16, 16).to(FP8)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=BF16)
    except RuntimeError:  # e.g. torch 2.11: "_scaled_mm only supports per-tensor scaling for CPU backend"
        return False
    return True


needs_cpu_row_wise = pytest.mark.skipif(not _cpu_scaled_mm_takes_row_wise_scales(),
                                        reason="this torch's CPU _scaled_mm takes per-tensor scales only")


@pytest.mark.parametrize("out_dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("fmt", ["per_tensor", pytest.param("per_token", marks=needs_cpu_row_wise)])
def test_scaled_mm_adapters_match_the_twin_with_torchs_cpu_kernel(fmt, out_dtype):
    for bias in (False, True):
        a, a_scale, w, w_scale, b = make_inputs(fmt, FP8, 7, 48, 96, bias=bias)
        got = getattr(torch_scaled_mm, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, b, out_dtype)
        assert got.dtype == out_dtype
        want = getattr(reference, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, b, out_dtype)
        torch.testing.assert_close(got, want, **tolerance(out_dtype, SCALED_MM))


def _cublas_block_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
    """A stand-in for torch.nn.functional.scaled_mm's BlockWise1x128 x BlockWise128x128 (CUDA only),
    checking the scale layouts as torch's meta registration states them."""
    functional = torch.nn.functional
    assert (recipe_a, recipe_b) == (functional.ScalingType.BlockWise1x128, functional.ScalingType.BlockWise128x128)
    (m, k), n = mat_a.shape, mat_b.shape[1]
    assert mat_b.stride() == (1, k)  # column-major
    padded = -(-(k // 128) // 4) * 4
    assert scale_a.shape == (m, k // 128) and scale_a.stride(0) == 1
    assert scale_a.stride(1) == m or (scale_a.shape[1] == 1 and scale_a.stride(1) == 1)
    assert scale_b.shape == (padded, n // 128) and scale_b.stride() == (1, padded)
    a = mat_a.float() * scale_a.repeat_interleave(128, dim=1)
    b = mat_b.float() * scale_b[: k // 128].repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return (a @ b).to(output_dtype)


def test_scaled_mm_block_relays_the_scales_for_cublas(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", _cublas_block_scaled_mm, raising=False)
    a, a_scale, w, w_scale, bias = make_inputs("block", FP8, 5, 256, 640, bias=True)  # 5 groups: padded to 8
    got = torch_scaled_mm.scaled_mm_block(a, a_scale, w, w_scale, bias, BF16)
    torch.testing.assert_close(got, reference.scaled_mm_block(a, a_scale, w, w_scale, bias, BF16),
                               **tolerance(BF16, SCALED_MM))


def test_scaled_mm_rules(every_backend_here):
    a, a_scale, w, w_scale, _ = make_inputs("per_token", FP8, 3, 64, 128)
    rules = torch_scaled_mm
    assert rules.supports_per_token(a, a_scale, w, w_scale, None, BF16) is None
    assert "fp8 operands only" in rules.supports_per_token(a.view(INT8), a_scale, w.view(INT8), w_scale, None, BF16)
    assert "bf16 only" in rules.supports_per_token(a, a_scale, w, w_scale, None, FP16)
    assert "multiples of 16" in rules.supports_per_tensor(a[:, :120].contiguous(), a_scale, w[:, :120].contiguous(),
                                                          w_scale, None, BF16)
    assert "row-major" in rules.supports_per_tensor(a, a_scale, w.t().contiguous().t(), w_scale, None, BF16)
    assert "fp32 accuracy" in rules.supports_per_tensor(a, a_scale, w, w_scale, None, FP32)
    a, a_scale, w, w_scale, _ = make_inputs("block", FP8, 4, 256, 384)
    assert rules.supports_block(a, a_scale, w, w_scale, None, BF16) is None
    assert "multiple of 4" in rules.supports_block(a[:3], a_scale[:3], w, w_scale, None, BF16)
    assert "multiples of 128" in rules.supports_block(a, a_scale, w[:144].contiguous(), w_scale[:2], None, BF16)


def test_scaled_mm_is_not_available_on_a_machine_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU machine")
    assert not dispatch.backend_available("scaled_mm") and "scaled_mm" not in ops.available_backends()
    a, a_scale, w, w_scale, _ = make_inputs("per_token", FP8, 3, 64, 128)
    with pytest.raises(BackendUnavailable, match="not available on this machine"):
        ops.scaled_mm_per_token(a, a_scale, w, w_scale, backend="scaled_mm")


def test_auto_prefers_triton_then_scaled_mm_then_the_twin(every_backend_here, selftest_record):
    a, a_scale, w, w_scale, _ = make_inputs("per_token", FP8, 3, 64, 128)
    op = scaled_mm.SCALED_MM_PER_TOKEN
    assert op.backends == ["aiter", "triton", "scaled_mm", "torch"]
    assert op.choose(a, a_scale, w, w_scale, None, BF16) == "triton"  # aiter: no passing record
    failed = {"passed": False, "cases": 1, "refused": 0, "failures": ["x"]}
    selftest_record({"scaled_mm_per_token": {"triton": failed}})
    assert op.choose(a, a_scale, w, w_scale, None, BF16) == "scaled_mm"
    assert op.choose(a, a_scale, w, w_scale, None, FP16) == "torch"  # scaled_mm's row-wise writes bf16 only
    with dispatch.use_backend("scaled_mm"):
        assert op.choose(a, a_scale, w, w_scale, None, BF16) == "scaled_mm"


@needs_cpu_row_wise
def test_auto_runs_the_scaled_mm_backend_once_triton_failed_its_selftest(every_backend_here, selftest_record):
    a, a_scale, w, w_scale, _ = make_inputs("per_token", FP8, 3, 64, 128)
    selftest_record({"scaled_mm_per_token": {"triton": {"passed": False, "cases": 1, "refused": 0, "failures": ["x"]}}})
    with ops.trace_backends() as calls:
        got = ops.scaled_mm_per_token(a, a_scale, w, w_scale)
    assert calls == [("scaled_mm_per_token", "scaled_mm")]
    torch.testing.assert_close(got, reference.scaled_mm_per_token(a, a_scale, w, w_scale, None, BF16),
                               **tolerance(BF16, SCALED_MM))


def test_adapter_modules_import_against_the_stand_in(every_backend_here):
    for name in ("quant", "scaled_mm"):
        module = importlib.import_module(f"atom_core.ops.aiter.{name}")
        assert module.aiter is every_backend_here
