"""Quantized linear methods in the TP-sharded linear layers: what each rank loads and what it computes.

Every check starts from FULL unsharded tensors quantized here (FP8: ``x / scale`` cast to e4m3fn;
INT8: rounded and clamped to +-127; scales by hand), then:

- each rank's effective weight (its FP8/INT8 values times the scale the GEMM reads) equals its rows
  (column-parallel) or columns (row-parallel) of the full dequantized weight, cut here with
  ``torch.chunk`` / explicit head lists, exactly;
- with one rank, ``forward`` equals the definition: the activation quantized by the op twin the
  scheme names, dequantized, times the dequantized weight in fp32, exactly;
- splits that would cut a 128-block, and FP8 data going anywhere but an FP8 layer, are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from atom_core import ops
from atom_core.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from atom_core.models.quantization import (
    FP8_BLOCK_128,
    FP8_PER_CHANNEL,
    FP8_PER_TENSOR,
    INT8_PER_CHANNEL,
    ActivationScheme,
    Fp8Linear,
    Int8Linear,
    QuantConfig,
    UnquantizedLinear,
    UnsupportedQuantizationError,
    online_quant_config,
    quantize_weight,
)
from atom_core.models.quantization.schemes import make_scheme
from atom_core.ops.reference import quant as ref_quant

A = ActivationScheme
FP8, INT8 = torch.float8_e4m3fn, torch.int8
SCHEMES = {
    "fp8-tensor-static": make_scheme(FP8_PER_TENSOR, A.STATIC_PER_TENSOR, where="t"),
    "fp8-tensor-dynamic": make_scheme(FP8_PER_TENSOR, A.DYNAMIC_PER_TENSOR, where="t"),
    "fp8-tensor-token": make_scheme(FP8_PER_TENSOR, A.DYNAMIC_PER_TOKEN, where="t"),
    "fp8-channel-token": make_scheme(FP8_PER_CHANNEL, A.DYNAMIC_PER_TOKEN, where="t"),
    "fp8-channel-static": make_scheme(FP8_PER_CHANNEL, A.STATIC_PER_TENSOR, where="t"),
    "fp8-block": make_scheme(FP8_BLOCK_128, A.DYNAMIC_PER_GROUP_128, where="t"),
    "int8-channel-token": make_scheme(INT8_PER_CHANNEL, A.DYNAMIC_PER_TOKEN, where="t"),
}


@pytest.fixture(autouse=True)
def torch_backend():
    with ops.use_backend("torch"):
        yield


def _config(scheme, *, online=False) -> QuantConfig:
    return QuantConfig(quant_method="fp8", default=scheme, expert_default=scheme, online=online)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _quantize(w: torch.Tensor, scheme) -> dict:
    """Checkpoint tensors of one module: ``weight`` and ``weight_scale`` as the formats store them
    (per-tensor [1], per-channel [N] for FP8 (Quark's shape) / [N, 1] for INT8, block [ceil(N/128), ceil(K/128)])."""
    fmt, rows = scheme.weight, w.shape[0]
    if fmt.scales == "per_tensor":
        scale = w.abs().max().reshape(1) / 448
    elif fmt.scales == "per_channel":
        scale = w.abs().amax(1, keepdim=True) / (127 if fmt.dtype == "int8" else 448)
    else:
        padded = torch.nn.functional.pad(w, (0, -w.shape[1] % 128, 0, -rows % 128))
        tiles = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
        scale = tiles.abs().amax((1, 3)) / 448
    full = _expand(scale, w.shape)
    if fmt.dtype == "int8":
        q = torch.round(w / full).clamp(-127, 127).to(INT8)
    else:
        q = (w / full).to(FP8)
    if fmt.scales == "per_channel" and fmt.dtype != "int8":
        scale = scale.reshape(rows)
    return {"weight": q, "weight_scale": scale}


def _expand(scale: torch.Tensor, shape) -> torch.Tensor:
    rows, cols = shape
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, cols)
    if scale.numel() == rows:
        return scale.reshape(rows, 1).expand(rows, cols)
    return scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def _dequant(t: dict) -> torch.Tensor:
    return t["weight"].float() * _expand(t["weight_scale"].float(), t["weight"].shape)


def _effective_weight(layer) -> torch.Tensor:
    """What the layer's GEMM multiplies by: its stored values times the scale it reads."""
    if isinstance(layer.quant_method, UnquantizedLinear):
        return layer.weight.float()
    return layer.weight.float() * _expand(layer._w_scale, layer.weight.shape)


def _reference(x, w_deq, scheme, bias=None, input_scale=None) -> torch.Tensor:
    """The definition: the activation through the scheme's quantization twin, dequantized, fp32 matmul."""
    dtype = INT8 if scheme.weight.dtype == "int8" else FP8
    act = scheme.activation
    if act is A.DYNAMIC_PER_TOKEN:
        q, s = ref_quant.per_token_quant(x, dtype)
        xd = ref_quant.dequantize(q, s)
    elif act is A.DYNAMIC_PER_GROUP_128:
        q, s = ref_quant.per_group_quant(x, dtype, 128)
        xd = ref_quant.dequantize(q, s, 128)
    else:
        q, s = ref_quant.per_tensor_quant(x, dtype, input_scale if act is A.STATIC_PER_TENSOR else None)
        xd = ref_quant.dequantize(q, s)
    out = xd @ w_deq.T
    return out if bias is None else out + bias


def _load(layer, name, tensor, shard_id=None):
    param = getattr(layer, name)
    if shard_id is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_column_parallel_ranks_hold_their_rows_of_the_dequantized_weight_and_rank1_forward_is_the_definition(name):
    scheme = SCHEMES[name]
    out_size, in_size = 512, 384
    w = torch.randn(out_size, in_size, generator=_gen(0))
    stored = _quantize(w, scheme)
    full = _dequant(stored)
    x = torch.randn(5, in_size, generator=_gen(1))
    input_scale = torch.tensor([x.abs().max().item() / 448 * 1.25])
    bias = torch.randn(out_size, generator=_gen(2))
    for tp_size in (1, 2):
        for rank in range(tp_size):
            layer = ColumnParallelLinear(in_size, out_size, True, tp_rank=rank, tp_size=tp_size,
                                         dtype=torch.float32, quant_config=_config(scheme), prefix="m.proj")
            assert isinstance(layer.quant_method, Int8Linear if scheme.weight.dtype == "int8" else Fp8Linear)
            for key, tensor in stored.items():
                _load(layer, key, tensor)
            _load(layer, "bias", bias)
            if scheme.activation is A.STATIC_PER_TENSOR:
                _load(layer, "input_scale", input_scale)
            layer.process_weights_after_loading()
            assert torch.equal(_effective_weight(layer), full.chunk(tp_size, 0)[rank])
            if tp_size == 1:
                assert torch.equal(layer(x), _reference(x, full, scheme, bias, input_scale))


@pytest.mark.parametrize("name", ["fp8-tensor-static", "fp8-tensor-token", "fp8-channel-token", "fp8-block",
                                  "int8-channel-token"])
def test_qkv_parts_each_keep_their_scales_on_every_rank(name):
    """Per-tensor parts get different scales (q's weights are 4x larger): each part's rows keep its own;
    the static input scale of the fused layer is the parts' largest."""
    scheme = SCHEMES[name]
    num_heads, num_kv_heads, head_dim, hidden = 4, 2, 128, 256
    ws = {"q": 4 * torch.randn(num_heads * head_dim, hidden, generator=_gen(0)),
          "k": torch.randn(num_kv_heads * head_dim, hidden, generator=_gen(1)),
          "v": 0.5 * torch.randn(num_kv_heads * head_dim, hidden, generator=_gen(2))}
    stored = {sid: _quantize(w, scheme) for sid, w in ws.items()}
    deq = {sid: _dequant(t) for sid, t in stored.items()}
    # (ratios other than powers of two: scaling by 2 only moves FP8 exponents, rounding alike)
    input_scales = {"q": torch.tensor([0.011]), "k": torch.tensor([0.017]), "v": torch.tensor([0.013])}
    x = torch.randn(6, hidden, generator=_gen(3))
    for tp_size in (1, 2, 4):  # tp 4: one KV head of 128 rows replicated on two ranks
        heads, kv = num_heads // tp_size, max(1, num_kv_heads // tp_size)
        for rank in range(tp_size):
            layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, tp_rank=rank, tp_size=tp_size,
                                      dtype=torch.float32, quant_config=_config(scheme), prefix="m.qkv_proj")
            for sid in "qkv":
                for key, tensor in stored[sid].items():
                    _load(layer, key, tensor, sid)
                if scheme.activation is A.STATIC_PER_TENSOR:
                    _load(layer, "input_scale", input_scales[sid], sid)
            layer.process_weights_after_loading()
            kv_head = rank * num_kv_heads // tp_size
            kv_rows = slice(kv_head * head_dim, (kv_head + kv) * head_dim)
            expected = torch.cat([deq["q"][rank * heads * head_dim:(rank + 1) * heads * head_dim],
                                  deq["k"][kv_rows], deq["v"][kv_rows]])
            assert torch.equal(_effective_weight(layer), expected)
            if tp_size == 1:
                w_full = torch.cat([deq["q"], deq["k"], deq["v"]])
                assert torch.equal(layer(x), _reference(x, w_full, scheme, input_scale=torch.tensor([0.017])))


