"""Linear methods: what a linear layer stores (weight and scale parameters) and how it computes.

Legend: T = tokens, K = input features on this rank, N = output features on this rank (a fused
layer's parts one after another: q | k | v, gate | up), P = parts of a fused layer (1 unfused),
B = 128 (the FP8 block / activation-group size). Scales are float32 and multiply (``w ≈ q * s``).

| method | parameters (checkpoint names) | forward |
|---|---|---|
| ``UnquantizedLinear`` | ``weight`` [N, K] model dtype | ``F.linear`` |
| ``Fp8Linear`` per-tensor | ``weight`` fp8 [N, K], ``weight_scale`` [P] (one per part) | activation quant, scaled GEMM |
| ``Fp8Linear`` per-channel | ``weight`` fp8 [N, K], ``weight_scale`` [N, 1] | activation quant, ``scaled_mm_per_token`` |
| ``Fp8Linear`` block 128 | ``weight`` fp8 [N, K], ``weight_scale`` [ceil(N/B), ceil(K/B)] | ``per_group_quant``, ``scaled_mm_block`` |
| ``Int8Linear`` per-channel | ``weight`` int8 [N, K], ``weight_scale`` [N, 1] | ``per_token_quant`` int8, ``scaled_mm_per_token`` |

Static activations add ``input_scale`` [P] (one per part, from the checkpoint). The block format's
checkpoint name ``weight_scale_inv`` is renamed to ``weight_scale`` by the loader (it multiplies).
Dynamic per-group-128 and per-token activations may arrive already quantized by the op before the layer
(``input_quant``, ``QuantizedActivation``: ``models.quantization.activation``); the GEMM then runs alone.

Each parameter says how it is split across tensor-parallel ranks, for the layer's ``weight_loader``
(``layers.linear``): ``output_dim`` (0: rows follow the output features; None: not split by
output), ``input_dim`` (1: columns follow the input features; None: not split by input),
``block_size`` (B: those dims count 128-blocks, not features), ``per_part`` (one value per fused
part, loaded by shard id). A method never loads tensors itself: the layer cuts each rank's piece.

Online quantization (``online=True``, ``load_model(..., quantization="fp8" | "fp8_block")``): the
weight parameter is created in FP8 with ``quantize_on_load``; the layer's loader quantizes each
unquantized checkpoint tensor as it is read (``quantize_weight``) and writes the scales beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from atom_core import ops
from atom_core.models.quantization.activation import ActivationQuant, QuantizedActivation
from atom_core.models.quantization.schemes import (
    FP8_BLOCK_128,
    FP8_BLOCK_SHAPE,
    FP8_PER_CHANNEL,
    FP8_PER_TENSOR,
    INT8_PER_CHANNEL,
    UNQUANTIZED,
    ActivationScheme,
    LinearScheme,
    QuantMethod,
    UnsupportedQuantizationError,
    WeightFormat,
)
from atom_core.ops.reference.quant import (
    FP8_DTYPE,
    INT8_DTYPE,
    per_block_quant,
    round_to_format,
    scale_from_amax,
)

BLOCK = FP8_BLOCK_SHAPE[0]  # 128: weight block rows = cols = activation group size
DUMMY_CHUNK_ELEMENTS = 1 << 24  # fp32 values drawn at a time for random quantized weights (64 MiB)
# Static input scale of random-weight layers: activations up to 16 in magnitude unclipped (a normed
# hidden state of a random model stays well inside).
DUMMY_INPUT_SCALE = 16.0 / 448.0


def _offsets(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(start, size) of consecutive parts of ``sizes`` rows."""
    out, start = [], 0
    for size in sizes:
        out.append((start, size))
        start += size
    return out


