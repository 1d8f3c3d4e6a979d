"""Expert methods: what a ``FusedMoE`` layer stores for its experts and which fused-MoE op computes them.

Legend: E_r = experts on this rank, H = hidden size, I_r = intermediate units on this rank (each
expert's gate/up rows 2 I_r, down columns I_r), B = 128 (FP8 block), G = 32 (MXFP4 group).

| method (``weight_format``) | ``w13_weight`` / ``w2_weight`` | ``w13_weight_scale`` / ``w2_weight_scale`` | op |
|---|---|---|---|
| ``UnquantizedExperts`` (None) | model dtype ``[E_r, 2I_r, H]`` / ``[E_r, H, I_r]`` | none | ``fused_experts`` |
| ``Fp8Experts`` (``"fp8_block"``) | fp8 e4m3fn, same shapes | fp32 ``[E_r, ceil(2I_r/B), ceil(H/B)]`` / ``[E_r, ceil(H/B), ceil(I_r/B)]`` | ``fused_experts_quant`` |
| ``Fp8Experts`` (``"fp8_channel"``) | fp8 e4m3fn, same shapes | fp32 ``[E_r, 2I_r, 1]`` / ``[E_r, H, 1]`` | ``fused_experts_quant`` |
| ``Mxfp4Experts`` (``"mxfp4"``) | uint8 ``[E_r, 2I_r, H/2]`` / ``[E_r, H, I_r/2]`` (two e2m1 codes a byte) | uint8 e8m0 ``[E_r, 2I_r, H/G]`` / ``[E_r, H, I_r/G]`` | ``fused_experts_quant`` |

Schemes served (``expert_method_for``; everything else is refused naming the layer):

- FP8 128 x 128 blocks with dynamic 1 x 128 activation groups (DeepSeek / HF ``fp8``, compressed-tensors
  ``FP8_BLOCK``, ``load_model(quantization="fp8_block")``) -> ``"fp8_block"``;
- FP8 per-channel weights with dynamic per-token activations (compressed-tensors ``FP8_DYNAMIC``, quark
  ``ptpc_fp8``, ``quantization="fp8"``) -> ``"fp8_channel"``; FP8 per-tensor weights (one scale per
  expert and projection, spread over its rows at load: exact) and dynamic per-tensor activations
  (HF ``fp8`` without blocks) are served there too: the op quantizes activations per token, a finer
  dynamic scale than the checkpoint's per-tensor one (never coarser). Static activation scales are
  refused (the op has no input scale);
- MXFP4 weight-only (gpt-oss's ``*_blocks`` / ``*_scales``, kept packed) -> ``"mxfp4"``.

Every parameter carries how its stored dims follow the logical ones, for ``FusedMoE``'s loaders:
``moe_role`` (which tensor), ``row_unit`` (logical rows per stored row: B for block scales, else 1) and
``col_unit`` (logical columns per stored column: 1; 2 for packed MXFP4 codes; G for e8m0 scales; B for
block scales; None for a per-channel scale's single column, never split). Online quantization sets
``quantize_on_load`` (the ``WeightFormat``) on the two weights: their loader quantizes each unquantized
checkpoint tensor as it is read and writes the scales beside it (``loaded_with`` on the scales).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from atom_core import ops
from atom_core.models.quantization.activation import (
    ActivationQuant,
    QuantizedActivation,
)
from atom_core.models.quantization.linear_methods import quantize_weight
from atom_core.models.quantization.schemes import (
    FP8_BLOCK_128,
    FP8_PER_CHANNEL,
    FP8_PER_TENSOR,
    MXFP4_E2M1,
    MXFP4_GROUP_SIZE,
    UNQUANTIZED,
    ActivationScheme,
    LinearScheme,
    QuantMethod,
    UnsupportedQuantizationError,
)
from atom_core.ops.reference.quant import FP8_DTYPE

BLOCK = 128
EXPERT_WEIGHT_FORMATS = ("fp8_block", "fp8_channel", "mxfp4")
# MXFP4 random weights (dummy loads): uniform codes have RMS 2.93, times 2**-7 is 0.023, about the
# 0.02 of the unquantized dummy initializer.
DUMMY_MXFP4_E8M0 = 127 - 7


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ExpertMethod:
    """Base: ``create_weights`` registers the expert parameters on a ``FusedMoE``, ``check_split`` refuses
    a rank split the format cannot follow, ``apply`` runs the fused-MoE op, ``init_dummy`` fills random
    weights in the stored format."""

    weight_format: str | None = None

    def __init__(self, scheme: LinearScheme, *, online: bool = False) -> None:
        self.scheme = scheme
        self.online = online

    def create_weights(self, layer: nn.Module, num_local: int, hidden: int, inter_local: int,
                       dtype: torch.dtype, make: Callable[..., nn.Parameter]) -> None:
        """Register ``w13_weight``, ``w2_weight`` (and scales) with ``make(shape, dtype, name, row_unit, col_unit)``."""
        raise NotImplementedError

    def check_split(self, layer: nn.Module, where: str) -> None:
        """Refuse (naming ``where``) a rank's slice of the intermediate dim that cuts a scale block."""

    def apply(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              w2_bias: torch.Tensor | None, hidden_quant: QuantizedActivation | None = None) -> torch.Tensor:
        """hidden [T, H] -> [T, H]; ``hidden_quant``: hidden quantized as :meth:`input_quant` says, by the op that
        produced it (methods without an ``input_quant`` never get one)."""
        raise NotImplementedError

    def input_quant(self, layer: nn.Module) -> ActivationQuant | None:
        """How the experts' first GEMM quantizes hidden, when the norm before the block can do it instead (it
        also keeps the float rows for the router: ``models.quantization.activation``); None: hidden only."""
        return None

    @torch.no_grad()
    def init_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> list[nn.Parameter]:
        """Random expert weights in the stored format (one expert at a time); returns the parameters
        filled (the unquantized method fills none: the plain initializer does)."""
        return []

    def describe(self) -> str:
        return self.scheme.describe()