@pytest.mark.parametrize("name", ["fp8-tensor-dynamic", "fp8-channel-token", "fp8-block", "int8-channel-token"])
def test_merged_gate_up_separate_and_fused_checkpoint_tensors_load_alike(name):
    scheme = SCHEMES[name]
    inter, hidden = 256, 128
    gate, up = torch.randn(inter, hidden, generator=_gen(0)), 3 * torch.randn(inter, hidden, generator=_gen(1))
    parts = [_quantize(gate, scheme), _quantize(up, scheme)]
    for tp_size in (1, 2):
        for rank in range(tp_size):
            expected = torch.cat([_dequant(p).chunk(tp_size, 0)[rank] for p in parts])
            separate = MergedColumnParallelLinear(hidden, [inter, inter], tp_rank=rank, tp_size=tp_size,
                                                  quant_config=_config(scheme), prefix="m.gate_up_proj")
            for shard_id, part in enumerate(parts):
                for key, tensor in part.items():
                    _load(separate, key, tensor, shard_id)
            separate.process_weights_after_loading()
            assert torch.equal(_effective_weight(separate), expected)
            if scheme.weight.scales == "per_tensor":
                continue  # a fused checkpoint has one per-tensor scale for both parts: another quantization
            fused = MergedColumnParallelLinear(hidden, [inter, inter], tp_rank=rank, tp_size=tp_size,
                                               quant_config=_config(scheme), prefix="m.gate_up_proj")
            for key in parts[0]:
                _load(fused, key, torch.cat([parts[0][key], parts[1][key]]))
            fused.process_weights_after_loading()
            assert torch.equal(_effective_weight(fused), expected)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_row_parallel_partial_products_sum_to_the_full_layer(name):
    """Each rank holds its columns (block scales: its 128-column blocks; other scales whole); the
    ranks' partial sums (what all_reduce adds) equal the one-rank layer up to fp32 summation order."""
    scheme = SCHEMES[name]
    out_size, in_size = 192, 512
    w = torch.randn(out_size, in_size, generator=_gen(0))
    stored = _quantize(w, scheme)
    full = _dequant(stored)
    x = torch.randn(4, in_size, generator=_gen(1))
    bias = torch.randn(out_size, generator=_gen(2))
    input_scale = torch.tensor([x.abs().max().item() / 448])
    outs = {}
    for tp_size in (1, 2, 4):
        total = 0
        for rank in range(tp_size):
            layer = RowParallelLinear(in_size, out_size, True, reduce_results=False, tp_rank=rank, tp_size=tp_size,
                                      quant_config=_config(scheme), prefix="m.o_proj")
            for key, tensor in stored.items():
                _load(layer, key, tensor)
            _load(layer, "bias", bias)
            if scheme.activation is A.STATIC_PER_TENSOR:
                _load(layer, "input_scale", input_scale)
            layer.process_weights_after_loading()
            assert torch.equal(_effective_weight(layer), full.chunk(tp_size, 1)[rank])
            total = total + layer(x.chunk(tp_size, 1)[rank])
        outs[tp_size] = total
    assert torch.equal(outs[1], _reference(x, full, scheme, bias, input_scale))
    if scheme.activation in (A.STATIC_PER_TENSOR, A.DYNAMIC_PER_GROUP_128):
        # Activation scales that do not depend on other ranks' columns (static, or 128-groups the split
        # keeps whole) quantize every column as one rank does: only the fp32 summation order differs.
        # (Dynamic per-tensor / per-token scales are each rank's own: another, equally valid quantization.)
        for tp_size in (2, 4):
            torch.testing.assert_close(outs[tp_size], outs[1], atol=1e-4, rtol=1e-5)


