"""Scaled GEMMs: the twins against an independent float64 computation, Triton against the twins over
odd shapes, every output dtype, bias, strided operands, and the quantize-then-GEMM path against the
unquantized product."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_core import ops
from atom_core.ops.dispatch import trace_backends
from atom_core.ops.reference import quant as reference_quant
from atom_core.ops.reference import scaled_mm as reference
from atom_core.ops.tolerances import SCALED_MM, tolerance
from tests.ops.conftest import DEVICE, needs_triton, non_contiguous_rows

FP8, INT8 = torch.float8_e4m3fn, torch.int8
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
OUT_DTYPES = [FP32, FP16, BF16]


def make_inputs(fmt: str, quant_dtype, m: int, n: int, k: int, *, bias: bool = False, seed: int = 0):
    """(a, a_scale, w, w_scale, bias) in ``fmt``'s layouts, quantized by the twins (outputs of order 1)."""
    g = torch.Generator().manual_seed(seed)
    a, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k ** -0.5
    if fmt == "block":
        (a_q, a_scale), (w_q, w_scale) = reference_quant.per_group_quant(a, FP8), reference_quant.per_block_quant(w)
    elif fmt == "per_token":
        (a_q, a_scale), (w_q, w_scale) = (reference_quant.per_token_quant(t, quant_dtype) for t in (a, w))
    else:
        (a_q, a_scale), (w_q, w_scale) = (reference_quant.per_tensor_quant(t, quant_dtype) for t in (a, w))
    out = a_q, a_scale, w_q, w_scale, torch.randn(n, generator=g) if bias else None
    return tuple(None if t is None else t.to(DEVICE) for t in out)


def _float64_product(a, a_scale_of, w, w_scale_of, bias):
    """out[m][n] = sum_k a[m,k] a_scale_of(m,k) * w[n,k] w_scale_of(n,k) + bias[n], in Python floats."""
    m, k = a.shape
    n = w.shape[0]
    a_deq = [[x * a_scale_of(i, kk) for kk, x in enumerate(row)] for i, row in enumerate(a.double().tolist())]
    w_deq = [[x * w_scale_of(j, kk) for kk, x in enumerate(row)] for j, row in enumerate(w.double().tolist())]
    bias = [0.0] * n if bias is None else bias.double().tolist()
    out = [[sum(x * y for x, y in zip(a_row, w_row)) + bias[j] for j, w_row in enumerate(w_deq)] for a_row in a_deq]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("fmt", ["per_tensor", "per_token", "block"])