class UnquantizedExperts(ExpertMethod):
    def __init__(self) -> None:
        super().__init__(UNQUANTIZED)

    def create_weights(self, layer, num_local, hidden, inter_local, dtype, make) -> None:
        layer.w13_weight = make((num_local, 2 * inter_local, hidden), dtype, "w13_weight", 1, 1)
        layer.w2_weight = make((num_local, hidden, inter_local), dtype, "w2_weight", 1, 1)
        layer.register_parameter("w13_weight_scale", None)
        layer.register_parameter("w2_weight_scale", None)

    def apply(self, layer, hidden, topk_weights, topk_ids, w2_bias, hidden_quant=None):
        return ops.fused_experts(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                 activation=layer.activation, w13_bias=layer.w13_bias, w2_bias=w2_bias)


class _QuantizedExperts(ExpertMethod):
    def apply(self, layer, hidden, topk_weights, topk_ids, w2_bias, hidden_quant=None):
        q, scale = (None, None) if hidden_quant is None else (hidden_quant.q, hidden_quant.scale)
        return ops.fused_experts_quant(hidden, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                                       layer.w2_weight_scale, topk_weights, topk_ids, weight_format=self.weight_format,
                                       activation=layer.activation, w13_bias=layer.w13_bias, w2_bias=w2_bias,
                                       hidden_q=q, hidden_scale=scale)


class Fp8Experts(_QuantizedExperts):
    """FP8 e4m3fn expert weights with 128 x 128 block scales (``"fp8_block"``) or one scale per output
    row (``"fp8_channel"``)."""

    def __init__(self, scheme: LinearScheme, weight_format: str, *, online: bool = False) -> None:
        super().__init__(scheme, online=online)
        self.weight_format = weight_format
        self.block = weight_format == "fp8_block"
        # what online quantization and dummy weights make: the format the op reads
        self.stored = FP8_BLOCK_128 if self.block else FP8_PER_CHANNEL

    def input_quant(self, layer):
        # the gate/up GEMM's input: fp8 per 1 x 128 group (block) or per token, as fused_experts_quant quantizes it
        return ActivationQuant(FP8_DTYPE, BLOCK if self.block else layer.hidden_size, keep_normed=True)

    def create_weights(self, layer, num_local, hidden, inter_local, dtype, make) -> None:
        layer.w13_weight = make((num_local, 2 * inter_local, hidden), FP8_DTYPE, "w13_weight", 1, 1)
        layer.w2_weight = make((num_local, hidden, inter_local), FP8_DTYPE, "w2_weight", 1, 1)
        if self.block:
            layer.w13_weight_scale = make((num_local, _cdiv(2 * inter_local, BLOCK), _cdiv(hidden, BLOCK)),
                                          torch.float32, "w13_weight_scale", BLOCK, BLOCK)
            layer.w2_weight_scale = make((num_local, _cdiv(hidden, BLOCK), _cdiv(inter_local, BLOCK)),
                                         torch.float32, "w2_weight_scale", BLOCK, BLOCK)
        else:
            layer.w13_weight_scale = make((num_local, 2 * inter_local, 1), torch.float32, "w13_weight_scale", 1, None)
            layer.w2_weight_scale = make((num_local, hidden, 1), torch.float32, "w2_weight_scale", 1, None)
        if self.online:
            for name in ("w13", "w2"):
                getattr(layer, f"{name}_weight").quantize_on_load = self.stored
                getattr(layer, f"{name}_weight_scale").loaded_with = f"{name}_weight"

    def check_split(self, layer, where) -> None:
        # Gate and up are stacked [gate_r; up_r] and each checkpoint part brings its own block rows: the
        # up rows start a block only if I_r is whole blocks; a TP slice of the down columns likewise.
        # (GPT-OSS's interleaved rows come as one stack, quantized whole online: any split.)
        inter = layer.shard.intermediate_size
        if self.block and layer.layout == "halves" and inter % BLOCK:
            raise UnsupportedQuantizationError(
                f"{where}: FP8 128 x 128 block scales cannot follow this split: each expert's intermediate "
                f"size {layer.intermediate_size} gives {inter} units per rank (tp_size {layer.tp_size}), not a "
                f"multiple of {BLOCK}, so gate/up rows and down columns would cut a 128-block; use a "
                "tensor-parallel size that keeps I / tp a multiple of 128, or expert parallelism")

    @torch.no_grad()
    def init_dummy(self, layer, generator, std) -> list[nn.Parameter]:
        for local in range(layer.shard.num_local_experts):
            for name in ("w13", "w2"):
                weight = getattr(layer, f"{name}_weight")
                values = torch.empty(weight.shape[1:], dtype=torch.float32, device=weight.device)
                values.normal_(0.0, std, generator=generator)
                q, scale = quantize_weight(values, self.stored)
                weight.data[local].copy_(q)
                getattr(layer, f"{name}_weight_scale").data[local].copy_(scale)
        return [layer.w13_weight, layer.w2_weight, layer.w13_weight_scale, layer.w2_weight_scale]


