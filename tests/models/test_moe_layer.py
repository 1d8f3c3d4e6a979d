"""FusedMoE: shard arithmetic over 1/2/4/8 ranks, each rank's weight_loader pieces, partial sums that
add up to the whole layer, and the loader's expert mapping.

Expected pieces are cut here with ``torch.chunk`` and the expected outputs come from a plain
per-token loop over ``F.linear`` written in this file, never from the code under test.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from atom_core import ops
from atom_core.models.layers.moe import (
    FusedMoE,
    expert_params_mapping,
    fused_expert_params_mapping,
    moe_shard,
)
from atom_core.models.loader import load_weights

RANKS = st.sampled_from([1, 2, 4, 8])
SETTINGS = settings(max_examples=25, deadline=None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_experts(num_experts: int, hidden: int, inter: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-expert tensors as nn.Linear stores them: gate/up [E, I, H], down [E, H, I], biases."""
    g = _gen(seed)
    return {
        "gate": torch.randn(num_experts, inter, hidden, generator=g),
        "up": torch.randn(num_experts, inter, hidden, generator=g),
        "down": torch.randn(num_experts, hidden, inter, generator=g),
        "gate_bias": torch.randn(num_experts, inter, generator=g),
        "up_bias": torch.randn(num_experts, inter, generator=g),
        "down_bias": torch.randn(num_experts, hidden, generator=g),
    }


def load_per_expert(layer: FusedMoE, w: dict[str, torch.Tensor], *, bias: bool = False) -> None:
    for e in range(layer.num_experts):
        for proj, key in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            param = layer.w2_weight if proj == "w2" else layer.w13_weight
            param.weight_loader(param, w[key][e], (e, proj))
            if bias:
                param = layer.w2_bias if proj == "w2" else layer.w13_bias
                param.weight_loader(param, w[key + "_bias"][e], (e, proj))


