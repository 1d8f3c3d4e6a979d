"""Quantized checkpoints: a checkpoint's ``quantization_config`` as one ``QuantConfig`` with per-layer rules.

``parse_quant_config(config_json.get("quantization_config"), source_file=path)`` reads the HF
``fp8`` / ``mxfp4``, compressed-tensors and AMD Quark formats and refuses what atom_core cannot
serve by name; ``QuantConfig.scheme_for(layer_name, packed_from=...)`` gives a linear layer its
``LinearScheme`` (method, weight format, activation scheme). Pure Python: no torch, no
quantization library (compressed-tensors and amd-quark are test dependencies only).
"""

from atom_core.models.quantization.config import QuantConfig, check_quantization_supported, parse_quant_config
from atom_core.models.quantization.rules import LayerRule, checkpoint_modules
from atom_core.models.quantization.schemes import (
    FP8_BLOCK_128,
    FP8_KV_CACHE,
    FP8_PER_CHANNEL,
    FP8_PER_TENSOR,
    INT8_PER_CHANNEL,
    MXFP4_E2M1,
    SUPPORTED_ACTIVATIONS,
    UNQUANTIZED,
    ActivationScheme,
    KVCacheScheme,
    LinearScheme,
    QuantMethod,
    UnsupportedQuantizationError,
    WeightFormat,
)

__all__ = [
    "FP8_BLOCK_128",
    "FP8_KV_CACHE",
    "FP8_PER_CHANNEL",
    "FP8_PER_TENSOR",
    "INT8_PER_CHANNEL",
    "MXFP4_E2M1",
    "SUPPORTED_ACTIVATIONS",
    "UNQUANTIZED",
    "ActivationScheme",
    "KVCacheScheme",
    "LayerRule",
    "LinearScheme",
    "QuantConfig",
    "QuantMethod",
    "UnsupportedQuantizationError",
    "WeightFormat",
    "check_quantization_supported",
    "checkpoint_modules",
    "parse_quant_config",
]
