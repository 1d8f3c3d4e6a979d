"""rms_norm_quant and silu_and_mul_quant: the activation and its per-group (or per-token) quantization.

The twins are the two-op pipelines (``per_group_quant(rms_norm(...))``, ``per_group_quant(silu_and_mul(x))``),
checked bit for bit against the public ops with backend="torch". The Triton kernels are checked against
the twins within ``close_quantized`` (the selftest's bound: the activation within the tolerance of the
unfused op, then one step of the format), and bit for bit against the Triton two-op pipeline, which
they reproduce step by step: in the interpreter here, on a GPU in the GPU test.

Inputs: rows of scale 2 with one all-zero row (a padding token), weights in [0.5, 1.5]; D = 96 (one
short group), 200 (a short last group) and 256; groups of 128 and one group per row (per-token).
"""

import pytest
import torch

from atom_core import ops
from atom_core.ops import norm_quant as norm_quant_module
from atom_core.ops.dispatch import BackendUnavailable, backend_available, trace_backends
from atom_core.ops.reference import norm_quant as reference
from atom_core.ops.reference.quant import AMAX_FLOOR, qmax
from atom_core.ops.selftest_cases_norm_quant import close_quantized
from tests.ops.conftest import DEVICE, DTYPES, ON_GPU, needs_gpu, needs_triton, non_contiguous_rows

FP8, INT8 = torch.float8_e4m3fn, torch.int8
QUANT_DTYPES = [FP8, INT8]
EPS = 1e-6
GROUPS = ["128", "row"]  # groups of 128, or one group per row (group_size = the row's length)
VARIANTS = ["plain", "residual", "residual+gemma"]
NORM_SHAPES = [(1, 96), (33, 200), (33, 256)]
SILU_SHAPES = [(1, 96), (33, 200), (3, 2500)]  # (T, I); I = 2500: groups of 128 over three programs a row


def _group_size(group: str, length: int) -> int:
    return 128 if group == "128" else length