def test_twins_equal_an_independent_float64_computation(fmt):
    m, n, k = 3, 130, 260  # block: 2 x 3 weight blocks, the last ones partial
    a, a_scale, w, w_scale, bias = make_inputs(fmt, FP8 if fmt == "block" else INT8, m, n, k, bias=True)
    sa, sw = a_scale.double().tolist(), w_scale.double().tolist()
    if fmt == "per_tensor":
        a_of, w_of = (lambda i, kk: sa[0]), (lambda j, kk: sw[0])
    elif fmt == "per_token":
        a_of, w_of = (lambda i, kk: sa[i][0]), (lambda j, kk: sw[j][0])
    else:
        a_of = lambda i, kk: sa[i][kk // 128]  # noqa: E731
        w_of = lambda j, kk: sw[j // 128][kk // 128]  # noqa: E731
    want = _float64_product(a, a_of, w, w_of, bias)
    got = getattr(reference, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, bias, FP32)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)


def test_block_twin_uses_each_blocks_own_scale():
    # One weight element per 128 x 128 block set to 1, scales 1..4: out = a_scale * w_scale of that block.
    a = torch.zeros(1, 256, dtype=FP8)
    a[0, 0], a[0, 200] = 1.0, 1.0  # groups 0 and 1
    w = torch.zeros(256, 256, dtype=FP8)
    w[0, 0], w[0, 200], w[130, 0], w[130, 200] = 1.0, 1.0, 1.0, 1.0
    a_scale = torch.tensor([[10.0, 100.0]])
    w_scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = reference.scaled_mm_block(a, a_scale, w, w_scale, None, FP32)
    assert out[0, 0].item() == 10 * 1 + 100 * 2 and out[0, 130].item() == 10 * 3 + 100 * 4


@needs_triton
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("quant_dtype", [FP8, INT8])
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("n, k", [(48, 100), (200, 300)])  # K off the 128 grid
def test_triton_per_token_matches_twin(out_dtype, quant_dtype, m, n, k):
    args = make_inputs("per_token", quant_dtype, m, n, k, bias=m == 7, seed=m * k)
    with trace_backends() as calls:
        got = ops.scaled_mm_per_token(*args[:4], out_dtype=out_dtype, bias=args[4], backend="triton")
    assert calls == [("scaled_mm_per_token", "triton")] and got.shape == (m, n) and got.dtype == out_dtype
    torch.testing.assert_close(got, reference.scaled_mm_per_token(*args, out_dtype), **tolerance(out_dtype, SCALED_MM))


@needs_triton
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("quant_dtype", [FP8, INT8])
@pytest.mark.parametrize("m", [1, 33])
def test_triton_per_tensor_matches_twin(out_dtype, quant_dtype, m):
    args = make_inputs("per_tensor", quant_dtype, m, 72, 200, bias=m == 1, seed=m)
    got = ops.scaled_mm_per_tensor(*args[:4], out_dtype=out_dtype, bias=args[4], backend="triton")
    torch.testing.assert_close(got, reference.scaled_mm_per_tensor(*args, out_dtype), **tolerance(out_dtype, SCALED_MM))


@needs_triton
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("n, k", [(256, 256), (200, 300)])  # multiples of 128, and partial blocks in N and K
def test_triton_block_matches_twin(out_dtype, m, n, k):
    args = make_inputs("block", FP8, m, n, k, bias=m == 7, seed=m + n)
    got = ops.scaled_mm_block(*args[:4], out_dtype=out_dtype, bias=args[4], backend="triton")
    torch.testing.assert_close(got, reference.scaled_mm_block(*args, out_dtype), **tolerance(out_dtype, SCALED_MM))


@needs_triton
@pytest.mark.parametrize("fmt", ["per_tensor", "per_token", "block"])
@pytest.mark.parametrize("split_k, k", [(2, 256), (3, 300), (4, 700)])  # 700: 6 groups in 3 ranges of 2
def test_triton_split_k_partials_sum_to_the_twin(fmt, split_k, k, monkeypatch):
    from atom_core.ops.triton import scaled_mm as triton_scaled_mm

    sums = []
    kernel = triton_scaled_mm._sum_splits_kernel

    class Counted:
        def __getitem__(self, grid):
            sums.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_scaled_mm, "_sum_splits_kernel", Counted())
    args = make_inputs(fmt, FP8, 5, 200, k, bias=True, seed=k)
    config = triton_scaled_mm.LaunchConfig(16, 64, 64, 4, 1, split_k=split_k)
    kind = {"per_tensor": triton_scaled_mm.PER_TENSOR, "per_token": triton_scaled_mm.PER_TOKEN,
            "block": triton_scaled_mm.BLOCKWISE}[fmt].value
    got = triton_scaled_mm._scaled_mm(kind, *args, FP32, config)
    assert len(sums) == 1, "the partial products were not summed by the split-K reduction"
    want = getattr(reference, f"scaled_mm_{fmt}")(*args, FP32)
    torch.testing.assert_close(got, want, **tolerance(FP32, SCALED_MM))