def make_param(shape: Sequence[int], dtype: torch.dtype, label: str, loader: Callable[..., None], *,
               output_dim: int | None = 0, input_dim: int | None = 1, block_size: int | None = None,
               per_part: bool = False) -> nn.Parameter:
    """An uninitialised inference parameter (no grad) with its ``label``, ``weight_loader`` and the
    sharding attributes described in the module docstring."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.label = label
    param.weight_loader = loader
    param.output_dim = output_dim
    param.input_dim = input_dim
    param.block_size = block_size
    param.per_part = per_part
    return param


def quantize_weight(w: torch.Tensor, weight: WeightFormat, *, row_amax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize an unquantized weight [N, K] (online quantization and random quantized weights; tests use
    it to write offline checkpoints).

    ``FP8_PER_CHANNEL``: ``(q fp8 [N, K], scale [N, 1])``, scale = max(amax of the row, 1e-10) / 448
    (the rule of ``ops.reference.quant``); ``row_amax`` [N] replaces the amax of the rows of ``w``
    (a row-parallel rank quantizing its columns with the full row's scale). ``INT8_PER_CHANNEL``:
    likewise with 127 and int8 rounding. ``FP8_PER_TENSOR``: ``(q fp8 [N, K], scale [1])``.
    ``FP8_BLOCK_128``: ``(q fp8 [N, K], scale [ceil(N/128), ceil(K/128)])``, one scale per 128 x 128 tile
    (``ops.reference.quant.per_block_quant``). Arithmetic in fp32 on ``w``'s device.
    """
    if weight in (FP8_PER_CHANNEL, INT8_PER_CHANNEL):
        dtype = FP8_DTYPE if weight == FP8_PER_CHANNEL else INT8_DTYPE
        wf = w.float()
        amax = wf.abs().amax(dim=1) if row_amax is None else row_amax.float().to(wf.device)
        scale = scale_from_amax(amax, dtype).reshape(-1, 1)
        return round_to_format(wf / scale, dtype), scale
    if weight == FP8_PER_TENSOR:
        wf = w.float()
        scale = scale_from_amax(wf.abs().amax(), FP8_DTYPE).reshape(1)
        return round_to_format(wf / scale, FP8_DTYPE), scale
    if weight == FP8_BLOCK_128:
        return per_block_quant(w, FP8_DTYPE, BLOCK)
    raise UnsupportedQuantizationError(f"online quantization to {weight.describe()} weights is not supported")