def _norm_inputs(rows, hidden, dtype, variant="plain", seed=0):
    """x [T, D] (row T // 2 all zero), weight [D], residual [T, D] (zero in that row too) or None."""
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(rows, hidden, generator=g)
    weight = 0.5 + torch.rand(hidden, generator=g)
    residual = torch.randn(rows, hidden, generator=g) if variant != "plain" else None
    x[rows // 2] = 0.0
    if residual is not None:
        residual[rows // 2] = 0.0
    return (x.to(DEVICE, dtype), weight.to(DEVICE, dtype),
            None if residual is None else residual.to(DEVICE, dtype))


def _silu_input(rows, inter, dtype, seed=0):
    x = 2 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(seed))
    x[rows // 2] = 0.0
    return x.to(DEVICE, dtype)


def _assert_same_bits(got: tuple, want: tuple):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        if a.dtype == FP8:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), f"output {i}: {int((a != b).sum())} of {a.numel()} differ"


def _norm_then_quant(x, weight, residual, gemma, group_size, dtype, backend, per_token=False):
    """The unfused pipeline: ops.rms_norm, then ops.per_group_quant (or ops.per_token_quant)."""
    normed = ops.rms_norm(x, weight, EPS, residual=residual, gemma=gemma, backend=backend)
    out, rest = (normed, ()) if residual is None else (normed[0], (normed[1],))
    if per_token:
        return (*ops.per_token_quant(out, dtype=dtype, backend=backend), *rest)
    return (*ops.per_group_quant(out, dtype=dtype, group_size=group_size, backend=backend), *rest)


def _silu_then_quant(x, group_size, dtype, backend, per_token=False):
    act = ops.silu_and_mul(x, backend=backend)
    if per_token:
        return ops.per_token_quant(act, dtype=dtype, backend=backend)
    return ops.per_group_quant(act, dtype=dtype, group_size=group_size, backend=backend)


# ---------------------------------------------------------------- the definition (twin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_definition_twin_is_per_group_quant_of_rms_norm_bit_for_bit(dtype, quant_dtype, group, variant):
    rows, hidden = 33, 200
    x, weight, residual = _norm_inputs(rows, hidden, dtype, variant, seed=1)
    gemma, group_size = variant.endswith("gemma"), _group_size(group, hidden)
    want = _norm_then_quant(x, weight, residual, gemma, group_size, quant_dtype, "torch")
    with trace_backends() as calls:
        got = ops.rms_norm_quant(x, weight, EPS, residual=residual, gemma=gemma, group_size=group_size,
                                 dtype=quant_dtype, backend="torch")
    assert calls == [("rms_norm_quant", "torch")]
    _assert_same_bits(got, want)
    _assert_same_bits(got, reference.rms_norm_quant(x, weight, EPS, residual, gemma, group_size, quant_dtype))
    assert got[1].shape == (rows, 2 if group == "128" else 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("group", GROUPS)
def test_definition_twin_is_per_group_quant_of_silu_and_mul_bit_for_bit(dtype, quant_dtype, group):
    rows, inter = 33, 200
    x = _silu_input(rows, inter, dtype, seed=2)
    group_size = _group_size(group, inter)
    with trace_backends() as calls:
        got = ops.silu_and_mul_quant(x, group_size=group_size, dtype=quant_dtype, backend="torch")
    assert calls == [("silu_and_mul_quant", "torch")]
    _assert_same_bits(got, _silu_then_quant(x, group_size, quant_dtype, "torch"))
    _assert_same_bits(got, reference.silu_and_mul_quant(x, group_size, quant_dtype))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_one_group_per_row_is_per_token_quant_bit_for_bit(backend, quant_dtype):
    # group_size = D, or any size past it: one scale per row, [T, 1], as per_token_quant gives it.
    x, weight, residual = _norm_inputs(9, 200, torch.bfloat16, "residual", seed=3)
    want = _norm_then_quant(x, weight, residual, False, None, quant_dtype, backend, per_token=True)
    for group_size in (200, 256, 4096, 300):
        got = ops.rms_norm_quant(x, weight, EPS, residual=residual, group_size=group_size, dtype=quant_dtype,
                                 backend=backend)
        _assert_same_bits(got, want)
    silu_x = _silu_input(9, 200, torch.bfloat16, seed=4)
    want = _silu_then_quant(silu_x, None, quant_dtype, backend, per_token=True)
    for group_size in (200, 512):
        _assert_same_bits(ops.silu_and_mul_quant(silu_x, group_size=group_size, dtype=quant_dtype, backend=backend),
                          want)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_an_all_zero_row_quantizes_to_zero_with_the_floor_scale(backend, quant_dtype):
    x, weight, residual = _norm_inputs(3, 200, torch.float32, "residual", seed=5)  # row 1: x and residual zero
    floor = torch.tensor(AMAX_FLOOR) / torch.tensor(qmax(quant_dtype))  # fp32, one IEEE division
    for group_size in (128, 200):
        for got in (ops.rms_norm_quant(x, weight, EPS, residual=residual, group_size=group_size, dtype=quant_dtype,
                                       backend=backend),
                    ops.silu_and_mul_quant(torch.cat([x, x], 1), group_size=group_size, dtype=quant_dtype,
                                           backend=backend)):
            q, scale = got[:2]
            assert not q[1].float().any() and torch.equal(scale[1].cpu(), floor.expand_as(scale[1]))
            assert bool((scale[0] > floor).all())


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_normed_receives_the_rows_rms_norm_returns_bit_for_bit_in_the_same_call(backend, variant, dtype):
    x, weight, residual = _norm_inputs(33, 200, dtype, variant, seed=11)
    gemma = variant.endswith("gemma")
    normed = torch.full_like(x, float("nan"))
    with trace_backends() as calls:
        got = ops.rms_norm_quant(x, weight, EPS, residual=residual, gemma=gemma, group_size=128, normed=normed,
                                 backend=backend)
    assert calls == [("rms_norm_quant", backend)]
    want = ops.rms_norm(x, weight, EPS, residual=residual, gemma=gemma, backend=backend)
    assert torch.equal(normed, want if residual is None else want[0])
    _assert_same_bits(got, ops.rms_norm_quant(x, weight, EPS, residual=residual, gemma=gemma, group_size=128,
                                              backend=backend))


def test_normed_of_another_shape_or_dtype_is_refused_by_name():
    x, weight, _ = _norm_inputs(3, 96, torch.bfloat16)
    for bad in (torch.empty(3, 95, dtype=torch.bfloat16), torch.empty(3, 96, dtype=torch.float32)):
        with pytest.raises((ValueError, TypeError), match="normed"):
            ops.rms_norm_quant(x, weight, EPS, normed=bad.to(DEVICE))


# ---------------------------------------------------------------- Triton kernels


SHAPES_GPU = [(1, 4096), (33, 5120), (4096, 4096), (257, 7168), (64, 14336)] if ON_GPU else []


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "T{}-D{}".format(*s))
def test_rms_norm_quant_triton_matches_twin(dtype, quant_dtype, group, variant, shape):
    x, weight, residual = _norm_inputs(*shape, dtype, variant, seed=shape[0] * shape[1])
    gemma, group_size = variant.endswith("gemma"), _group_size(group, shape[1])
    with trace_backends() as calls:
        got = ops.rms_norm_quant(x, weight, EPS, residual=residual, gemma=gemma, group_size=group_size,
                                 dtype=quant_dtype, backend="triton")
    assert calls == [("rms_norm_quant", "triton")]
    want = reference.rms_norm_quant(x, weight, EPS, residual, gemma, group_size, quant_dtype)
    assert close_quantized(got, want, dtype, quant_dtype, group_size) is None


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=lambda s: "T{}-I{}".format(*s))
def test_silu_and_mul_quant_triton_matches_twin(dtype, quant_dtype, group, shape):
    x = _silu_input(*shape, dtype, seed=shape[0] + shape[1])
    group_size = _group_size(group, shape[1])
    with trace_backends() as calls:
        got = ops.silu_and_mul_quant(x, group_size=group_size, dtype=quant_dtype, backend="triton")
    assert calls == [("silu_and_mul_quant", "triton")]
    want = reference.silu_and_mul_quant(x, group_size, quant_dtype)
    assert close_quantized(got, want, dtype, quant_dtype, group_size) is None


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", NORM_SHAPES + SHAPES_GPU, ids=lambda s: "T{}-D{}".format(*s))
def test_rms_norm_quant_triton_equals_triton_rms_norm_then_per_group_quant_bit_for_bit(dtype, quant_dtype, group,
                                                                                       variant, shape):
    x, weight, residual = _norm_inputs(*shape, dtype, variant, seed=shape[0] + shape[1])
    gemma, group_size = variant.endswith("gemma"), _group_size(group, shape[1])
    got = ops.rms_norm_quant(x, weight, EPS, residual=residual, gemma=gemma, group_size=group_size,
                             dtype=quant_dtype, backend="triton")
    _assert_same_bits(got, _norm_then_quant(x, weight, residual, gemma, group_size, quant_dtype, "triton"))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("shape", SILU_SHAPES + SHAPES_GPU, ids=lambda s: "T{}-I{}".format(*s))