@needs_triton
@pytest.mark.parametrize("fmt", ["per_tensor", "per_token", "block"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("n, k, block_n, block_k, warps", [
    (256, 512, 16, 256, 4),   # whole tiles: the unmasked loop, two 128-wide groups per K step
    (200, 300, 8, 256, 4),    # partial tiles in N and K, the last group partial
    (130, 1000, 32, 512, 4),  # a tile's 32 rows inside one 128-row weight block; 128 values a thread: each
                              # step summed over K (the other tiles keep the 2D accumulator)
    (96, 1300, 8, 256, 4),    # six K steps, the last 20 columns wide (a partial group)
    (64, 100, 8, 256, 4),     # one K step, shorter than one group
    (98, 2300, 4, 1024, 2),   # the GPU launches' shapes: 4-row tiles (the last one partial), 2 warps, 64 values
                              # a thread (2D accumulator), K in three steps of eight groups, the last partial
    (40, 2200, 8, 2048, 2),   # 8 x 2048 on 2 warps: 256 values a thread, so each step summed over K
    (64, 4096, 8, 2048, 4),   # 8 x 2048 on 4 warps (N >= 16,384 on the GPU): 128 values a thread, unmasked
    (64, 4096, 4, 2048, 2),   # 4 x 2048 on 2 warps (N >= 5120 on the GPU), whole tiles: the unmasked loop
    (24, 4000, 8, 4096, 8),   # 8 x 4096 on 8 warps (N = 4096, K <= 4096): the whole row in one K step, partial
])
def test_triton_gemv_launch_matches_twin_with_random_group_scales(fmt, out_dtype, n, k, block_n, block_k, warps):
    # The GEMV kernel (block_m = 1) folds the block format's scales into the activation per k: each group's
    # and block's scale times its own random factor in [0.5, 1.5) makes a wrong group or block off by a
    # whole factor (outputs stay of order 1, so fp32's summation order is all that differs from the twin).
    from atom_core.ops.triton import scaled_mm as triton_scaled_mm

    a, a_scale, w, w_scale, bias = make_inputs(fmt, FP8, 1, n, k, bias=out_dtype != FP32, seed=n + k)
    g = torch.Generator().manual_seed(n)
    a_scale = a_scale * (torch.rand(a_scale.shape, generator=g) + 0.5).to(DEVICE)
    w_scale = w_scale * (torch.rand(w_scale.shape, generator=g) + 0.5).to(DEVICE)
    kind = {"per_tensor": triton_scaled_mm.PER_TENSOR, "per_token": triton_scaled_mm.PER_TOKEN,
            "block": triton_scaled_mm.BLOCKWISE}[fmt].value
    config = triton_scaled_mm.LaunchConfig(1, block_n, block_k, warps, 2)
    got = triton_scaled_mm._scaled_mm(kind, a, a_scale, w, w_scale, bias, out_dtype, config)
    want = getattr(reference, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, bias, out_dtype)
    assert got.shape == (1, n) and got.dtype == out_dtype
    torch.testing.assert_close(got, want, **tolerance(out_dtype, SCALED_MM))


@needs_triton
def test_triton_gemv_launch_refuses_what_it_cannot_serve():
    from atom_core.ops.triton import scaled_mm as triton_scaled_mm

    gemv = triton_scaled_mm.LaunchConfig(1, 16, 256, 4, 2)
    block = make_inputs("block", FP8, 2, 64, 256)
    with pytest.raises(ValueError, match="one fp8 row"):
        triton_scaled_mm._scaled_mm(triton_scaled_mm.BLOCKWISE.value, *block, BF16, gemv)
    int8 = make_inputs("per_token", INT8, 1, 64, 256)
    with pytest.raises(ValueError, match="one fp8 row"):
        triton_scaled_mm._scaled_mm(triton_scaled_mm.PER_TOKEN.value, *int8, BF16, gemv)
    with pytest.raises(ValueError, match="block_n dividing 128"):
        triton_scaled_mm._scaled_mm(triton_scaled_mm.BLOCKWISE.value, *make_inputs("block", FP8, 1, 96, 256), BF16,
                                    triton_scaled_mm.LaunchConfig(1, 96, 256, 4, 2))


@needs_triton
def test_triton_block_scales_vary_across_groups_and_blocks():
    # Random scales per group and block (not the ones quantization produced): a kernel that reads the
    # wrong group or block is off by whole factors.
    a, _, w, _, _ = make_inputs("block", FP8, 5, 300, 400)
    g = torch.Generator().manual_seed(9)
    a_scale = (torch.rand(5, 4, generator=g) + 0.1).to(DEVICE)
    w_scale = (torch.rand(3, 4, generator=g) + 0.1).to(DEVICE)
    got = ops.scaled_mm_block(a, a_scale, w, w_scale, out_dtype=FP32, backend="triton")
    torch.testing.assert_close(got, reference.scaled_mm_block(a, a_scale, w, w_scale, None, FP32),
                               **tolerance(FP32, SCALED_MM))


@needs_triton
@pytest.mark.parametrize("fmt", ["per_tensor", "per_token", "block"])
def test_triton_strided_operands_and_scales(fmt):
    a, a_scale, w, w_scale, bias = make_inputs(fmt, FP8, 9, 140, 260, bias=True)
    a_strided = non_contiguous_rows(a)  # padded rows
    w_transposed = w.t().contiguous().t()  # [N, K] with the K stride N: a column-major weight
    a_scale_strided = a_scale if fmt == "per_tensor" else non_contiguous_rows(a_scale)
    bias_strided = torch.stack([bias, -bias], dim=1)[:, 0]  # every other element of a buffer
    got = getattr(ops, f"scaled_mm_{fmt}")(a_strided, a_scale_strided, w_transposed, w_scale, out_dtype=FP32,
                                           bias=bias_strided, backend="triton")
    want = getattr(reference, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, bias, FP32)
    torch.testing.assert_close(got, want, **tolerance(FP32, SCALED_MM))


@needs_triton
@pytest.mark.parametrize("fmt", ["per_tensor", "per_token", "block"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_with_k_zero_gives_the_bias_alone_as_the_twin(fmt, with_bias):
    a, a_scale, w, w_scale, bias = make_inputs(fmt, FP8, 3, 5, 128, bias=with_bias)
    a, w = a[:, :0], w[:, :0]
    if fmt == "block":
        a_scale, w_scale = a_scale[:, :0], w_scale[:, :0]
    got = getattr(ops, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, out_dtype=BF16, bias=bias, backend="triton")
    torch.testing.assert_close(got, getattr(reference, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, bias, BF16),
                               rtol=0, atol=0)


@needs_triton
def test_triton_fp8_and_int8_dots_are_exact_on_small_integers():
    # Unit scales and small integers: every product and partial sum is exact in fp32 / int32 (fp32 outputs
    # promote every fp8 instruction on a GPU; the interpreter multiplies exactly).
    g = torch.Generator().manual_seed(4)
    one = torch.ones(1, device=DEVICE)
    for dtype in (FP8, INT8):
        a = torch.randint(-8, 9, (17, 300), generator=g).to(DEVICE, dtype)
        w = torch.randint(-8, 9, (40, 300), generator=g).to(DEVICE, dtype)
        got = ops.scaled_mm_per_tensor(a, one, w, one, out_dtype=FP32, backend="triton")
        assert torch.equal(got.double(), a.double() @ w.double().t())


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("fmt, quant_dtype", [("per_tensor", FP8), ("per_token", FP8), ("per_token", INT8),
                                              ("block", FP8)])
def test_quantize_then_gemm_is_close_to_the_unquantized_product(backend, fmt, quant_dtype):
    # The activation is quantized by the op itself; the error is the formats' rounding of both operands.
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 384, generator=g).to(DEVICE)
    weight = (torch.randn(64, 384, generator=g) * 384 ** -0.5).to(DEVICE)
    if fmt == "block":
        (a, a_scale), (w, w_scale) = ops.per_group_quant(x, backend=backend), reference_quant.per_block_quant(weight)
    else:
        quantize = getattr(ops, f"{fmt}_quant")
        a, a_scale = quantize(x, dtype=quant_dtype, backend=backend)
        w, w_scale = getattr(reference_quant, f"{fmt}_quant")(weight, quant_dtype)
    got = getattr(ops, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, out_dtype=FP32, backend=backend)
    exact = x @ weight.t()
    relative = ((got - exact).norm() / exact.norm()).item()
    assert relative < (0.06 if quant_dtype == FP8 else 0.015), relative  # fp8 steps are 2**-3 relative


def test_compiles_with_fullgraph():
    args = make_inputs("per_token", FP8, 3, 32, 64, bias=True)

    def linear(a, a_scale, w, w_scale, bias):
        return ops.scaled_mm_per_token(a, a_scale, w, w_scale, out_dtype=FP32, bias=bias, backend="torch") + 1

    torch.testing.assert_close(torch.compile(linear, fullgraph=True, backend="aot_eager")(*args), linear(*args))


_A, _AS, _W, _WS, _ = make_inputs("per_token", FP8, 2, 16, 32)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.scaled_mm_per_token(_A.float(), _AS, _W, _WS), "a dtype"),
        (lambda: ops.scaled_mm_per_token(_A, _AS, _W.view(torch.int8), _WS), "w dtype"),
        (lambda: ops.scaled_mm_per_token(_A, _AS, _W[:, :16], _WS), "must share K"),
        (lambda: ops.scaled_mm_per_token(_A, _AS.t(), _W, _WS), "a_scale must have shape"),
        (lambda: ops.scaled_mm_per_token(_A, _AS, _W, _WS.half()), "w_scale dtype"),
        (lambda: ops.scaled_mm_per_tensor(_A, _AS, _W, _WS), "one element"),
        (lambda: ops.scaled_mm_block(_A.view(torch.int8), _AS, _W.view(torch.int8), _WS), "a dtype"),
        (lambda: ops.scaled_mm_block(_A, _AS, _W, _WS), "w_scale must have shape"),
        (lambda: ops.scaled_mm_per_token(_A, _AS, _W, _WS, bias=torch.zeros(15)), "bias must have shape"),
        (lambda: ops.scaled_mm_per_token(_A, _AS, _W, _WS, out_dtype=FP8), "out_dtype must be one of"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@given(m=st.one_of(st.just(1), st.integers(1, 20000)), n=st.integers(1, 60000), k=st.integers(1, 20000),
       out_dtype=st.sampled_from(OUT_DTYPES), scales=st.integers(0, 2), num_sms=st.integers(1, 200),
       int8=st.booleans())
@settings(deadline=None)  # the first example imports the Triton module (0.4 s on a GPU machine)
def test_every_gpu_launch_config_is_one_the_kernel_accepts(m, n, k, out_dtype, scales, num_sms, int8):
    from atom_core.ops.triton.scaled_mm import LaunchConfig, launch_config

    config = launch_config(m, n, k, out_dtype, scales, num_sms, False, int8)
    assert isinstance(config, LaunchConfig)
    if config.block_m == 1:  # the GEMV kernel: one fp8 row, K steps of whole groups, a row tile in one block row
        assert m == 1 and not int8 and config.split_k == 1
        assert config.block_k % 128 == 0 and 128 % config.block_n == 0
    else:
        assert 128 % config.block_k == 0  # (the block format's groups)
    assert 1 <= config.split_k <= max(1, -(-k // 128))  # never a K range without a 128-wide group
    # fp32 outputs promote every instruction; otherwise Triton allows at most the dot's K between promotions
    assert config.max_imprecise == 0 if out_dtype == FP32 else (config.max_imprecise or 0) <= config.block_k


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.version.hip is None
                         and torch.cuda.get_device_capability() >= (9, 0)), reason="needs an NVIDIA sm90+ GPU")
@pytest.mark.parametrize("m", [252, 256, 1024, 1030])
def test_on_nvidia_sm90_auto_runs_block_gemms_from_256_rows_on_cublas_and_both_match_the_twin(m):
    from atom_core.ops.scaled_mm import CUBLAS_BLOCK_FROM_ROWS

    a, a_scale, w, w_scale, bias = make_inputs("block", FP8, m, 512, 1024, bias=True, seed=m)
    with trace_backends() as calls:
        got = ops.scaled_mm_block(a, a_scale, w, w_scale, out_dtype=BF16, bias=bias)
    # 1030 is no multiple of 4, which cuBLAS's block-wise kernel refuses: Triton serves it.
    assert calls == [("scaled_mm_block", "scaled_mm" if m >= CUBLAS_BLOCK_FROM_ROWS and m % 4 == 0 else "triton")]
    want = reference.scaled_mm_block(a, a_scale, w, w_scale, bias, BF16)
    torch.testing.assert_close(got, want, **tolerance(BF16, SCALED_MM))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.version.hip is None
                         and torch.cuda.get_device_capability() >= (8, 9)), reason="needs an NVIDIA sm89+ GPU")
@pytest.mark.parametrize("fmt", ["per_token", "block"])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (5120, 2048),
                                  (2048, 4096)])  # Llama-3-8B's and Qwen3-30B-A3B's projections