class LinearMethod:
    """Base of the linear methods: ``create_weights`` registers the layer's parameters,
    ``process_weights_after_loading`` fixes them up once loaded, ``apply`` computes the layer."""

    def __init__(self, scheme: LinearScheme, *, online: bool = False) -> None:
        self.scheme = scheme
        self.online = online

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int],
                       dtype: torch.dtype, weight_loader: Callable[..., None]) -> None:
        """Register ``layer.weight`` [sum(output_sizes), input_size] and the method's scales (per rank)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Derive what ``apply`` reads from the loaded parameters (idempotent)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, K] (any leading dims) -> [T, N] in x's dtype, ``bias`` [N] added when given. Methods with an
        ``input_quant`` also take x as a ``QuantizedActivation`` quantized that way (2-D)."""
        raise NotImplementedError

    def input_quant(self, input_size: int) -> ActivationQuant | None:
        """How ``apply`` quantizes an input of ``input_size`` features when the producer can do it instead
        (``models.quantization.activation``); None: it takes the float activation only."""
        return None

    def init_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> list[nn.Parameter]:
        """Random weights in the stored format (``load_format="dummy"``): normal(0, ``std``) values quantized
        as the scheme stores them, a chunk of rows at a time; returns the parameters filled (none for an
        unquantized layer: the plain initializer fills it)."""
        return []

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight as the GEMM multiplies by it, fp32 [N, K]: the stored values times their scales
        (read from the loaded ``weight`` / ``weight_scale``; for a layer whose weight is used as a tensor, not
        through ``apply``: MLA's ``kv_b_proj``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot dequantize its weight")

    def describe(self) -> str:
        return self.scheme.describe()


class UnquantizedLinear(LinearMethod):
    """``weight`` [N, K] in the model dtype; ``F.linear``."""

    def __init__(self) -> None:
        super().__init__(UNQUANTIZED)

    def create_weights(self, layer, input_size, output_sizes, dtype, weight_loader) -> None:
        name = type(layer).__name__
        layer.weight = make_param((sum(output_sizes), input_size), dtype, f"{name}.weight", weight_loader)

    def apply(self, layer, x, bias):
        return torch.nn.functional.linear(x, layer.weight, bias)

    def dequantized_weight(self, layer) -> torch.Tensor:
        return layer.weight.float()


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class _ScaledLinear(LinearMethod):
    """Shared body of FP8 and INT8: an 8-bit weight, its scales, an optional static ``input_scale``."""

    weight_dtype: torch.dtype

    def create_weights(self, layer, input_size, output_sizes, dtype, weight_loader) -> None:
        name = type(layer).__name__
        rows, parts = sum(output_sizes), len(output_sizes)
        layer.weight = make_param((rows, input_size), self.weight_dtype, f"{name}.weight", weight_loader)
        fmt = self.scheme.weight
        if fmt.scales == "per_tensor":
            scale = make_param((parts,), torch.float32, f"{name}.weight_scale", weight_loader,
                               output_dim=None, input_dim=None, per_part=True)
        elif fmt.scales == "per_channel":
            scale = make_param((rows, 1), torch.float32, f"{name}.weight_scale", weight_loader, input_dim=None)
        else:  # per_block
            scale = make_param((-(-rows // BLOCK), -(-input_size // BLOCK)), torch.float32,
                               f"{name}.weight_scale", weight_loader, block_size=BLOCK)
        layer.weight_scale = scale
        if self.scheme.activation is ActivationScheme.STATIC_PER_TENSOR:
            layer.input_scale = make_param((parts,), torch.float32, f"{name}.input_scale", weight_loader,
                                           output_dim=None, input_dim=None, per_part=True)
        if self.online:
            layer.weight.quantize_on_load = self.scheme.weight
            layer.weight_scale.loaded_with = "weight"  # filled by the weight's loader, not by a checkpoint tensor
        # What apply reads, set by process_weights_after_loading.
        layer.register_buffer("_w_scale", None, persistent=False)
        layer.register_buffer("_a_scale", None, persistent=False)
        layer.output_part_sizes = list(output_sizes)

    def process_weights_after_loading(self, layer) -> None:
        fmt = self.scheme.weight
        scale = layer.weight_scale.data
        if fmt.scales == "per_tensor":
            if self.scheme.activation is not ActivationScheme.DYNAMIC_PER_TOKEN and bool((scale == scale[0]).all()):
                layer._w_scale = scale[:1].clone()  # one scale: the per-tensor GEMM
            else:
                # A fused layer keeps one scale per part (q, k, v or gate, up). Rather than requantizing
                # every part to the largest scale (vLLM's choice: it rounds each weight again and loses
                # up to half an FP8 step on the parts with smaller scales), each part's scalar becomes
                # that part's rows of a per-channel [N, 1] scale: the stored FP8 values stay exact and
                # the per-token GEMM (rowwise scales, as fast as per-tensor in cuBLASLt / CK) takes the
                # per-tensor activation scale broadcast to [T, 1].
                sizes = torch.tensor(layer.output_part_sizes, device=scale.device)
                layer._w_scale = scale.repeat_interleave(sizes).reshape(-1, 1).contiguous()
        else:
            layer._w_scale = scale.contiguous()
        if self.scheme.activation is ActivationScheme.STATIC_PER_TENSOR:
            # One input feeds every part of a fused layer, and calibration tools observe that same input
            # for q, k and v (gate and up): the parts' scales agree. Where they do not, the largest is
            # taken (vLLM's rule): no part's activations then saturate.
            layer._a_scale = layer.input_scale.data.max().reshape(1).clone()

    @torch.no_grad()
    def init_dummy(self, layer, generator, std) -> list[nn.Parameter]:
        weight, scale, fmt = layer.weight, layer.weight_scale, self.scheme.weight
        rows, cols = weight.shape
        if fmt.scales == "per_tensor":  # one scale per fused part
            chunks = list(zip(range(len(layer.output_part_sizes)), _offsets(layer.output_part_sizes)))
        else:  # rows in chunks of whole 128-blocks (bounds the fp32 temporary)
            step = max(BLOCK, (DUMMY_CHUNK_ELEMENTS // max(cols, 1)) // BLOCK * BLOCK)
            chunks = [(None, (start, min(step, rows - start))) for start in range(0, rows, step)]
        for part, (start, size) in chunks:
            values = torch.empty(size, cols, dtype=torch.float32, device=weight.device)
            values.normal_(0.0, std, generator=generator)
            q, s = quantize_weight(values, fmt)
            weight.data.narrow(0, start, size).copy_(q)
            if part is not None:
                scale.data[part:part + 1].copy_(s)
            elif fmt.scales == "per_block":
                scale.data.narrow(0, start // BLOCK, s.shape[0]).copy_(s)
            else:
                scale.data.narrow(0, start, size).copy_(s)
        filled = [weight, scale]
        if self.scheme.activation is ActivationScheme.STATIC_PER_TENSOR:
            layer.input_scale.data.fill_(DUMMY_INPUT_SCALE)
            filled.append(layer.input_scale)
        return filled

    def dequantized_weight(self, layer) -> torch.Tensor:
        w, scale, fmt = layer.weight.float(), layer.weight_scale.float(), self.scheme.weight
        rows, cols = w.shape
        if fmt.scales == "per_tensor":  # one scalar per fused part, over that part's rows
            sizes = torch.tensor(layer.output_part_sizes, device=scale.device)
            return w * scale.repeat_interleave(sizes).reshape(rows, 1)
        if fmt.scales == "per_channel":
            return w * scale.reshape(rows, 1)
        return w * scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]

    def _quantize_input(self, layer, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        act = self.scheme.activation
        if act is ActivationScheme.DYNAMIC_PER_TOKEN:
            return ops.per_token_quant(x2, dtype=self.weight_dtype)
        if act is ActivationScheme.DYNAMIC_PER_TENSOR:
            return ops.per_tensor_quant(x2, dtype=self.weight_dtype)
        if act is ActivationScheme.STATIC_PER_TENSOR:
            return ops.per_tensor_quant(x2, dtype=self.weight_dtype, scale=layer._a_scale)
        if act is ActivationScheme.DYNAMIC_PER_GROUP_128:
            return ops.per_group_quant(x2, dtype=self.weight_dtype, group_size=BLOCK)
        raise UnsupportedQuantizationError(f"{self.scheme.describe()}: no activation quantization")

    def input_quant(self, input_size):
        act = self.scheme.activation
        if act is ActivationScheme.DYNAMIC_PER_GROUP_128:
            return ActivationQuant(self.weight_dtype, BLOCK)
        if act is ActivationScheme.DYNAMIC_PER_TOKEN:
            return ActivationQuant(self.weight_dtype, input_size)
        return None

    def apply(self, layer, x, bias):
        if layer._w_scale is None:
            raise RuntimeError(f"{type(layer).__name__}: process_weights_after_loading() has not run "
                               "(load_model and load_weights run it)")
        w, w_scale = layer.weight, layer._w_scale
        kwargs = {"out_dtype": x.dtype, "bias": bias}
        if isinstance(x, QuantizedActivation):  # quantized by the op that produced it, as input_quant says
            q, a_scale = x.q, x.scale
        else:
            q, a_scale = self._quantize_input(layer, _flat(x))
        if self.scheme.weight.scales == "per_block":
            out = ops.scaled_mm_block(q, a_scale, w, w_scale, **kwargs)
        elif w_scale.numel() == 1 and a_scale.numel() == 1:
            out = ops.scaled_mm_per_tensor(q, a_scale, w, w_scale, **kwargs)
        else:
            if a_scale.shape[0] != q.shape[0]:  # a per-tensor activation scale against per-channel weights
                a_scale = a_scale.reshape(1, 1).expand(q.shape[0], 1).contiguous()
            out = ops.scaled_mm_per_token(q, a_scale, w, w_scale, **kwargs)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Fp8Linear(_ScaledLinear):
    """FP8 e4m3 weights with per-tensor (one per fused part), per-channel or 128 x 128 block scales;
    activations quantized as the scheme says (dynamic per-token / per-tensor, static per-tensor,
    dynamic per-group-128 for blocks). See the module docstring's table."""

    weight_dtype = FP8_DTYPE


class Int8Linear(_ScaledLinear):
    """Symmetric INT8 per-channel weights with dynamic per-token INT8 activations."""

    weight_dtype = INT8_DTYPE


_METHODS = {
    (QuantMethod.FP8, FP8_PER_TENSOR): Fp8Linear,
    (QuantMethod.FP8, FP8_PER_CHANNEL): Fp8Linear,
    (QuantMethod.FP8, FP8_BLOCK_128): Fp8Linear,
    (QuantMethod.INT8, INT8_PER_CHANNEL): Int8Linear,
}


def linear_method_for(scheme: LinearScheme, *, online: bool = False, where: str = "layer") -> LinearMethod:
    """The ``LinearMethod`` serving ``scheme`` (``UnsupportedQuantizationError`` naming ``where`` otherwise)."""
    if not scheme.is_quantized:
        return UnquantizedLinear()
    cls = _METHODS.get((scheme.method, scheme.weight))
    if cls is None:
        raise UnsupportedQuantizationError(f"{where}: no dense linear method serves {scheme.describe()}")
    return cls(scheme, online=online)