def test_silu_and_mul_quant_triton_equals_triton_silu_and_mul_then_per_group_quant_bit_for_bit(
        dtype, quant_dtype, group, shape):
    x = _silu_input(*shape, dtype, seed=shape[0] * 7 + shape[1])
    group_size = _group_size(group, shape[1])
    got = ops.silu_and_mul_quant(x, group_size=group_size, dtype=quant_dtype, backend="triton")
    _assert_same_bits(got, _silu_then_quant(x, group_size, quant_dtype, "triton"))


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_gpu_fused_equals_the_triton_two_op_pipeline_bit_for_bit_at_model_sizes(dtype, quant_dtype):
    # Llama-3-8B (D 4096, I 14336), Qwen3-32B (D 5120), DeepSeek-V3 (D 7168, its MoE I 2048) at decode and
    # prefill token counts, groups of 128 and per-token, with and without a residual.
    for tokens in (1, 33, 4096):
        for hidden in (4096, 5120, 7168):
            for group in GROUPS:
                group_size = _group_size(group, hidden)
                for variant in ("plain", "residual"):
                    x, weight, residual = _norm_inputs(tokens, hidden, dtype, variant, seed=tokens + hidden)
                    got = ops.rms_norm_quant(x, weight, EPS, residual=residual, group_size=group_size,
                                             dtype=quant_dtype, backend="triton")
                    _assert_same_bits(got, _norm_then_quant(x, weight, residual, False, group_size, quant_dtype,
                                                            "triton"))
        for inter in (14336, 2048):
            for group in GROUPS:
                group_size = _group_size(group, inter)
                x = _silu_input(tokens, inter, dtype, seed=tokens + inter)
                got = ops.silu_and_mul_quant(x, group_size=group_size, dtype=quant_dtype, backend="triton")
                _assert_same_bits(got, _silu_then_quant(x, group_size, quant_dtype, "triton"))


