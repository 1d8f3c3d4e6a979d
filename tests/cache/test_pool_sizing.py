"""Pool sizing: hand-computed anchors, the smallest-budget boundary, validation; host memory."""
import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import atom_core.cache.pool_sizing as pool_sizing_module
from atom_core.cache.pool_sizing import (
    InsufficientMemoryError,
    KVCacheSpec,
    PoolPlan,
    budget_for_instance,
    budget_from_memory,
    check_fits_in_memory,
    host_memory_available_bytes,
    plan_kv_pool,
)

# Llama-3-8B: 32 layers, 8 KV heads (GQA), head_dim 128.
LLAMA3_8B_BF16 = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
# DeepSeek-V3: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64.
DEEPSEEK_V3_MLA = KVCacheSpec.mla(61, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)


# ------------------------------------------------------------------ bytes per token / block


def test_llama3_8b_bytes_per_token_and_block():
    # 32 layers x 2 (K,V) x 8 heads x 128 dim x 2 bytes = 131072
    assert LLAMA3_8B_BF16.bytes_per_token == 131072
    # 16 tokens x 131072 = 2097152 (2 MiB)
    assert LLAMA3_8B_BF16.bytes_per_block(16) == 2097152


def test_fp8_halves_bf16():
    fp8 = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float8_e4m3fn)
    # 32 x 2 x 8 x 128 x 1 byte = 65536
    assert fp8.bytes_per_token == 65536


@pytest.mark.parametrize(
    "dtype, element_bytes",
    [
        (torch.float32, 4),
        (torch.float16, 2),
        (torch.bfloat16, 2),
        (torch.float8_e4m3fn, 1),
        (torch.float8_e5m2, 1),
        (torch.int8, 1),
    ],
)
def test_bytes_per_token_per_dtype(dtype, element_bytes):
    spec = KVCacheSpec(num_layers=3, num_kv_heads=5, head_dim=7, dtype=dtype)
    # 3 layers x 2 (K,V) x 5 heads x 7 dim = 210 elements per token
    assert spec.bytes_per_token == 210 * element_bytes


def test_mla_one_latent_row_per_token():
    # 61 layers x (512 + 64) x 2 bytes, no separate V = 70272
    assert DEEPSEEK_V3_MLA.bytes_per_token == 70272
    assert DEEPSEEK_V3_MLA.num_kv_tensors_per_layer == 1
    assert DEEPSEEK_V3_MLA.is_mla and not LLAMA3_8B_BF16.is_mla


def test_kv_shapes():
    plan = plan_kv_pool(LLAMA3_8B_BF16, block_size=16, max_num_seqs=4, max_model_len=64, num_blocks=10)
    assert plan.kv_shape == (10, 16, 8, 128)
    plan = plan_kv_pool(DEEPSEEK_V3_MLA, block_size=64, max_num_seqs=4, max_model_len=64, num_blocks=3)
    assert plan.kv_shape == (3, 64, 576)  # 512 + 64


# ------------------------------------------------------------------ plan_kv_pool


def test_plan_from_budget_llama():
    # 10 blocks of 2097152 bytes plus 5 spare bytes -> 10 blocks, spare unused.
    plan = plan_kv_pool(
        LLAMA3_8B_BF16, block_size=16, max_num_seqs=8, max_model_len=160, budget_bytes=10 * 2097152 + 5
    )
    assert plan == PoolPlan(
        num_blocks=10,
        block_size=16,
        bytes_per_token=131072,
        bytes_per_block=2097152,
        kv_bytes=20971520,  # 10 x 2097152
        state_entries=0,
        state_bytes=0,
        total_bytes=20971520,
        kv_shape=(10, 16, 8, 128),
    )


def test_plan_from_num_blocks():
    # 2 layers x 2 x 1 head x 4 dim x 4 bytes = 64 bytes/token; block of 2 -> 128 bytes.
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    plan = plan_kv_pool(spec, block_size=2, max_num_seqs=3, max_model_len=5, num_blocks=7)
    assert (plan.num_blocks, plan.bytes_per_block, plan.kv_bytes, plan.total_bytes) == (7, 128, 896, 896)


def test_state_reserved_first():
    # KV: 1 layer x 2 x 1 head x 8 dim x 2 bytes = 32 bytes/token; block of 4 -> 128 bytes.
    # State: 4 seqs x 3 entries x 100 bytes = 1200 bytes.
    spec = KVCacheSpec(
        num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16,
        state_bytes_per_entry=100, state_entries_per_req=3,
    )
    plan = plan_kv_pool(spec, block_size=4, max_num_seqs=4, max_model_len=8, budget_bytes=2000)
    # (2000 - 1200) // 128 = 6 blocks (768 bytes); 32 bytes left over.
    assert plan.state_entries == 12
    assert plan.state_bytes == 1200
    assert plan.num_blocks == 6
    assert plan.kv_bytes == 768
    assert plan.total_bytes == 1968


