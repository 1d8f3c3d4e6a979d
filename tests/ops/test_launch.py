"""The plain-int launch arithmetic of the Triton wrappers gives Triton's own answers."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from atom_core.ops.triton.launch import cdiv, next_power_of_2

triton = pytest.importorskip("triton")


@given(st.integers(1, 2**40))
def test_next_power_of_2_equals_triton_for_positive_ints(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)


@given(st.integers(0, 2**40), st.integers(1, 2**20))
def test_cdiv_equals_triton(a, b):
    assert cdiv(a, b) == triton.cdiv(a, b)


def test_next_power_of_2_at_and_around_powers_of_two():
    assert [next_power_of_2(n) for n in (1, 2, 3, 4, 5, 1023, 1024, 1025)] == [1, 2, 4, 4, 8, 1024, 1024, 2048]


H200_SHARED = 232448  # bytes a program may take on an H200 (the device the launch tables were chosen on)
SMALL_SHARED = 101376  # sm86 / sm89 parts (RTX 4090, L40S)


@given(st.integers(1, 8), st.integers(1, 2**18), st.integers(0, 2**18))
def test_stages_that_fit_are_the_most_that_fit_beside_the_reserve(stages, stage_bytes, limit):
    from atom_core.ops.triton.launch import SHARED_MEMORY_RESERVE, stages_that_fit
    got = stages_that_fit(stages, stage_bytes, limit)
    assert 1 <= got <= stages
    if got > 1:
        assert got * stage_bytes + SHARED_MEMORY_RESERVE <= limit
    if got < stages:
        assert (got + 1) * stage_bytes + SHARED_MEMORY_RESERVE > limit
    assert stages_that_fit(stages, stage_bytes, None) == stages


def _scaled_mm_launches():
    from atom_core.ops.triton import scaled_mm
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (5120, 2048), (2048, 4096), (151936, 4096)]
    for m in (1, 2, 16, 64, 128, 512, 1024, 8192):
        for n, k in shapes:
            for scales in (scaled_mm.PER_TENSOR.value, scaled_mm.PER_TOKEN.value, scaled_mm.BLOCKWISE.value):
                for int8 in (False, True):
                    yield scaled_mm.launch_config(m, n, k, torch.bfloat16, scales, 132, False, int8)


def test_scaled_mm_launches_keep_their_stages_on_an_h200_and_fit_a_99_kb_gpu():
    from atom_core.ops.triton.launch import SHARED_MEMORY_RESERVE
    for config in _scaled_mm_launches():
        assert config.stages_within(H200_SHARED, 1) == config.num_stages, config
        stages = config.stages_within(SMALL_SHARED, 1)
        staged = stages * (config.block_m + config.block_n) * config.block_k
        assert stages == 1 or staged + SHARED_MEMORY_RESERVE <= SMALL_SHARED, config


def _moe_launches():
    from atom_core.ops.triton import fused_moe
    for tokens in (1, 2, 8, 64, 192, 256, 384, 1024, 4096, 16384):
        for dtype in (torch.bfloat16, torch.float32):
            yield fused_moe.block_config(tokens, 8, 128, dtype), dtype.itemsize, dtype.itemsize, False
            for fmt in ("fp8_block", "fp8_channel"):
                yield fused_moe.quant_block_config(tokens, 8, 128, dtype, fmt), 1, 1, False
            yield fused_moe.quant_block_config(tokens, 4, 32, dtype, "mxfp4"), dtype.itemsize, 1, True
    for configs in fused_moe.MXFP4_BLOCK_CONFIGS.values():
        for cfg in configs:
            yield cfg, 2, 1, True


def test_fused_moe_launches_keep_their_stages_on_an_h200_and_fit_a_99_kb_gpu():
    from atom_core.ops.triton import fused_moe
    from atom_core.ops.triton.launch import SHARED_MEMORY_RESERVE
    for cfg, a_bytes, w_bytes, packed in _moe_launches():
        for matrices in (1, 2):  # down, gate/up
            assert fused_moe._stages(cfg, a_bytes, w_bytes, matrices, packed, H200_SHARED) == cfg.num_stages, cfg
            stages = fused_moe._stages(cfg, a_bytes, w_bytes, matrices, packed, SMALL_SHARED)
            w_tile = cfg.block_k * cfg.block_n * w_bytes // (2 if packed else 1)
            staged = stages * (cfg.block_m * cfg.block_k * a_bytes + matrices * w_tile)
            assert stages == 1 or staged + SHARED_MEMORY_RESERVE <= SMALL_SHARED, cfg
