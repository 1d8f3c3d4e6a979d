import pytest
import torch

from atom_core import ops
from atom_core.ops import reference
from atom_core.ops.tolerances import tolerance
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, DTYPES, HIDDEN, ROWS, needs_triton, non_contiguous_rows, rand


def test_twin_matches_naive_formula():
    # Per-row formula written out by hand: y_i = x_i / sqrt(mean_j x_j^2 + eps) * w_i.
    x = torch.tensor([[3.0, 4.0]])
    w = torch.tensor([1.0, 2.0])
    rms = ((9 + 16) / 2 + 1e-6) ** 0.5
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6), torch.tensor([[3 / rms, 8 / rms]]))
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6, gemma=True), torch.tensor([[6 / rms, 12 / rms]]))
    # LayerNorm of [1, 3]: mean 2, var 1 -> [-1, 1] / sqrt(1 + eps), then * w + b.
    b = torch.tensor([0.5, -0.5])
    s = (1 + 1e-5) ** -0.5
    torch.testing.assert_close(reference.layer_norm(torch.tensor([[1.0, 3.0]]), w, b, 1e-5),
                               torch.tensor([[-s + 0.5, 2 * s - 0.5]]))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_triton_matches_twin(dtype, rows, hidden, with_residual, gemma):
    g = torch.Generator().manual_seed(rows * hidden)
    x, w = rand(rows, hidden, dtype=dtype, generator=g), rand(hidden, dtype=dtype, generator=g)
    residual = rand(rows, hidden, dtype=dtype, generator=g) if with_residual else None
    got = ops.rms_norm(x, w, 1e-6, residual=residual, gemma=gemma, backend="triton")
    want = reference.rms_norm(x, w, 1e-6, residual, gemma)
    torch.testing.assert_close(got, want, **tolerance(dtype))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_triton_matches_twin(dtype, rows, with_bias, with_residual):
    hidden = HIDDEN[0]
    g = torch.Generator().manual_seed(rows)
    x, w = rand(rows, hidden, dtype=dtype, generator=g), rand(hidden, dtype=dtype, generator=g)
    b = rand(hidden, dtype=dtype, generator=g) if with_bias else None
    residual = rand(rows, hidden, dtype=dtype, generator=g) if with_residual else None
    got = ops.layer_norm(x, w, b, 1e-5, residual=residual, backend="triton")
    want = reference.layer_norm(x, w, b, 1e-5, residual)
    torch.testing.assert_close(got, want, **tolerance(dtype))


@needs_triton
def test_non_contiguous_rows_and_out_given():
    x = non_contiguous_rows(rand(19, 111))
    w = rand(111)
    r = non_contiguous_rows(rand(19, 111))
    out = non_contiguous_rows(torch.full((19, 111), float("nan"), device=DEVICE))
    res_out = torch.empty(19, 111, device=DEVICE)
    got_out, got_res = ops.rms_norm(x, w, 1e-6, residual=r, out=out, residual_out=res_out, backend="triton")
    assert got_out is out and got_res is res_out
    want_out, want_res = reference.rms_norm(x, w, 1e-6, r)
    torch.testing.assert_close(out, want_out, **tolerance(torch.float32))
    torch.testing.assert_close(res_out, want_res, **tolerance(torch.float32))


def test_transposed_input_falls_back_to_torch_unless_triton_named():
    x = rand(111, 19).t()  # last dim not contiguous
    w = rand(111)
    with ops.trace_backends() as calls:
        got = ops.rms_norm(x, w)
    assert calls == [("rms_norm", "torch")]
    torch.testing.assert_close(got, reference.rms_norm(x, w, 1e-6))
    if ops.backend_available("triton"):
        with pytest.raises(ops.BackendUnavailable, match="last dim contiguous"):
            ops.rms_norm(x, w, backend="triton")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.rms_norm(torch.randn(4), torch.randn(4)), "x must have 2 dims"),
        (lambda: ops.rms_norm(torch.randn(2, 4), torch.randn(5)), "weight must have shape"),
        (lambda: ops.rms_norm(torch.randn(2, 4).int(), torch.randn(4)), "x dtype"),
        (lambda: ops.rms_norm(torch.randn(2, 4), torch.randn(4), residual=torch.randn(3, 4)), "residual must have shape"),
        (lambda: ops.rms_norm(torch.randn(2, 4), torch.randn(4), out=torch.empty(2, 5)), "out must have shape"),
        (lambda: ops.rms_norm(torch.randn(2, 4), [1.0] * 4), "weight must be a torch.Tensor"),
        (lambda: ops.layer_norm(torch.randn(2, 4), torch.randn(4), torch.randn(3)), "bias must have shape"),
        (lambda: ops.rms_norm(torch.randn(2, 4), torch.randn(4), backend="cuda"), "unknown backend"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_aiter_adapter_argument_mapping(monkeypatch):
    def rmsnorm2d_fwd(input, weight, epsilon, use_model_sensitive_rmsnorm):
        return reference.rms_norm(input, weight, epsilon)

    def rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon, use_model_sensitive_rmsnorm):
        o, r = reference.rms_norm(input, weight, epsilon, residual_in)
        out.copy_(o)
        residual_out.copy_(r)

    def layernorm2d_fwd(input, weight, bias, epsilon, x_bias):
        return reference.layer_norm(input, weight, bias, epsilon)

    fake = fake_aiter.install(monkeypatch, {"rmsnorm2d_fwd": rmsnorm2d_fwd,
                                            "rmsnorm2d_fwd_with_add": rmsnorm2d_fwd_with_add,
                                            "layernorm2d_fwd": layernorm2d_fwd})
    from atom_core.ops.aiter import norm as aiter_norm

    x, w, r, b = torch.randn(3, 8), torch.randn(8), torch.randn(3, 8), torch.randn(8)
    out, res_out = torch.empty(3, 8), torch.empty(3, 8)
    aiter_norm.rms_norm(x, w, 1e-6, None, False, out, None)
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-6))
    aiter_norm.rms_norm(x, w, 1e-6, r, False, out, res_out)
    torch.testing.assert_close((out, res_out), reference.rms_norm(x, w, 1e-6, r))
    aiter_norm.layer_norm(x, w, b, 1e-5, None, out, None)
    torch.testing.assert_close(out, reference.layer_norm(x, w, b, 1e-5))
    assert [name for name, _ in fake.calls] == ["rmsnorm2d_fwd", "rmsnorm2d_fwd_with_add", "layernorm2d_fwd"]
    assert fake.calls[1][1]["residual_in"] is r and fake.calls[1][1]["epsilon"] == 1e-6


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_rows_of_more_than_two_dims_are_refused_on_every_backend_with_checks_off(norm, backend):
    from atom_core.ops.validation import debug_checks

    x, w = torch.randn(2, 3, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    args = (x, w) if norm == "rms_norm" else (x, w, None)
    with debug_checks(False), pytest.raises(ValueError, match=r"x must have 2 dims .*reshape\(-1, x.shape\[-1\]\)"):
        getattr(ops, norm)(*args, backend=backend)