@needs_triton
@pytest.mark.parametrize("group_size", [64, 256, 2048])
def test_silu_and_mul_quant_triton_group_sizes_over_programs_of_a_row(group_size):
    # I = 2500: chunks of 1024 values (of one group of 2048) a program, the last chunk and group short.
    x = _silu_input(3, 2500, torch.bfloat16, seed=group_size)
    got = ops.silu_and_mul_quant(x, group_size=group_size, backend="triton")
    assert got[1].shape == (3, -(-2500 // group_size))
    _assert_same_bits(got, _silu_then_quant(x, group_size, FP8, "triton"))
    assert close_quantized(got, reference.silu_and_mul_quant(x, group_size), torch.bfloat16, FP8, group_size) is None


@needs_triton
def test_triton_strided_rows_and_fp32_weight_on_bf16_rows():
    x, weight, residual = _norm_inputs(19, 200, torch.bfloat16, "residual", seed=6)
    x, residual, weight = non_contiguous_rows(x), non_contiguous_rows(residual), weight.float()
    got = ops.rms_norm_quant(x, weight, EPS, residual=residual, backend="triton")
    _assert_same_bits(got, _norm_then_quant(x, weight, residual, False, 128, FP8, "triton"))
    silu_x = non_contiguous_rows(_silu_input(19, 200, torch.bfloat16, seed=7))
    _assert_same_bits(ops.silu_and_mul_quant(silu_x, backend="triton"), _silu_then_quant(silu_x, 128, FP8, "triton"))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_empty_batch(backend):
    x, weight, residual = _norm_inputs(3, 200, torch.float32, "residual")
    q, scale, residual_out = ops.rms_norm_quant(x[:0], weight, EPS, residual=residual[:0], backend=backend)
    assert q.shape == (0, 200) and q.dtype == FP8 and scale.shape == (0, 2) and residual_out.shape == (0, 200)
    q, scale = ops.silu_and_mul_quant(x[:0], dtype=INT8, backend=backend)
    assert q.shape == (0, 100) and q.dtype == INT8 and scale.shape == (0, 1)


# ---------------------------------------------------------------- dispatch


@needs_triton
def test_auto_dispatch_picks_triton_where_triton_runs():
    x, weight, residual = _norm_inputs(5, 200, torch.bfloat16, "residual")
    with trace_backends() as calls:
        ops.rms_norm_quant(x, weight, EPS, residual=residual)
        ops.silu_and_mul_quant(x)
    assert calls == [("rms_norm_quant", "triton"), ("silu_and_mul_quant", "triton")]


def test_a_transposed_input_falls_back_to_torch_unless_triton_is_named():
    x = torch.randn(200, 6, device=DEVICE).t()  # last dim not contiguous
    weight = torch.ones(200, device=DEVICE)
    with trace_backends() as calls:
        got = ops.rms_norm_quant(x, weight, EPS)
        ops.silu_and_mul_quant(x)
    assert calls == [("rms_norm_quant", "torch"), ("silu_and_mul_quant", "torch")]
    _assert_same_bits(got, reference.rms_norm_quant(x, weight, EPS))
    if backend_available("triton"):
        with pytest.raises(BackendUnavailable, match="last dim of x, weight and residual contiguous"):
            ops.rms_norm_quant(x, weight, EPS, backend="triton")
        with pytest.raises(BackendUnavailable, match="last dim of x contiguous"):
            ops.silu_and_mul_quant(x, backend="triton")


def test_triton_refuses_a_row_past_one_program():
    big = norm_quant_module.TRITON_MAX_HIDDEN + 1
    x, q, scale = torch.empty(2, big, device="meta"), torch.empty(2, big, dtype=FP8), torch.empty(2, 1)
    reason = norm_quant_module._triton_rms_supports(x, torch.empty(big), EPS, None, False, big, q, scale, None, None)
    assert reason == f"row length {big} exceeds one row per program ({big - 1})"
    wide = torch.empty(2, 2 * big, device="meta")
    assert norm_quant_module._triton_silu_supports(wide, big, q, scale) == reason
    assert norm_quant_module._triton_silu_supports(wide[:, : 2 * (big - 1)], big, q, scale) is None


def test_there_is_no_aiter_backend_and_a_named_one_says_so():
    # The module docstring says why (no per-group fused AITER kernel to adapt; auto would prefer a composition).
    assert norm_quant_module.RMS_NORM_QUANT.backends == ["triton", "torch"]
    assert norm_quant_module.SILU_AND_MUL_QUANT.backends == ["triton", "torch"]
    with pytest.raises(BackendUnavailable, match="has no aiter implementation"):
        ops.rms_norm_quant(torch.randn(2, 8), torch.ones(8), EPS, backend="aiter")


# ---------------------------------------------------------------- torch.compile, argument checks


def test_compiles_with_fullgraph():
    x, weight, residual = _norm_inputs(3, 200, torch.float32, "residual", seed=8)
    x, weight, residual = x.cpu(), weight.cpu(), residual.cpu()

    def layer(x, residual):
        q, scale, residual_out = ops.rms_norm_quant(x, weight, EPS, residual=residual, backend="torch")
        q2, scale2 = ops.silu_and_mul_quant(torch.cat([x, residual], 1), dtype=INT8, backend="torch")
        return [q.float(), scale, residual_out, q2.float(), scale2]

    for got, want in zip(torch.compile(layer, fullgraph=True, backend="aot_eager")(x, residual), layer(x, residual)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("group_size", [96, 100, 3, 0, -128, 1.5, True, None])
def test_a_group_size_neither_a_power_of_two_nor_the_row_is_refused_even_with_debug_checks_off(group_size):
    x = torch.randn(2, 200)
    with ops.debug_checks(False):
        with pytest.raises(ValueError, match=rf"group_size must be a power of two or at least the row length 200, "
                                             rf"got {group_size!r}"):
            ops.rms_norm_quant(x, torch.ones(200), EPS, group_size=group_size)
        with pytest.raises(ValueError, match="at least the row length 100"):
            ops.silu_and_mul_quant(x, group_size=group_size if group_size != 100 else 96)


def _norm_call(x=None, weight=None, residual=None, eps=EPS, **kw):
    return lambda: ops.rms_norm_quant(torch.randn(2, 8) if x is None else x,
                                      torch.ones(8) if weight is None else weight, eps, residual=residual, **kw)


@pytest.mark.parametrize("call, match", [
    (_norm_call(x=torch.randn(8)), "x must have 2 dims"),
    (_norm_call(x=torch.randn(2, 8).int()), "x dtype"),
    (_norm_call(weight=torch.ones(9)), r"weight must have shape \(8,\)"),
    (_norm_call(residual=torch.randn(2, 8).half()), "residual dtype"),
    (_norm_call(residual=torch.randn(3, 8)), "residual must have shape"),
    (_norm_call(weight=torch.ones(8, device="meta")), "tensors must be on one device"),
    (_norm_call(eps=0.0), r"eps must be > 0, got 0\.0"),
    (_norm_call(dtype=torch.float16), "dtype must be one of"),
    (lambda: ops.silu_and_mul_quant(torch.randn(2, 9)), "even number of columns"),
    (lambda: ops.silu_and_mul_quant(torch.randn(2, 8).long()), "x dtype"),
    (lambda: ops.silu_and_mul_quant(torch.randn(2, 8), dtype=torch.bfloat16), "dtype must be one of"),
    (_norm_call(backend="gpu"), "unknown backend"),
])
def test_bad_arguments_are_named(call, match):
    with ops.debug_checks(), pytest.raises((ValueError, TypeError), match=match):
        call()