def test_budget_too_small_for_state():
    spec = KVCacheSpec(
        num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16,
        state_bytes_per_entry=100, state_entries_per_req=3,
    )
    # state 1200 bytes + 2 blocks (max_model_len 8 / block 4) x 128 bytes = 1456 bytes
    with pytest.raises(ValueError) as info:
        plan_kv_pool(spec, block_size=4, max_num_seqs=4, max_model_len=8, budget_bytes=1000)
    message = str(info.value)
    for number in ("1000", "1200", "128", "1456"):
        assert number in message
    plan = plan_kv_pool(spec, block_size=4, max_num_seqs=4, max_model_len=8, budget_bytes=1456)
    assert plan.num_blocks == 2


def test_budget_too_small_for_one_request():
    # max_model_len 33 with blocks of 16 needs ceil(33/16) = 3 blocks = 6291456 bytes.
    with pytest.raises(ValueError, match=r"3 blocks.*6291456") as info:
        plan_kv_pool(LLAMA3_8B_BF16, block_size=16, max_num_seqs=1, max_model_len=33, budget_bytes=6291455)
    assert "2097152" in str(info.value)


def test_num_blocks_too_few_for_one_request():
    with pytest.raises(ValueError, match="num_blocks=2"):
        plan_kv_pool(LLAMA3_8B_BF16, block_size=16, max_num_seqs=1, max_model_len=33, num_blocks=2)


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(budget_bytes=1 << 30, num_blocks=4)],
    ids=["neither", "both"],
)
def test_exactly_one_of_budget_and_num_blocks(kwargs):
    with pytest.raises(ValueError, match="exactly one"):
        plan_kv_pool(LLAMA3_8B_BF16, block_size=16, max_num_seqs=1, max_model_len=16, **kwargs)


_specs = st.builds(
    KVCacheSpec,
    num_layers=st.integers(1, 8),
    num_kv_heads=st.integers(1, 8),
    head_dim=st.integers(1, 64),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]),
    state_bytes_per_entry=st.just(0),
    state_entries_per_req=st.just(0),
) | st.builds(
    KVCacheSpec,
    num_layers=st.integers(1, 8),
    num_kv_heads=st.integers(1, 4),
    head_dim=st.integers(1, 64),
    dtype=st.sampled_from([torch.float16, torch.float8_e5m2]),
    state_bytes_per_entry=st.integers(1, 5000),
    state_entries_per_req=st.integers(1, 4),
)


def _smallest_budget_in(message: str) -> int:
    match = re.search(r"smallest budget that works is (\d+) bytes", message)
    assert match, message
    return int(match.group(1))


@settings(max_examples=60, deadline=None)
@given(
    spec=_specs,
    block_size=st.sampled_from([1, 3, 16]),
    max_num_seqs=st.integers(1, 6),
    max_model_len=st.integers(1, 100),
)
def test_smallest_budget_in_error_is_exact(spec, block_size, max_num_seqs, max_model_len):
    sizes = dict(block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    with pytest.raises(ValueError) as info:
        plan_kv_pool(spec, budget_bytes=0, **sizes)
    smallest = _smallest_budget_in(str(info.value))
    # Independent: elements per token summed by hand, ceil written as a loop-free expression.
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    blocks = (max_model_len + block_size - 1) // block_size
    state = max_num_seqs * spec.state_entries_per_req * spec.state_bytes_per_entry
    assert smallest == state + blocks * block_size * per_token

    plan = plan_kv_pool(spec, budget_bytes=smallest, **sizes)
    assert plan.num_blocks == blocks
    assert plan.total_bytes == smallest
    with pytest.raises(ValueError):
        plan_kv_pool(spec, budget_bytes=smallest - 1, **sizes)


@settings(max_examples=60, deadline=None)
@given(spec=_specs, block_size=st.sampled_from([1, 2, 16]), extra=st.integers(0, 10**7))
def test_plan_uses_budget_tightly(spec, block_size, extra):
    sizes = dict(block_size=block_size, max_num_seqs=2, max_model_len=block_size)
    state = 2 * spec.state_entries_per_req * spec.state_bytes_per_entry
    budget = state + block_size * spec.bytes_per_token + extra
    plan = plan_kv_pool(spec, budget_bytes=budget, **sizes)
    # Fits, and less than one more block is wasted.
    assert plan.total_bytes <= budget < plan.total_bytes + plan.bytes_per_block
    assert plan.kv_bytes == plan.num_blocks * plan.bytes_per_block
    assert plan.state_bytes == state


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(num_layers=0), ValueError, "num_layers"),
        (dict(num_kv_heads=-1), ValueError, "num_kv_heads"),
        (dict(head_dim=2.0), TypeError, "head_dim"),
        (dict(dtype="bfloat16"), TypeError, "dtype"),
        (dict(kv_lora_rank=8), ValueError, "qk_rope_head_dim"),
        (dict(state_bytes_per_entry=10), ValueError, "state_entries_per_req"),
        (dict(state_entries_per_req=-1), ValueError, "state_entries_per_req"),
        (dict(num_layers=True), TypeError, "num_layers"),
    ],
)
def test_spec_validation(kwargs, error, name):
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16) | kwargs
    with pytest.raises(error, match=name):
        KVCacheSpec(**fields)


