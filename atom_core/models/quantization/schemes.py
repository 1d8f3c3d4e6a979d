"""What one quantized linear layer is: its method, weight format, activation scheme (and the KV cache's).

Legend: N = output features, K = input features of one linear layer (``nn.Linear`` stores the
weight ``[N, K]``); T = tokens. Scales are float32 unless said otherwise.

Weight formats (``WeightFormat``) and the tensors a checkpoint stores beside the weight:

- ``FP8_PER_TENSOR``: weight float8_e4m3fn [N, K], one scale (``weight_scale``, [] or [1]);
- ``FP8_PER_CHANNEL``: weight float8_e4m3fn [N, K], one scale per output row (``weight_scale``
  [N] or [N, 1]);
- ``FP8_BLOCK_128``: weight float8_e4m3fn [N, K], one scale per 128 x 128 block
  (``weight_scale_inv`` in HF/DeepSeek checkpoints, ``weight_scale`` in compressed-tensors:
  [ceil(N / 128), ceil(K / 128)]; despite the name, ``W = W_fp8 * scale`` in both);
- ``INT8_PER_CHANNEL``: weight int8 [N, K], symmetric, ``weight_scale`` [N] or [N, 1];
- ``MXFP4_E2M1``: e2m1 codes two per byte, uint8 [..., N, K / 32, 16], and one e8m0 scale per 32
  inputs, uint8 [..., N, K / 32] (``models.mxfp4`` decodes them).

Activation schemes (``ActivationScheme``): how the input x [T, K] is quantized before the GEMM,
to the weight's dtype family (FP8 e4m3 for FP8 weights, int8 for INT8 weights):
dynamic per-token (one scale per row of x, computed each step), dynamic per-tensor, static
per-tensor (``input_scale`` from the checkpoint), dynamic per-group-128 (one scale per 128
consecutive inputs of a token: the block GEMM's 1 x 128 groups), or none (weight-only: x stays in
the model dtype).

``SUPPORTED_ACTIVATIONS`` is the one table of the combinations atom_core serves; everything
else is refused by name (``UnsupportedQuantizationError``) while the config is parsed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class UnsupportedQuantizationError(ValueError):
    """A quantization config (or one of its layers) that atom_core cannot serve; the message names it."""


class QuantMethod(str, Enum):
    """The linear method family a layer needs."""

    UNQUANTIZED = "unquantized"
    FP8 = "fp8"
    INT8 = "int8"
    MXFP4 = "mxfp4"


class ActivationScheme(str, Enum):
    """How a quantized layer's input activations are quantized (see the module docstring)."""

    NONE = "none"                                    # weight-only
    DYNAMIC_PER_TOKEN = "dynamic_per_token"
    DYNAMIC_PER_TENSOR = "dynamic_per_tensor"
    STATIC_PER_TENSOR = "static_per_tensor"          # input_scale stored in the checkpoint
    DYNAMIC_PER_GROUP_128 = "dynamic_per_group_128"  # block FP8 only


ACTIVATION_GROUP_SIZE = 128  # inputs per activation scale of DYNAMIC_PER_GROUP_128
FP8_BLOCK_SHAPE = (128, 128)  # the only weight block the block GEMM takes (DeepSeek-V3's)
MXFP4_GROUP_SIZE = 32         # OCP microscaling: one e8m0 scale per 32 e2m1 values


@dataclass(frozen=True)
class WeightFormat:
    """How a weight is stored: element dtype, scale granularity and scale dtype.

    ``dtype``: ``"float8_e4m3fn"``, ``"int8"`` or ``"float4_e2m1"`` (torch's names where torch has one).
    ``scales``: ``"per_tensor"``, ``"per_channel"`` (per output row), ``"per_block"`` or
    ``"per_group"`` (per ``group_size`` consecutive inputs of a row).
    ``block_shape``: (rows, cols) of the weight sharing one scale, for ``per_block``.
    ``scale_dtype``: ``"float32"``, or ``"e8m0"`` (a biased power-of-two exponent, MXFP4).
    """

    dtype: str
    scales: str
    block_shape: tuple[int, int] | None = None
    group_size: int | None = None
    scale_dtype: str = "float32"

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "scales": self.scales,
                "block_shape": None if self.block_shape is None else list(self.block_shape),
                "group_size": self.group_size, "scale_dtype": self.scale_dtype}

    def describe(self) -> str:
        name = {"float8_e4m3fn": "FP8 e4m3", "int8": "INT8", "float4_e2m1": "MXFP4 e2m1"}.get(self.dtype, self.dtype)
        if self.scales == "per_block":
            return f"{name} per-block {list(self.block_shape)}"
        if self.scales == "per_group":
            return f"{name} per-group {self.group_size} ({self.scale_dtype} scales)"
        return f"{name} {self.scales.replace('_', '-')}"


