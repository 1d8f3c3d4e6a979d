"""MXFP4 decoding (``models.mxfp4``), the loader's pairing of ``*_blocks`` with ``*_scales``, and a
gpt-oss checkpoint with MXFP4 experts matching HF transformers."""

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

class TwoWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight_blocks = nn.Parameter(torch.zeros(4, 64), requires_grad=False)
        self.plain = nn.Parameter(torch.zeros(3), requires_grad=False)


@pytest.mark.parametrize("sharded", [False, True])
def test_loader_decodes_blocks_with_their_scales(tmp_path, sharded):
    blocks, scales, expected = random_mxfp4((4,), 64, seed=3)
    tensors = {"proj.weight_blocks": blocks, "proj.weight_scales": scales, "plain": torch.arange(3.0)}
    if sharded:  # the scales in another shard than their blocks
        groups = {"a.safetensors": {"proj.weight_blocks": blocks, "plain": tensors["plain"]},
                  "b.safetensors": {"proj.weight_scales": scales}}
        for file_name, group in groups.items():
            save_file(group, str(tmp_path / file_name))
        weight_map = {name: file_name for file_name, group in groups.items() for name in group}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    model = TwoWeights()
    report = load_weights(model, tmp_path)
    assert torch.equal(model.proj.weight_blocks.double(), expected)
    assert torch.equal(model.plain, torch.arange(3.0))
    assert "proj.weight_scales" in report.skipped and not report.unused and not report.missing


# ---- gpt-oss with MXFP4 experts against HF ------------------------------------------------------

def test_gpt_oss_mxfp4_checkpoint_matches_hf(tmp_path):
    """A tiny gpt-oss whose expert weights are MXFP4 values; HF computes with them in fp32, the
    checkpoint stores them as the release does (``*_blocks`` / ``*_scales``, rows = output dim)."""
    pytest.importorskip("transformers")
    from atom_core import ops
    from tests.models.moe_parity import build_moe_pair
    from tests.models.parity_harness import check_decode, check_ragged_prefill
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
    layer = model.model.layers[0].mlp.experts
    hf_layer = pair.hf_model.model.layers[0].mlp.experts
    assert torch.equal(layer.w13_weight, hf_layer.gate_up_proj.transpose(1, 2))
    with ops.use_backend("torch"):
        check_ragged_prefill(pair, model)
        check_decode(pair, model, 4)