def test_replicated_linear_quantized_loads_per_channel_scales_of_either_shape():
    scheme = SCHEMES["fp8-channel-token"]
    w = torch.randn(24, 40, generator=_gen(0))
    stored = _quantize(w, scheme)
    for scale in (stored["weight_scale"], stored["weight_scale"].reshape(-1, 1)):  # Quark [N], compressed-tensors [N, 1]
        layer = ReplicatedLinear(40, 24, quant_config=_config(scheme), prefix="m.proj")
        _load(layer, "weight", stored["weight"])
        _load(layer, "weight_scale", scale)
        layer.process_weights_after_loading()
        assert torch.equal(_effective_weight(layer), _dequant(stored))


@pytest.mark.parametrize("make, match", [
    (lambda c: ColumnParallelLinear(256, 384, tp_rank=1, tp_size=2, quant_config=c, prefix="l.up"),
     r"l.up: FP8 128 x 128 block scales .*rows \[192, 384\) of 384 on tp_rank 1 of 2 cut a 128-block"),
    (lambda c: ColumnParallelLinear(256, 384, tp_rank=0, tp_size=2, quant_config=c, prefix="l.up"),
     r"rows \[0, 192\) of 384 on tp_rank 0"),
    (lambda c: MergedColumnParallelLinear(256, [100, 100], quant_config=c, prefix="l.gate_up_proj"),
     r"l.gate_up_proj: .*part 0 rows \[0, 100\) of 100"),
    (lambda c: QKVParallelLinear(256, 64, 4, 2, tp_rank=1, tp_size=2, quant_config=c, prefix="l.qkv_proj"),
     r"l.qkv_proj: .*k rows \[64, 128\) of 128 on tp_rank 1"),
    (lambda c: RowParallelLinear(384, 256, tp_rank=1, tp_size=2, quant_config=c, prefix="l.o_proj"),
     r"l.o_proj: .*columns \[192, 384\) of 384"),
])
def test_block_scales_refuse_a_split_that_cuts_a_block_naming_the_layer(make, match):
    config = _config(SCHEMES["fp8-block"])
    with pytest.raises(UnsupportedQuantizationError, match=match):
        make(config)
    make(None)  # the same split unquantized is fine