def naive_moe(x, w, topk_weights, topk_ids, activation, bias):
    """sum_k weight_k * expert(x): one token and one choice at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate = F.linear(x[t], w["gate"][e], w["gate_bias"][e] if bias else None)
            up = F.linear(x[t], w["up"][e], w["up_bias"][e] if bias else None)
            if activation == "silu":
                act = F.silu(gate) * up
            else:  # GPT-OSS: alpha 1.702, limit 7
                g = gate.clamp(max=7.0)
                act = (up.clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g)
            y = F.linear(act, w["down"][e], w["down_bias"][e] if bias else None)
            out[t] += topk_weights[t, k] * y
    return out


def random_routing(num_tokens, num_experts, top_k, seed=1):
    g = _gen(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=g)
    return weights, ids


# ---- shard arithmetic ---------------------------------------------------------------------

@SETTINGS
@given(tp_size=RANKS, ep_size=RANKS, experts_per_rank=st.integers(1, 4), inter_per_rank=st.integers(1, 6))
def test_shards_tile_experts_and_intermediate(tp_size, ep_size, experts_per_rank, inter_per_rank):
    num_experts, inter = ep_size * experts_per_rank, tp_size * inter_per_rank
    experts_seen, inter_seen = [], []
    for ep_rank in range(ep_size):
        s = moe_shard(num_experts, inter, tp_rank=0, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size)
        experts_seen.extend(range(s.expert_start, s.expert_start + s.num_local_experts))
    for tp_rank in range(tp_size):
        s = moe_shard(num_experts, inter, tp_rank=tp_rank, tp_size=tp_size, ep_rank=0, ep_size=ep_size)
        inter_seen.extend(range(s.intermediate_start, s.intermediate_start + s.intermediate_size))
    assert experts_seen == list(range(num_experts))  # in order, each once
    assert inter_seen == list(range(inter))


def test_moe_shard_anchor():
    # 8 experts over 2 EP ranks: rank 1 holds experts 4..7 (start 1 * 8/2 = 4);
    # I = 12 over 4 TP ranks: rank 2 holds units 6, 7, 8 (start 2 * 12/4 = 6, size 3).
    s = moe_shard(8, 12, tp_rank=2, tp_size=4, ep_rank=1, ep_size=2)
    assert (s.expert_start, s.num_local_experts, s.intermediate_start, s.intermediate_size) == (4, 4, 6, 3)
    assert s.holds_expert(4) and s.holds_expert(7) and not s.holds_expert(3) and not s.holds_expert(8)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=6, intermediate_size=8, ep_size=4), "num_experts=6 is not divisible by ep_size=4"),
    (dict(num_experts=8, intermediate_size=6, tp_size=4), "intermediate size, 6, is not divisible by tp_size=4"),
    (dict(num_experts=8, intermediate_size=8, ep_rank=2, ep_size=2), "ep_rank"),
    (dict(num_experts=8, intermediate_size=8, tp_rank=-1, tp_size=2), "tp_rank"),
    (dict(num_experts=0, intermediate_size=8), "num_experts"),
])
def test_moe_shard_refuses_bad_splits(kwargs, match):
    num_experts, inter = kwargs.pop("num_experts"), kwargs.pop("intermediate_size")
    with pytest.raises(ValueError, match=match):
        moe_shard(num_experts, inter, **kwargs)


# ---- weight loading -----------------------------------------------------------------------

@SETTINGS
@given(tp_size=RANKS, ep_size=st.sampled_from([1, 2, 4]), activation=st.sampled_from(["silu", "swiglu_clamped"]))
def test_each_rank_loads_its_experts_and_columns(tp_size, ep_size, activation):
    num_experts, hidden, inter = 4, 3, 2 * tp_size
    w = random_experts(num_experts, hidden, inter)
    for tp_rank in range(tp_size):
        for ep_rank in range(ep_size):
            layer = FusedMoE(num_experts, hidden, inter, activation=activation, bias=True, tp_rank=tp_rank,
                             tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size)
            load_per_expert(layer, w, bias=True)
            mine = list(range(ep_rank * num_experts // ep_size, (ep_rank + 1) * num_experts // ep_size))
            for local, e in enumerate(mine):
                gate = w["gate"][e].chunk(tp_size, dim=0)[tp_rank]          # [I_r, H]
                up = w["up"][e].chunk(tp_size, dim=0)[tp_rank]
                if activation == "silu":                                     # halves: [gate; up]
                    expected_w13 = torch.cat([gate, up])
                    expected_b13 = torch.cat([w["gate_bias"][e].chunk(tp_size)[tp_rank],
                                              w["up_bias"][e].chunk(tp_size)[tp_rank]])
                else:                                                        # interleaved: g0 u0 g1 u1 ...
                    expected_w13 = torch.stack([gate, up], dim=1).reshape(-1, hidden)
                    expected_b13 = torch.stack([w["gate_bias"][e].chunk(tp_size)[tp_rank],
                                                w["up_bias"][e].chunk(tp_size)[tp_rank]], dim=1).reshape(-1)
                assert torch.equal(layer.w13_weight[local], expected_w13)
                assert torch.equal(layer.w13_bias[local], expected_b13)
                assert torch.equal(layer.w2_weight[local], w["down"][e].chunk(tp_size, dim=1)[tp_rank])
                assert torch.equal(layer.w2_bias[local], w["down_bias"][e])


@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
@pytest.mark.parametrize("tp_size,ep_size", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_whole_stack_and_transposed_loads_equal_per_expert_loads(activation, tp_size, ep_size):
    num_experts, hidden, inter = 4, 5, 6
    w = random_experts(num_experts, hidden, inter)
    # The full stacks in the module's own layout, built from the per-expert tensors.
    if activation == "silu":
        w13 = torch.cat([w["gate"], w["up"]], dim=1)                                   # [E, 2I, H]
        b13 = torch.cat([w["gate_bias"], w["up_bias"]], dim=1)
    else:
        w13 = torch.stack([w["gate"], w["up"]], dim=2).reshape(num_experts, 2 * inter, hidden)
        b13 = torch.stack([w["gate_bias"], w["up_bias"]], dim=2).reshape(num_experts, 2 * inter)
    for tp_rank in range(tp_size):
        for ep_rank in range(ep_size):
            kw = dict(activation=activation, bias=True, tp_rank=tp_rank, tp_size=tp_size,
                      ep_rank=ep_rank, ep_size=ep_size)
            per_expert, whole, transposed = (FusedMoE(num_experts, hidden, inter, **kw) for _ in range(3))
            load_per_expert(per_expert, w, bias=True)
            for layer, shard_id, w13_in, w2_in in (
                (whole, None, w13, w["down"]),
                (transposed, "transposed", w13.transpose(1, 2), w["down"].transpose(1, 2)),  # [E, H, 2I], [E, I, H]
            ):
                layer.w13_weight.weight_loader(layer.w13_weight, w13_in, shard_id)
                layer.w2_weight.weight_loader(layer.w2_weight, w2_in, shard_id)
                layer.w13_bias.weight_loader(layer.w13_bias, b13)
                layer.w2_bias.weight_loader(layer.w2_bias, w["down_bias"])
                for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
                    assert torch.equal(getattr(layer, name), getattr(per_expert, name)), (name, shard_id)


@pytest.mark.parametrize("param_name,loaded_shape,shard_id,match", [
    ("w13_weight", (6, 5), (0, "w2"), "does not fill"),
    ("w2_weight", (5, 6), (0, "w1"), "does not fill"),
    ("w13_weight", (6, 5), (4, "w1"), "out of range"),
    ("w13_weight", (6, 5), (0, "gate"), "shard_id must be"),
    ("w13_weight", (6, 5), "q", "shard_id must be"),
    ("w13_weight", (5, 6), (0, "w1"), r"expected \(6, 5\)"),
    ("w13_weight", (4, 13, 5), None, r"expected \(4, 12, 5\)"),
    ("w2_weight", (4, 6, 6), "transposed", "checkpoint tensor has shape"),
    ("w13_bias", (4, 12), "transposed", "applies to weights"),
])
def test_weight_loader_refuses_bad_input(param_name, loaded_shape, shard_id, match):
    layer = FusedMoE(4, 5, 6, bias=True)
    param = getattr(layer, param_name)
    loaded = torch.zeros(loaded_shape)
    with pytest.raises(ValueError, match=match):
        param.weight_loader(param, loaded, shard_id)


def test_constructor_refuses_bad_arguments():
    with pytest.raises(ValueError, match="activation"):
        FusedMoE(4, 8, 8, activation="gelu")
    with pytest.raises(ValueError, match="hidden_size"):
        FusedMoE(4, 0, 8)
    with pytest.raises(ValueError, match="intermediate size, 6, is not divisible by tp_size=4"):
        FusedMoE(4, 8, 6, tp_size=4, tp_rank=0)


# ---- forward ------------------------------------------------------------------------------

@pytest.mark.parametrize("activation,bias", [("silu", False), ("silu", True), ("swiglu_clamped", True)])
def test_single_rank_forward_matches_naive_loop(activation, bias):
    num_experts, hidden, inter, tokens, top_k = 5, 8, 6, 7, 2
    w = random_experts(num_experts, hidden, inter)
    layer = FusedMoE(num_experts, hidden, inter, activation=activation, bias=bias)
    load_per_expert(layer, w, bias=bias)
    x = 3.0 * torch.randn(tokens, hidden, generator=_gen(2))  # large enough that the clamp at 7 bites
    weights, ids = random_routing(tokens, num_experts, top_k)
    with ops.use_backend("torch"):
        out = layer(x, weights, ids)
    torch.testing.assert_close(out, naive_moe(x, w, weights, ids, activation, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp_size,ep_size", [(2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
def test_partial_sums_over_ranks_add_up_to_the_layer(tp_size, ep_size, activation):
    """Every rank's output with reduce_results=False, summed (the all-reduce), is the single-rank output."""
    num_experts, hidden, inter, tokens, top_k = 8, 6, 16, 9, 3
    w = random_experts(num_experts, hidden, inter, seed=3)
    x = torch.randn(tokens, hidden, generator=_gen(4))
    weights, ids = random_routing(tokens, num_experts, top_k, seed=5)
    total = torch.zeros(tokens, hidden)
    with ops.use_backend("torch"):
        for tp_rank in range(tp_size):
            for ep_rank in range(ep_size):
                layer = FusedMoE(num_experts, hidden, inter, activation=activation, bias=True, tp_rank=tp_rank,
                                 tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size, reduce_results=False)
                load_per_expert(layer, w, bias=True)
                total += layer(x, weights, ids)
    torch.testing.assert_close(total, naive_moe(x, w, weights, ids, activation, True), atol=1e-4, rtol=1e-4)


