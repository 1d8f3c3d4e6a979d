"""Dynamic activation quantization: the twins against an independent float64 definition, each
backend against the twins (Triton bit for bit), rounding ties, saturation, all-zero rows and groups,
round trips within the format's error, and the dispatch rules."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from atom_core import ops
from atom_core.ops import quant as quant_module
from atom_core.ops.dispatch import BackendUnavailable, backend_available, trace_backends
from atom_core.ops.reference import quant as reference
from tests.ops.conftest import DEVICE, ON_GPU, needs_triton, non_contiguous_rows

FP8, INT8 = torch.float8_e4m3fn, torch.int8
QUANT_DTYPES = [FP8, INT8]
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


def _bits(q):
    """fp8 as its bytes (NaN and -0 compare by bits), int8 as is."""
    return q.view(torch.uint8) if q.dtype == FP8 else q


def _fp8_grid() -> list[float]:
    """Every finite non-negative e4m3fn value, decoded from its bits (no torch cast involved)."""
    values = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue  # the NaN pattern
            values.append(mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values


FP8_GRID = _fp8_grid()


def _round_half_even_to(grid: list[float], y: float) -> float:
    """Nearest value of the sorted non-negative ``grid`` to y (sign kept); ties to the even index."""
    magnitude = abs(y)
    below = max(i for i, v in enumerate(grid) if v <= magnitude)
    above = min(below + 1, len(grid) - 1)
    low, high = grid[below], grid[above]
    if magnitude - low < high - magnitude or (magnitude - low == high - magnitude and below % 2 == 0):
        chosen = low
    else:
        chosen = high
    return math.copysign(chosen, y)


def _quantize_f64(values: list[float], scale: float, dtype) -> list[float]:
    out = []
    for v in values:
        y = float(torch.tensor(v / scale, dtype=torch.float64).float())  # one fp32 rounding of x / scale
        if dtype == INT8:
            out.append(float(max(-127, min(127, round(y)))))  # Python's round: half to even
        else:
            out.append(_round_half_even_to(FP8_GRID, max(-448.0, min(448.0, y))))
    return out


FLOOR_FP32 = float(torch.tensor(1e-10, dtype=torch.float32))  # the floor as the kernels hold it


def _scale_f64(amax: float, dtype) -> float:
    return float(torch.tensor(max(amax, FLOOR_FP32) / reference.qmax(dtype), dtype=torch.float64).float())


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_twins_equal_an_independent_float64_definition(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 200, generator=g) * 5
    x[1] = 0.0
    x[2, 7] = 1e3  # one large value: the rest of its row and groups sit low in the format
    rows = x.tolist()
    # per-tensor
    scale = _scale_f64(max(abs(v) for row in rows for v in row), dtype)
    q, s = reference.per_tensor_quant(x, dtype)
    assert s.tolist() == [scale]
    assert q.float().tolist() == [_quantize_f64(row, scale, dtype) for row in rows]
    # per-token
    q, s = reference.per_token_quant(x, dtype)
    scales = [_scale_f64(max(abs(v) for v in row), dtype) for row in rows]
    assert s.flatten().tolist() == scales
    assert q.float().tolist() == [_quantize_f64(row, sc, dtype) for row, sc in zip(rows, scales)]
    # per-group of 64 (K = 200: groups of 64, 64, 64 and 8)
    q, s = reference.per_group_quant(x, dtype, group_size=64)
    for t, row in enumerate(rows):
        groups = [row[i:i + 64] for i in range(0, 200, 64)]
        group_scales = [_scale_f64(max(abs(v) for v in grp), dtype) for grp in groups]
        assert s[t].tolist() == group_scales
        want = [v for grp, sc in zip(groups, group_scales) for v in _quantize_f64(grp, sc, dtype)]
        assert q[t].float().tolist() == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_rounding_ties_and_saturation_with_a_static_scale(backend):
    # x / 1.0 exactly: int8 rounds half to even; fp8 ties go to the even mantissa (17 -> 16, 19 -> 20).
    x = torch.tensor([[0.5, 1.5, 2.5, -2.5, 3.5, 126.5, 127.4, 1000.0, -1000.0, 17.0, 19.0, 464.0]], device=DEVICE)
    one = torch.tensor([1.0], device=DEVICE)
    q, scale = ops.per_tensor_quant(x, dtype=INT8, scale=one, backend=backend)
    assert q.tolist() == [[0, 2, 2, -2, 4, 126, 127, 127, -127, 17, 19, 127]] and scale.tolist() == [1.0]
    q, _ = ops.per_tensor_quant(x, dtype=FP8, scale=one, backend=backend)
    assert q.float().tolist() == [[0.5, 1.5, 2.5, -2.5, 3.5, 128.0, 128.0, 448.0, -448.0, 16.0, 20.0, 448.0]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_all_zero_rows_and_groups_quantize_to_zero_with_the_floor_scale(backend, dtype):
    x = torch.randn(3, 300, device=DEVICE)
    x[1] = 0.0
    x[2, 128:256] = 0.0  # the second group of row 2
    floor = 1e-10 / reference.qmax(dtype)
    q, scale = ops.per_token_quant(x, dtype=dtype, backend=backend)
    assert scale[1].item() == pytest.approx(floor, rel=1e-6) and not q[1].float().any()
    q, scale = ops.per_group_quant(x, dtype=dtype, backend=backend)
    assert scale.shape == (3, 3) and scale[1].tolist() == pytest.approx([floor] * 3, rel=1e-6)
    assert scale[2, 1].item() == pytest.approx(floor, rel=1e-6) and not q[2, 128:256].float().any()
    q, scale = ops.per_tensor_quant(torch.zeros(2, 5, device=DEVICE), dtype=dtype, backend=backend)
    assert scale.item() == pytest.approx(floor, rel=1e-6) and not q.float().any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("granularity", ["tensor", "token", "group"])
def test_round_trip_within_the_formats_error_and_the_largest_value_at_qmax(backend, dtype, granularity):
    x = (torch.randn(7, 300, generator=torch.Generator().manual_seed(3)) * 4).to(DEVICE)
    q, scale = getattr(ops, f"per_{granularity}_quant")(x, dtype=dtype, backend=backend)
    expanded = reference.expand_group_scales(scale, 300) if granularity == "group" else scale
    back = reference.dequantize(q, scale, 128 if granularity == "group" else None)
    if dtype == INT8:  # half a step, plus fp32 rounding
        bound = expanded * 0.5 * (1 + 1e-5)
    else:  # half an fp8 step: 2**-4 of the value, or 2**-10 * scale below the smallest normal
        bound = torch.maximum(x.abs() * 2**-4, expanded * 2**-10) * (1 + 1e-5)
    assert bool(((back - x).abs() <= bound).all())
    assert q.float().abs().max().item() == reference.qmax(dtype)  # the amax lands on ±qmax


@needs_triton
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 100), (7, 300), (33, 256)])
def test_triton_equals_the_twin_bit_for_bit(dtype, x_dtype, rows, cols):
    x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)) * 3).to(DEVICE, x_dtype)
    x[0, : cols // 3] = 0.0
    for granularity in ("tensor", "token", "group"):
        call = getattr(ops, f"per_{granularity}_quant")
        with trace_backends() as calls:
            q, scale = call(x, dtype=dtype, backend="triton")
        want_q, want_scale = getattr(reference, f"per_{granularity}_quant")(x, dtype)
        assert calls[0][1] == "triton" and q.dtype == dtype and scale.dtype == torch.float32
        assert torch.equal(_bits(q), _bits(want_q)), granularity
        assert torch.equal(scale, want_scale), granularity


def _assert_triton_equals_the_twin(x, dtype):
    """Bit for bit where x is finite. An infinite x quantizes inf / inf: NaN, whose fp8 byte is the platform's
    (x86 divides into a negative NaN, CUDA into a positive one; the interpreter's cast makes it a number),
    and whose int8 is the cast's; on a GPU the fp8 byte must still be a NaN."""
    finite = x.isfinite()
    for granularity in ("tensor", "token", "group"):
        q, scale = getattr(ops, f"per_{granularity}_quant")(x, dtype=dtype, backend="triton")
        want_q, want_scale = getattr(reference, f"per_{granularity}_quant")(x, dtype)
        assert torch.equal(_bits(q)[finite], _bits(want_q)[finite]), granularity
        assert torch.equal(scale, want_scale), granularity
        if ON_GPU and dtype == FP8:
            assert bool(q.float()[~finite].isnan().all()), granularity


@needs_triton
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_triton_divisions_equal_the_twins_at_signed_zeros_an_infinity_and_all_ones_significands(dtype):
    cols, g = 300, torch.Generator().manual_seed(5)
    binades = torch.arange(cols, dtype=torch.float32) % 60 - 40
    x = torch.stack([
        torch.where(torch.arange(cols) % 2 == 0, -0.0, 0.0),  # an all-zero row of both signs
        torch.cat([torch.tensor([-0.0, 0.0, -1e-30, 1e-30, -1e-42]), torch.randn(cols - 5, generator=g)]),
        torch.cat([torch.tensor([math.inf]), torch.randn(cols - 1, generator=g)]),  # an infinity: the scale inf
        (2 - torch.arange(1, cols + 1, dtype=torch.float32) * 2**-23) * torch.exp2(binades),  # significands ~1.11..1
        (1 + torch.rand(cols, generator=g)) * torch.exp2(binades) * (-1) ** binades,  # 60 binades, both signs
    ]).to(DEVICE)
    _assert_triton_equals_the_twin(x, dtype)


@needs_triton
@settings(deadline=None, max_examples=25)
@given(values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=300),
       rows=st.integers(1, 3))