def test_block_scales_take_partial_edge_blocks_where_nothing_is_cut():
    """One rank: 300 x 200 (last row and column blocks partial) loads and computes the definition."""
    scheme = SCHEMES["fp8-block"]
    w = torch.randn(300, 200, generator=_gen(0))
    stored = _quantize(w, scheme)
    layer = ColumnParallelLinear(200, 300, quant_config=_config(scheme), prefix="m.proj")
    assert tuple(layer.weight_scale.shape) == (3, 2)
    for key, tensor in stored.items():
        _load(layer, key, tensor)
    layer.process_weights_after_loading()
    x = torch.randn(3, 200, generator=_gen(1))
    assert torch.equal(layer(x), _reference(x, _dequant(stored), scheme))


def test_scale_loaders_refuse_wrong_shapes_by_name():
    layer = QKVParallelLinear(256, 64, 4, 2, quant_config=_config(SCHEMES["fp8-tensor-static"]), prefix="m.qkv_proj")
    with pytest.raises(ValueError, match=r"QKVParallelLinear.weight_scale\[k\]: a per-tensor scale holds one value"):
        _load(layer, "weight_scale", torch.ones(2), "k")
    block = ColumnParallelLinear(256, 256, quant_config=_config(SCHEMES["fp8-block"]), prefix="m.proj")
    with pytest.raises(ValueError, match=r"ColumnParallelLinear.weight_scale.*\(2, 1\).*\(2, 2\)"):
        _load(block, "weight_scale", torch.ones(2, 1))