def test_local_topk_ids_anchor():
    # 8 experts over 2 EP ranks; rank 1 holds 4..7: global 5 -> local 1, global 7 -> 3, the rest -> -1.
    layer = FusedMoE(8, 4, 4, ep_rank=1, ep_size=2)
    ids = torch.tensor([[5, 0], [7, 4], [3, 6]], dtype=torch.int32)
    assert layer.local_topk_ids(ids).tolist() == [[1, -1], [3, 0], [-1, 2]]


# ---- the loader's expert mapping ------------------------------------------------------------

class TinyMoEModel(nn.Module):
    """``model.layers.0.mlp.experts`` and nothing else, with the mapping a MoE architecture declares."""

    def __init__(self, mapping, **moe_kwargs) -> None:
        super().__init__()
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.experts = FusedMoE(**moe_kwargs)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.expert_params_mapping = mapping

    @property
    def experts(self) -> FusedMoE:
        return self.model.layers[0].mlp.experts


def test_mapping_triples():
    assert expert_params_mapping(2, gate="w1", up="w3", down="w2")[:3] == [
        ("experts.0.w1.weight", "experts.w13_weight", (0, "w1")),
        ("experts.0.w3.weight", "experts.w13_weight", (0, "w3")),
        ("experts.0.w2.weight", "experts.w2_weight", (0, "w2")),
    ]
    assert len(expert_params_mapping(3, bias=True)) == 3 * 3 * 2
    assert ("experts.gate_up_proj", "experts.w13_weight", "transposed") in fused_expert_params_mapping()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_loader_stacks_per_expert_tensors(tmp_path, tp_size):
    num_experts, hidden, inter = 3, 4, 6
    w = random_experts(num_experts, hidden, inter, seed=7)
    tensors = {}
    for e in range(num_experts):
        prefix = f"model.layers.0.mlp.experts.{e}."
        tensors.update({prefix + "gate_proj.weight": w["gate"][e], prefix + "up_proj.weight": w["up"][e],
                        prefix + "down_proj.weight": w["down"][e]})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for tp_rank in range(tp_size):
        model = TinyMoEModel(expert_params_mapping(num_experts), num_experts=num_experts, hidden_size=hidden,
                             intermediate_size=inter, tp_rank=tp_rank, tp_size=tp_size)
        report = load_weights(model, tmp_path)
        assert report.missing == [] and report.unused == []
        expected = torch.cat([w["gate"].chunk(tp_size, dim=1)[tp_rank], w["up"].chunk(tp_size, dim=1)[tp_rank]], 1)
        assert torch.equal(model.experts.w13_weight, expected)
        assert torch.equal(model.experts.w2_weight, w["down"].chunk(tp_size, dim=2)[tp_rank])