FP8_PER_TENSOR = WeightFormat("float8_e4m3fn", "per_tensor")
FP8_PER_CHANNEL = WeightFormat("float8_e4m3fn", "per_channel")
FP8_BLOCK_128 = WeightFormat("float8_e4m3fn", "per_block", block_shape=FP8_BLOCK_SHAPE)
INT8_PER_CHANNEL = WeightFormat("int8", "per_channel")
MXFP4_E2M1 = WeightFormat("float4_e2m1", "per_group", group_size=MXFP4_GROUP_SIZE, scale_dtype="e8m0")

_FP8_ACTIVATIONS = frozenset({ActivationScheme.STATIC_PER_TENSOR, ActivationScheme.DYNAMIC_PER_TENSOR,
                              ActivationScheme.DYNAMIC_PER_TOKEN})
# Weight format -> the activation schemes served with it. A per-tensor weight scale broadcasts to
# per-channel, so per-tensor and per-channel FP8 weights take the same activations. The block GEMM
# reads 1 x 128 activation groups; INT8 has one GEMM (per-token x per-channel); MXFP4 is weight-only.
SUPPORTED_ACTIVATIONS: dict[WeightFormat, frozenset[ActivationScheme]] = {
    FP8_PER_TENSOR: _FP8_ACTIVATIONS,
    FP8_PER_CHANNEL: _FP8_ACTIVATIONS,
    FP8_BLOCK_128: frozenset({ActivationScheme.DYNAMIC_PER_GROUP_128}),
    INT8_PER_CHANNEL: frozenset({ActivationScheme.DYNAMIC_PER_TOKEN}),
    MXFP4_E2M1: frozenset({ActivationScheme.NONE}),
}
_METHOD_OF_DTYPE = {"float8_e4m3fn": QuantMethod.FP8, "int8": QuantMethod.INT8, "float4_e2m1": QuantMethod.MXFP4}


@dataclass(frozen=True)
class LinearScheme:
    """The quantization of one linear layer: ``method``, ``weight`` format (None when unquantized)
    and ``activation`` scheme. Build quantized ones with ``make_scheme`` (which checks the
    combination); ``UNQUANTIZED`` is the plain layer."""

    method: QuantMethod
    weight: WeightFormat | None = None
    activation: ActivationScheme = ActivationScheme.NONE

    def __post_init__(self) -> None:
        if (self.method is QuantMethod.UNQUANTIZED) != (self.weight is None):
            raise ValueError(f"LinearScheme: method {self.method.value} with weight {self.weight}")

    @property
    def is_quantized(self) -> bool:
        return self.method is not QuantMethod.UNQUANTIZED

    def to_dict(self) -> dict:
        return {"method": self.method.value, "weight": None if self.weight is None else self.weight.to_dict(),
                "activation": self.activation.value}

    def describe(self) -> str:
        if not self.is_quantized:
            return "unquantized"
        act = "weight-only" if self.activation is ActivationScheme.NONE else \
            f"{self.activation.value.replace('_', ' ')} activations"
        return f"{self.weight.describe()} weights, {act}"


UNQUANTIZED = LinearScheme(QuantMethod.UNQUANTIZED)


def make_scheme(weight: WeightFormat, activation: ActivationScheme, *, where: str) -> LinearScheme:
    """The ``LinearScheme`` of ``weight`` with ``activation``; ``UnsupportedQuantizationError``
    naming ``where`` (the config key) when ``SUPPORTED_ACTIVATIONS`` does not list the pair."""
    served = SUPPORTED_ACTIVATIONS.get(weight)
    if served is None:
        raise UnsupportedQuantizationError(f"{where}: {weight.describe()} weights are not supported")
    if activation not in served:
        wanted = "weight-only" if activation is ActivationScheme.NONE else \
            f"{activation.value.replace('_', ' ')} activations"
        offered = ", ".join(sorted(a.value.replace("_", " ") for a in served))
        raise UnsupportedQuantizationError(
            f"{where}: {weight.describe()} weights with {wanted} are not supported "
            f"(with these weights: {offered})")
    return LinearScheme(_METHOD_OF_DTYPE[weight.dtype], weight, activation)


def fp8_block_format(block_shape, *, where: str) -> WeightFormat:
    """``FP8_BLOCK_128`` for a block shape ``[128, 128]``; any other shape is refused by name."""
    if (not isinstance(block_shape, (list, tuple)) or len(block_shape) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in block_shape)):
        raise UnsupportedQuantizationError(f"{where}: block shape must be two ints, got {block_shape!r}")
    if tuple(block_shape) != FP8_BLOCK_SHAPE:
        raise UnsupportedQuantizationError(
            f"{where}: FP8 weight blocks of {list(block_shape)} are not supported; only "
            f"{list(FP8_BLOCK_SHAPE)} (the block GEMM's 128 x 128 weight blocks x 1 x 128 activation groups)")
    return FP8_BLOCK_128


@dataclass(frozen=True)
class KVCacheScheme:
    """A quantized KV cache: ``dtype`` of the pool, one static ``k_scale`` and ``v_scale`` per attention
    layer read from the checkpoint (``scales="per_tensor"``)."""

    dtype: str = "float8_e4m3fn"
    scales: str = "per_tensor"

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "scales": self.scales}


FP8_KV_CACHE = KVCacheScheme()