def test_on_nvidia_gpus_one_row_runs_the_gemv_tile_chosen_for_the_shape_and_matches_the_twin(fmt, n, k):
    from atom_core.ops.triton import scaled_mm as triton_scaled_mm
    from atom_core.ops.triton.launch import num_sms

    a, a_scale, w, w_scale, _ = make_inputs(fmt, FP8, 1, n, k, seed=n + k)
    kind = (triton_scaled_mm.BLOCKWISE if fmt == "block" else triton_scaled_mm.PER_TOKEN).value
    config = triton_scaled_mm.launch_config(1, n, k, BF16, kind, num_sms(0), False)
    assert config.block_m == 1
    got = triton_scaled_mm._scaled_mm(kind, a, a_scale, w, w_scale, None, BF16, config)
    want = getattr(reference, f"scaled_mm_{fmt}")(a, a_scale, w, w_scale, None, BF16)
    torch.testing.assert_close(got, want, **tolerance(BF16, SCALED_MM))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.version.hip is None
                         and torch.cuda.get_device_capability() >= (8, 9)), reason="needs an NVIDIA sm89+ GPU")
@pytest.mark.parametrize("m", [48, 128, 256])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (4096, 14336), (5120, 2048), (2048, 4096)])
def test_on_nvidia_gpus_mid_m_per_token_launches_four_stages_up_to_mid_m_max_k_and_match_the_twin(m, n, k):
    # K = 14,336 keeps the launch before (K ranges bound the fast accumulation's chains): it must match too
    from atom_core.ops.triton import scaled_mm as triton_scaled_mm
    from atom_core.ops.triton.launch import num_sms

    a, a_scale, w, w_scale, bias = make_inputs("per_token", FP8, m, n, k, bias=True, seed=m + n + k)
    kind = triton_scaled_mm.PER_TOKEN.value
    config = triton_scaled_mm.launch_config(m, n, k, BF16, kind, num_sms(0), False)
    assert config.num_stages == (4 if k <= triton_scaled_mm.MID_M_MAX_K else 3), config
    got = triton_scaled_mm._scaled_mm(kind, a, a_scale, w, w_scale, bias, BF16, config)
    want = reference.scaled_mm_per_token(a, a_scale, w, w_scale, bias, BF16)
    torch.testing.assert_close(got, want, **tolerance(BF16, SCALED_MM))