def test_loader_names_a_missing_expert_tensor_as_the_checkpoint_does(tmp_path):
    w = random_experts(2, 4, 6, seed=8)
    tensors = {f"model.layers.0.mlp.experts.{e}.{name}.weight": w[key][e]
               for e in range(2) for name, key in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))}
    del tensors["model.layers.0.mlp.experts.1.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = TinyMoEModel(expert_params_mapping(2), num_experts=2, hidden_size=4, intermediate_size=6)
    with pytest.raises(ValueError, match=r"experts.w13_weight \(checkpoint tensors "
                                         r"model.layers.0.mlp.experts.1.up_proj.weight missing\)"):
        load_weights(model, tmp_path)


def test_loader_takes_stacked_transposed_experts(tmp_path):
    """GPT-OSS layout: gate_up_proj [E, H, 2I] with interleaved columns, down_proj [E, I, H], biases."""
    num_experts, hidden, inter = 2, 4, 3
    w = random_experts(num_experts, hidden, inter, seed=9)
    gate_up = torch.stack([w["gate"], w["up"]], dim=2).reshape(num_experts, 2 * inter, hidden).transpose(1, 2)
    gate_up_bias = torch.stack([w["gate_bias"], w["up_bias"]], dim=2).reshape(num_experts, 2 * inter)
    p = "model.layers.0.mlp.experts."
    save_file({p + "gate_up_proj": gate_up.contiguous(), p + "gate_up_proj_bias": gate_up_bias,
               p + "down_proj": w["down"].transpose(1, 2).contiguous(), p + "down_proj_bias": w["down_bias"]},
              str(tmp_path / "model.safetensors"))
    model = TinyMoEModel(fused_expert_params_mapping(bias=True), num_experts=num_experts, hidden_size=hidden,
                         intermediate_size=inter, activation="swiglu_clamped", bias=True)
    report = load_weights(model, tmp_path)
    assert report.missing == [] and report.unused == []
    x = torch.randn(5, hidden, generator=_gen(10))
    weights, ids = random_routing(5, num_experts, 2, seed=11)
    with ops.use_backend("torch"):
        out = model.experts(x, weights, ids)
    torch.testing.assert_close(out, naive_moe(x, w, weights, ids, "swiglu_clamped", True), atol=1e-4, rtol=1e-4)