def test_triton_equals_the_twin_bit_for_bit_on_any_finite_fp32_rows(values, rows):
    # each row the values rotated by one and halved: other groups and amaxes, and the smallest go subnormal
    x = torch.stack([torch.tensor(values, dtype=torch.float32).roll(r) * 2.0**-r for r in range(rows)])
    for dtype in QUANT_DTYPES:
        _assert_triton_equals_the_twin(x.to(DEVICE), dtype)


@needs_triton
@settings(deadline=None, max_examples=25)
@given(values=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=300),
       scale=st.floats(min_value=2.0**-20, max_value=2.0**20, width=32))
@example(values=[3e38, -3e38, math.inf, -math.inf, 1e30, 0.0, -0.0, 1.0], scale=1e-3)  # quotients past fp32
def test_triton_static_scale_equals_the_twin_bit_for_bit_for_any_values_and_scale(values, scale):
    # A static scale does not bound the quotient: infinities and quotients past fp32's range clamp to the
    # format's largest value, as the twin's x / scale then clamp does.
    x = torch.tensor([values], dtype=torch.float32, device=DEVICE)
    static = torch.tensor([scale], device=DEVICE)
    for dtype in QUANT_DTYPES:
        q, _ = ops.per_tensor_quant(x, dtype=dtype, scale=static, backend="triton")
        want, _ = reference.per_tensor_quant(x, dtype, static)
        assert torch.equal(_bits(q), _bits(want))


