"""MXFP4 decoding (``models.mxfp4``, the reference decoder), the loader keeping ``*_blocks`` / ``*_scales``
packed, and a gpt-oss checkpoint with MXFP4 experts, served packed, matching HF transformers."""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from atom_core.models.loader import load_weights
from atom_core.models.mxfp4 import dequantize_mxfp4


# E2M1 by its definition: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal.
def e2m1_value(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """FP4 codes uint8 [..., G, 32] -> blocks [..., G, 16]: even elements in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def random_mxfp4(shape_rows: tuple[int, ...], cols: int, *, seed: int, exponents=(-6, -3)):
    """Random codes and scales for a weight [*shape_rows, cols]: (blocks, scales, exact float64 values)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*shape_rows, cols // 32, 32), generator=gen, dtype=torch.uint8)
    scales = (127 + torch.randint(exponents[0], exponents[1] + 1, (*shape_rows, cols // 32), generator=gen)).to(
        torch.uint8)
    table = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
    values = table[codes.long()] * torch.pow(2.0, scales.double() - 127)[..., None]
    return pack(codes), scales, values.reshape(*shape_rows, cols)


# ---- the decoder --------------------------------------------------------------------------------

def test_hand_decoded_bytes():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21      # element 0: code 1 (0.5), element 1: code 2 (1.0)
    blocks[0, 1] = 0xF8      # element 2: code 8 (-0.0), element 3: code 15 (-6)
    blocks[0, 15] = 0x7C     # element 30: code 12 (-2), element 31: code 7 (6)
    out = dequantize_mxfp4(blocks, torch.tensor([127], dtype=torch.uint8), torch.float32)
    assert out.shape == (32,)
    assert out[:4].tolist() == [0.5, 1.0, -0.0, -6.0] and out[30:].tolist() == [-2.0, 6.0]
    assert (out[4:30] == 0).all()
    twice = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8), torch.float32)
    assert torch.equal(twice, 2 * out)
    tiny = dequantize_mxfp4(blocks, torch.tensor([0], dtype=torch.uint8), torch.float32)
    assert tiny[1].item() == 2.0 ** -127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_codes_decode_exactly(dtype):
    blocks, scales, expected = random_mxfp4((3, 5), 96, seed=0, exponents=(-20, 20))
    out = dequantize_mxfp4(blocks, scales, dtype)
    assert out.shape == (3, 5, 96) and out.dtype == dtype
    assert torch.equal(out.double(), expected)


def test_matches_transformers_decoder():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales, _ = random_mxfp4((2, 6), 64, seed=1)
    blocks = blocks.reshape(2, 6, 2, 16)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), theirs.transpose(1, 2))


def test_bad_inputs_are_named():
    blocks, scales, _ = random_mxfp4((2,), 32, seed=2)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), scales)
    with pytest.raises(ValueError, match="must be scales"):
        dequantize_mxfp4(blocks, scales[:1])
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(blocks, torch.full_like(scales, 255))


# ---- the loader ---------------------------------------------------------------------------------

class FloatWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight_blocks = nn.Parameter(torch.zeros(4, 64), requires_grad=False)


def test_mxfp4_codes_never_load_into_a_float_parameter(tmp_path):
    """Nothing is decoded at load: uint8 codes meet a float parameter (a model built without the MXFP4
    config) and are refused, not cast."""
    blocks, scales, _ = random_mxfp4((4,), 64, seed=3)
    save_file({"proj.weight_blocks": blocks, "proj.weight_scales": scales}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"proj.weight_blocks.*stored as torch.uint8.*only casts between non-FP8 floating-point dtypes"):
        load_weights(FloatWeight(), tmp_path)


# ---- gpt-oss with MXFP4 experts against HF ------------------------------------------------------

def test_gpt_oss_mxfp4_checkpoint_loads_packed_and_matches_hf(tmp_path):
    """A tiny gpt-oss whose expert weights are MXFP4 values; HF computes with them in fp32, the
    checkpoint stores them as the release does (``*_blocks`` / ``*_scales``, rows = output dim). The
    experts keep the stored bytes (blocks flattened to [E, N, K/2]) and compute with
    ``fused_experts_quant(weight_format="mxfp4")``: the decode is exact, so the logits match HF's (which
    computes with the decoded fp32 weights) within the fp32 parity tolerance."""
    pytest.importorskip("transformers")
    from atom_core import ops
    from tests.models.moe_parity import build_moe_pair
    from tests.models.parity_harness import (
        backends_used,
        check_decode,
        check_ragged_prefill,
    )
    from tests.models.test_parity_gpt_oss import CASES

    case = CASES[0]  # H 64, I 32: both multiples of the 32-element block
    pair = build_moe_pair(case, tmp_path)
    state = {}
    with torch.no_grad():
        for name, param in pair.hf_model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                num_experts, cols, rows = param.shape  # HF keeps x @ W: [E, in, out]
                blocks, scales, values = random_mxfp4((num_experts, rows), cols, seed=len(state))
                param.copy_(values.transpose(1, 2))
                state[name + "_blocks"], state[name + "_scales"] = blocks.reshape(num_experts, rows, -1, 16), scales
            else:
                state[name] = param.detach().clone()
        state.update({n: b.detach().clone() for n, b in pair.hf_model.named_buffers()
                      if n in pair.hf_model.state_dict()})
    (tmp_path / "model.safetensors").unlink()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    model = pair.load_atom()
    for i, hf_layer in enumerate(pair.hf_model.model.layers):
        layer = model.model.layers[i].mlp.experts
        assert layer.weight_format == "mxfp4"
        for ours, stored in ((layer.w13_weight, "gate_up_proj"), (layer.w2_weight, "down_proj")):
            name = f"model.layers.{i}.mlp.experts.{stored}"
            assert ours.dtype == torch.uint8 and torch.equal(ours, state[name + "_blocks"].flatten(-2))
        assert torch.equal(layer.w13_weight_scale, state[f"model.layers.{i}.mlp.experts.gate_up_proj_scales"])
        assert torch.equal(layer.w2_weight_scale, state[f"model.layers.{i}.mlp.experts.down_proj_scales"])
        decoded = dequantize_mxfp4(layer.w13_weight.view(*layer.w13_weight.shape[:2], -1, 16),
                                   layer.w13_weight_scale, torch.float32)
        assert torch.equal(decoded, hf_layer.mlp.experts.gate_up_proj.transpose(1, 2))
    with ops.use_backend("torch"):
        used = backends_used(lambda: check_ragged_prefill(pair, model))
    assert ("fused_experts_quant", "torch") in used and not any(op == "fused_experts" for op, _ in used)
    with ops.use_backend("torch"):
        check_decode(pair, model, 4)
