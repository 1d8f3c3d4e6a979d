import importlib
import math
import types

import pytest
import torch
import torch.nn.functional as F

from atom_core.ops import activation as activation_module
from atom_core.ops.activation import gelu_and_mul, silu_and_mul, swiglu_clamped
from atom_core.ops.dispatch import BackendUnavailable, backend_available, trace_backends
from atom_core.ops.reference import activation as reference
from atom_core.ops.tolerances import tolerance
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, DTYPES, HIDDEN, ON_GPU, ROWS, needs_triton, non_contiguous_rows, rand

# The interpreter evaluates exp() on masked-out lanes too; numpy's overflow warning there is noise.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# name -> (public call with keyword options, twin call with the same options)
ACTIVATIONS = {
    "silu": (lambda x, **kw: silu_and_mul(x, **kw), reference.silu_and_mul),
    "gelu": (lambda x, **kw: gelu_and_mul(x, **kw), reference.gelu_and_mul),
    "gelu_tanh": (lambda x, **kw: gelu_and_mul(x, approximate="tanh", **kw),
                  lambda x: reference.gelu_and_mul(x, "tanh")),
    "swiglu": (lambda x, **kw: swiglu_clamped(x, **kw), reference.swiglu_clamped),
    "swiglu_tight": (lambda x, **kw: swiglu_clamped(x, alpha=1.0, limit=0.5, **kw),
                     lambda x: reference.swiglu_clamped(x, 1.0, 0.5)),
}


def test_twins_by_hand():
    x = torch.tensor([[1.0, 2.0]])  # gate 1, up 2
    sigmoid_1 = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(reference.silu_and_mul(x), torch.tensor([[1 * sigmoid_1 * 2]]))
    # erf GELU: 1/2 * (1 + erf(1 / sqrt 2)) * 2
    torch.testing.assert_close(reference.gelu_and_mul(x), torch.tensor([[0.5 * (1 + math.erf(1 / math.sqrt(2))) * 2]]))
    # tanh GELU: 1/2 * (1 + tanh(sqrt(2/pi) * (1 + 0.044715))) * 2
    tanh_gelu = 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * 1.044715))
    torch.testing.assert_close(reference.gelu_and_mul(x, "tanh"), torch.tensor([[tanh_gelu * 2]]))
    # swiglu, interleaved pairs (gate, up) = (8, -9) and (-1, 0.5), limit 7:
    # (clamp(-9) + 1) * 7 * sigmoid(1.702 * 7) = -6 * 7 * s(11.914); (0.5 + 1) * -1 * s(-1.702)
    x = torch.tensor([[8.0, -9.0, -1.0, 0.5]])
    s = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    want = torch.tensor([[-6 * 7 * s(1.702 * 7), 1.5 * -1 * s(-1.702)]])
    torch.testing.assert_close(reference.swiglu_clamped(x), want)


def test_swiglu_twin_matches_hf_gpt_oss_gate():
    pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    x = torch.randn(7, 64) * 6
    experts = types.SimpleNamespace(alpha=1.702, limit=7.0)
    torch.testing.assert_close(reference.swiglu_clamped(x), GptOssExperts._apply_gate(experts, x))


def test_twins_match_torch_functional():
    x = torch.randn(5, 40)
    gate, up = x[:, :20], x[:, 20:]
    torch.testing.assert_close(reference.silu_and_mul(x), F.silu(gate) * up)
    torch.testing.assert_close(reference.gelu_and_mul(x, "tanh"), F.gelu(gate, approximate="tanh") * up)
    xb = x.bfloat16()
    assert reference.silu_and_mul(xb).dtype == torch.bfloat16


@needs_triton
@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", HIDDEN + ([14336, 1] if ON_GPU else [1]))
def test_triton_matches_twin(name, dtype, rows, inter):
    call, twin = ACTIVATIONS[name]
    g = torch.Generator().manual_seed(rows * inter)
    x = rand(rows, 2 * inter, dtype=dtype, generator=g) * 4  # reaches the clamps and both sigmoid tails
    with trace_backends() as calls:
        got = call(x, backend="triton")
    assert calls[0][1] == "triton" and got.shape == (rows, inter) and got.dtype == dtype
    torch.testing.assert_close(got, twin(x), **tolerance(dtype))