@needs_triton
@pytest.mark.parametrize("rows, cols", [(5, 9000), (37, 700)])
def test_triton_group_sizes_other_than_128_strided_rows_short_and_long(rows, cols):
    # rows padded; per-token: 9000 columns read twice in 3 steps of 4096 each, 700 read once
    x = non_contiguous_rows(torch.randn(rows, cols, device=DEVICE))
    for dtype in QUANT_DTYPES:
        for call, twin in ((lambda t: ops.per_token_quant(t, dtype=dtype, backend="triton"),
                            lambda t: reference.per_token_quant(t, dtype)),
                           (lambda t: ops.per_group_quant(t, dtype=dtype, group_size=96, backend="triton"),
                            lambda t: reference.per_group_quant(t, dtype, 96))):
            (q, scale), (want_q, want_scale) = call(x), twin(x)
            assert torch.equal(q.float(), want_q.float()) and torch.equal(scale, want_scale)


def test_non_contiguous_last_dim_falls_back_to_torch_unless_triton_named():
    x = torch.randn(64, 6, device=DEVICE).t()  # [6, 64], last-dim stride 6
    with trace_backends() as calls:
        q, _ = ops.per_token_quant(x)
    assert calls == [("per_token_quant", "torch")]
    assert torch.equal(q.float(), reference.per_token_quant(x, FP8)[0].float())
    if backend_available("triton"):
        with pytest.raises(BackendUnavailable, match="last dim of x contiguous"):
            ops.per_token_quant(x, backend="triton")


def test_aiter_and_triton_refusals():
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    q8, qf = torch.empty(4, 256, dtype=INT8), torch.empty(4, 256, dtype=FP8)
    scale = torch.empty(4, 1)
    assert "rounding" in quant_module._aiter_supports(x, q8, scale)
    assert "e4m3fnuz" in quant_module._aiter_supports(x, qf, scale)  # a CPU tensor: no e4m3fn GPU
    assert quant_module._triton_supports(x, qf, scale) is None  # the interpreter takes fp8 on the CPU


def test_aiter_rules_on_an_e4m3fn_gpu(monkeypatch):
    monkeypatch.setattr(quant_module, "fp8_e4m3fn_native", lambda device: True)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    q, scale = torch.empty(4, 256, dtype=FP8), torch.empty(4, 2)
    assert quant_module._aiter_supports(x, q, scale) is None
    assert "fp16/bf16" in quant_module._aiter_supports(x.float(), q, scale)
    assert "contiguous" in quant_module._aiter_supports(non_contiguous_rows(x), q, scale)
    assert quant_module._aiter_group_supports(x, 128, q, scale) is None
    assert "multiple of group_size" in quant_module._aiter_group_supports(x[:, :200].contiguous(), 128, q, scale)
    assert "32, 64 or 128" in quant_module._aiter_group_supports(x, 256, q, scale)


def test_compiles_with_fullgraph():
    def quantize_all(x):
        outs = (ops.per_tensor_quant(x, backend="torch"), ops.per_token_quant(x, dtype=INT8, backend="torch"),
                ops.per_group_quant(x, backend="torch"))
        return [t.float() for pair in outs for t in pair]

    x = torch.randn(3, 200)
    for got, want in zip(torch.compile(quantize_all, fullgraph=True, backend="aot_eager")(x), quantize_all(x)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.per_token_quant(torch.randn(8)), "x must have 2 dims"),
        (lambda: ops.per_token_quant(torch.randn(2, 8).long()), "x dtype"),
        (lambda: ops.per_token_quant(torch.randn(2, 8), dtype=torch.float16), "dtype must be one of"),
        (lambda: ops.per_group_quant(torch.randn(2, 8), group_size=0), "group_size must be a positive int"),
        (lambda: ops.per_tensor_quant(torch.randn(2, 8), scale=torch.ones(2)), "scale must be one fp32 element"),
        (lambda: ops.per_tensor_quant(torch.randn(2, 8), scale=torch.ones(1).half()), "scale dtype"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