def test_mla_spec_must_be_one_latent_row():
    with pytest.raises(ValueError, match="head_dim must be kv_lora_rank"):
        KVCacheSpec(2, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=16)


@pytest.mark.parametrize("name", ["block_size", "max_num_seqs", "max_model_len"])
def test_plan_rejects_non_positive_sizes(name):
    sizes = dict(block_size=16, max_num_seqs=1, max_model_len=16) | {name: 0}
    with pytest.raises(ValueError, match=name):
        plan_kv_pool(LLAMA3_8B_BF16, num_blocks=4, **sizes)


# ------------------------------------------------------------------ budget_from_memory


def test_budget_from_memory_anchor():
    # 80 GiB device at 0.9 -> 72 GiB allowed; 20 GiB used -> 52 GiB = 55834574848 bytes.
    assert budget_from_memory(80 << 30, 20 << 30, 0.9) == 55834574848


def test_budget_from_memory_full_device():
    assert budget_from_memory(1000, 250, 1.0) == 750


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_budget_from_memory_rejects_bad_utilization(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        budget_from_memory(1000, 0, utilization)


def test_budget_from_memory_nothing_left():
    # 0.5 x 1000 = 500 allowed, 600 already used.
    with pytest.raises(ValueError, match="allows 500 bytes.*used_bytes=600"):
        budget_from_memory(1000, 600, 0.5)


# ------------------------------------------------------------------ host memory and the refusal


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """Point the host-memory reader at files under tmp_path: (meminfo path, cgroup folder)."""
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    cgroup.mkdir()
    monkeypatch.setattr(pool_sizing_module, "_MEMINFO", meminfo)
    monkeypatch.setattr(pool_sizing_module, "_CGROUP", cgroup)
    return meminfo, cgroup


def test_host_memory_available_is_meminfo_memavailable_in_bytes(fake_host):
    meminfo, _ = fake_host
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n")
    assert host_memory_available_bytes() == 20000000 * 1024


def test_host_memory_available_falls_back_to_physical_pages_without_meminfo(fake_host):
    assert host_memory_available_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_host_memory_available_is_capped_by_the_cgroup_limit_left(fake_host):
    meminfo, cgroup = fake_host
    meminfo.write_text("MemAvailable:   20000000 kB\n")
    (cgroup / "memory.max").write_text("3000000000\n")
    (cgroup / "memory.current").write_text("1000000000\n")
    assert host_memory_available_bytes() == 2000000000
    (cgroup / "memory.max").write_text("max\n")  # no limit set
    assert host_memory_available_bytes() == 20000000 * 1024


def test_host_memory_available_on_this_machine_is_a_positive_int():
    available = host_memory_available_bytes()
    assert isinstance(available, int) and available > 0


def test_check_fits_in_memory_refusal_names_what_both_sizes_in_gib_and_where():
    with pytest.raises(InsufficientMemoryError) as err:
        check_fits_in_memory("the thing", 3 << 30, 1 << 30, where="host memory", detail="3 x 1 GiB", hint="less")
    assert str(err.value) == ("the thing needs an estimated 3.00 GiB (3 x 1 GiB), more than the 1.00 GiB of "
                              "host memory available; less")
    assert isinstance(err.value, MemoryError) and isinstance(err.value, ValueError)


def test_check_fits_in_memory_passes_when_it_fits_or_the_memory_is_unknown():
    check_fits_in_memory("x", 1 << 30, 1 << 30, where="host memory")  # equal: fits
    check_fits_in_memory("x", 1 << 60, None, where="host memory")     # unknown: no check


# ------------------------------------------------------------------ budget_for_instance (vLLM V1's per-engine share)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1 << 20, 1 << 40), free_share=st.floats(0.0, 1.0), own_share=st.floats(0.0, 0.5),
       act_share=st.floats(0.0, 0.2), utilization=st.floats(0.01, 1.0))
def test_an_instance_budget_is_its_share_less_its_own_bytes_and_never_more_than_is_free(
        total, free_share, own_share, act_share, utilization):
    own, act = int(total * own_share), int(total * act_share)
    free = min(int(total * free_share), total - own)
    try:
        budget = budget_for_instance(total, free, own, act, utilization)
    except ValueError as e:  # the share is not free, or leaves nothing: refused, with the numbers
        assert int(total * utilization) - own - act <= 0 or int(total * utilization) - own > free, e
        return
    assert budget == int(total * utilization) - own - act > 0
    assert budget + act <= free


def test_memory_others_hold_does_not_shrink_an_instances_budget():
    """TRL's colocated layout: a trainer holds 30 of 80 GiB; gpu_memory_utilization=0.3 gives the engine 24 GiB
    of which its 1 GiB of weights and 1 GiB of activations leave 22 for the pool (the older rule, which
    counted the trainer's memory, refused it)."""
    gib = 1 << 30
    assert budget_for_instance(80 * gib, 49 * gib, gib, gib, 0.3) == int(80 * gib * 0.3) - 2 * gib
    with pytest.raises(ValueError, match="only 10.00 GiB are free"):  # the share is not free: refused
        budget_for_instance(80 * gib, 10 * gib, gib, gib, 0.3)