@needs_triton
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_triton_wide_rows_split_over_programs(name):
    # I = 2500 spans three column tiles of 1024, the last one partial.
    call, twin = ACTIVATIONS[name]
    x = rand(3, 5000, generator=torch.Generator().manual_seed(2)) * 4
    torch.testing.assert_close(call(x, backend="triton"), twin(x), **tolerance(torch.float32))


@needs_triton
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_triton_strided_rows_and_out_given(name):
    call, twin = ACTIVATIONS[name]
    x = non_contiguous_rows(rand(19, 222))
    out = non_contiguous_rows(torch.full((19, 111), float("nan"), device=DEVICE))
    assert call(x, out=out, backend="triton") is out
    torch.testing.assert_close(out, twin(x), **tolerance(torch.float32))


def test_non_contiguous_last_dim_falls_back_to_torch_unless_triton_named():
    x = torch.randn(64, 6, device=DEVICE).t()  # [6, 64], last-dim stride 6
    with trace_backends() as calls:
        got = silu_and_mul(x)
    assert calls == [("silu_and_mul", "torch")]
    torch.testing.assert_close(got, reference.silu_and_mul(x))
    if backend_available("triton"):
        with pytest.raises(BackendUnavailable, match="last dim of x and out contiguous"):
            silu_and_mul(x, backend="triton")


def test_swiglu_has_no_aiter_backend():
    x = torch.randn(2, 8)
    assert "no aiter implementation" in activation_module.SWIGLU_CLAMPED.why_not("aiter", x, 1.7, 7.0, x[:, :4])


def test_compiles_with_fullgraph():
    def mlp(x):
        return silu_and_mul(x, backend="torch") + gelu_and_mul(x, backend="torch") + swiglu_clamped(x, backend="torch")

    x = torch.randn(3, 16)
    torch.testing.assert_close(torch.compile(mlp, fullgraph=True, backend="aot_eager")(x), mlp(x))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: silu_and_mul(torch.randn(8)), "x must have 2 dims"),
        (lambda: silu_and_mul(torch.randn(2, 7)), "even number of columns"),
        (lambda: silu_and_mul(torch.randn(2, 8).long()), "x dtype"),
        (lambda: silu_and_mul(torch.randn(2, 8), out=torch.empty(2, 8)), "out must have shape"),
        (lambda: silu_and_mul(torch.randn(2, 8), out=torch.empty(2, 4).half()), "out must have dtype"),
        (lambda: gelu_and_mul(torch.randn(2, 8), approximate="erf"), "approximate must be one of"),
        (lambda: swiglu_clamped(torch.randn(2, 8), limit=0.0), "limit must be > 0"),
        (lambda: swiglu_clamped("x"), "x must be a torch.Tensor"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_aiter_adapter_argument_mapping(monkeypatch):
    def act_and_mul(act):
        def behaviour(out, input):
            gate, up = input.float().chunk(2, dim=-1)
            out.copy_(act(gate) * up)
        return behaviour

    fake = fake_aiter.install(monkeypatch, {
        "silu_and_mul": act_and_mul(F.silu),
        "gelu_and_mul": act_and_mul(F.gelu),
        "gelu_tanh_and_mul": act_and_mul(lambda g: F.gelu(g, approximate="tanh")),
    })
    aiter_activation = importlib.import_module("atom_core.ops.aiter.activation")  # fresh: bound to this fake

    x = torch.randn(3, 16)
    out = torch.empty(3, 8)
    aiter_activation.silu_and_mul(x, out)
    torch.testing.assert_close(out, reference.silu_and_mul(x))
    aiter_activation.gelu_and_mul(x, "none", out)
    torch.testing.assert_close(out, reference.gelu_and_mul(x))
    aiter_activation.gelu_and_mul(x, "tanh", out)
    torch.testing.assert_close(out, reference.gelu_and_mul(x, "tanh"))
    assert [name for name, _ in fake.calls] == ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"]
    assert all(args["out"] is out and args["input"] is x for _, args in fake.calls)


def test_aiter_refusals():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    assert activation_module._aiter_supports(x, out) is None
    assert "contiguous" in activation_module._aiter_supports(non_contiguous_rows(x), out)
    assert "fp16/bf16" in activation_module._aiter_supports(x.float(), out.float())