@pytest.mark.parametrize("quantization", ["fp8", "fp8_block"])
def test_online_quantization_rank_pieces_equal_the_offline_quantized_tensor(quantization):
    """``quantize_on_load``: each rank quantizes its piece of the unquantized tensor as it loads; per-channel
    row-parallel ranks use the whole row's amax. The result equals quantizing the full tensor first (the
    offline routine) and cutting it."""
    config = online_quant_config(quantization)
    fmt = config.default.weight
    w_col = torch.randn(512, 256, generator=_gen(0)).to(torch.bfloat16)
    w_row = torch.randn(256, 512, generator=_gen(1)).to(torch.bfloat16)
    q_col, s_col = quantize_weight(w_col, fmt)
    q_row, s_row = quantize_weight(w_row, fmt)
    full_col = q_col.float() * _expand(s_col, q_col.shape)
    full_row = q_row.float() * _expand(s_row, q_row.shape)
    for rank in range(2):
        col = ColumnParallelLinear(256, 512, tp_rank=rank, tp_size=2, quant_config=config, prefix="m.up")
        row = RowParallelLinear(512, 256, tp_rank=rank, tp_size=2, quant_config=config, prefix="m.down")
        assert col.weight.dtype == FP8 and row.weight.dtype == FP8
        _load(col, "weight", w_col)
        _load(row, "weight", w_row)
        col.process_weights_after_loading()
        row.process_weights_after_loading()
        assert torch.equal(_effective_weight(col), full_col.chunk(2, 0)[rank])
        assert torch.equal(_effective_weight(row), full_row.chunk(2, 1)[rank])


@pytest.mark.parametrize("fmt", [FP8_PER_CHANNEL, FP8_BLOCK_128])
def test_quantize_weight_scales_are_amax_over_448_and_values_round_to_nearest_fp8(fmt):
    """The online routine against its definition, written out here: scale = amax of the row (of the
    128 x 128 tile) / 448; each value is the FP8 number nearest ``w / scale`` (so the amax element is
    exactly +-448 and every value is within half an FP8 step: 2**-4 relative in the normal range,
    2**-10 absolute below 2**-6)."""
    w = torch.randn(300, 200, generator=_gen(0)) * torch.logspace(-3, 1, 200)  # columns across 4 decades
    q, scale = quantize_weight(w.to(torch.bfloat16), fmt)
    w = w.to(torch.bfloat16).float()
    if fmt == FP8_PER_CHANNEL:
        assert scale.shape == (300, 1) and torch.equal(scale, w.abs().amax(1, keepdim=True) / 448)
    else:
        padded = torch.nn.functional.pad(w, (0, 56, 0, 84)).view(3, 128, 2, 128)
        assert scale.shape == (3, 2) and torch.equal(scale, padded.abs().amax((1, 3)) / 448)
    y = w / _expand(scale, w.shape)
    err = (q.float() - y).abs()
    normal = y.abs() >= 2**-6
    assert q.dtype == FP8 and (err[normal] <= 2**-4 * y.abs()[normal]).all() and (err[~normal] <= 2**-10).all()
    assert (q.float().abs().amax(1) == 448).all() if fmt == FP8_PER_CHANNEL else q.float().abs().max() == 448