class Mxfp4Experts(_QuantizedExperts):
    """MXFP4 expert weights kept packed: e2m1 codes two per byte (low nibble first) and one e8m0 scale
    per 32 inputs, as gpt-oss stores them (``*_blocks`` flattened to ``[..., K/2]``, ``*_scales``)."""

    weight_format = "mxfp4"

    def create_weights(self, layer, num_local, hidden, inter_local, dtype, make) -> None:
        g = MXFP4_GROUP_SIZE
        for name, rows, cols in (("w13", 2 * inter_local, hidden), ("w2", hidden, inter_local)):
            setattr(layer, f"{name}_weight", make((num_local, rows, cols // 2), torch.uint8, f"{name}_weight", 1, 2))
            setattr(layer, f"{name}_weight_scale", make((num_local, rows, cols // g), torch.uint8,
                                                        f"{name}_weight_scale", 1, g))

    def check_split(self, layer, where) -> None:
        g, inter = MXFP4_GROUP_SIZE, layer.shard.intermediate_size
        if layer.hidden_size % g or inter % g:
            raise UnsupportedQuantizationError(
                f"{where}: MXFP4 experts need the hidden size ({layer.hidden_size}) and each rank's intermediate "
                f"units ({inter} = {layer.intermediate_size} / tp_size {layer.tp_size}) to be multiples of {g} "
                "(whole e8m0 scale groups); use a tensor-parallel size that keeps them so, or expert parallelism")

    @torch.no_grad()
    def init_dummy(self, layer, generator, std) -> list[nn.Parameter]:
        for name in ("w13", "w2"):
            weight, scale = getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_weight_scale")
            for local in range(weight.shape[0]):
                codes = torch.randint(0, 256, weight.shape[1:], generator=generator, device=weight.device,
                                      dtype=torch.int32)
                weight.data[local].copy_(codes.to(torch.uint8))
            scale.data.fill_(DUMMY_MXFP4_E8M0)
        return [layer.w13_weight, layer.w2_weight, layer.w13_weight_scale, layer.w2_weight_scale]


_DYNAMIC_ROWWISE = (ActivationScheme.DYNAMIC_PER_TOKEN, ActivationScheme.DYNAMIC_PER_TENSOR)


def expert_method_for(scheme: LinearScheme, *, online: bool = False, where: str = "experts") -> ExpertMethod:
    """The ``ExpertMethod`` serving ``scheme`` (see the module docstring), or ``UnsupportedQuantizationError``
    naming ``where`` (the layer) and what is served."""
    if not scheme.is_quantized:
        return UnquantizedExperts()
    if scheme.method is QuantMethod.FP8:
        if scheme.weight == FP8_BLOCK_128 and scheme.activation is ActivationScheme.DYNAMIC_PER_GROUP_128:
            return Fp8Experts(scheme, "fp8_block", online=online)
        if scheme.weight in (FP8_PER_CHANNEL, FP8_PER_TENSOR) and scheme.activation in _DYNAMIC_ROWWISE:
            return Fp8Experts(scheme, "fp8_channel", online=online)
    if scheme.method is QuantMethod.MXFP4 and scheme.weight == MXFP4_E2M1 and not online:
        return Mxfp4Experts(scheme)
    raise UnsupportedQuantizationError(
        f"{where}: MoE experts quantized as {scheme.describe()} are not served; the fused MoE takes FP8 "
        "128 x 128 blocks with dynamic 1 x 128 activation groups, FP8 per-channel or per-tensor weights with "
        "dynamic activations (quantized per token), and MXFP4 weight-only (gpt-oss)")
