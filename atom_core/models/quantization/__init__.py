"""Quantized checkpoints: a checkpoint's ``quantization_config`` as one ``QuantConfig`` with per-layer rules.

``parse_quant_config(config_json.get("quantization_config"), source_file=path)`` reads the HF
``fp8`` / ``mxfp4``, compressed-tensors and AMD Quark formats and refuses what atom_core cannot
serve by name; ``QuantConfig.scheme_for(layer_name, packed_from=...)`` gives a linear layer its
``LinearScheme`` (method, weight format, activation scheme); ``linear_methods`` turns a scheme into
the layer's parameters and forward (``UnquantizedLinear``, ``Fp8Linear``, ``Int8Linear``);
``expert_methods`` does the same for a ``FusedMoE``'s experts (unquantized, FP8 block / per-channel,
MXFP4 kept packed); ``online_quant_config("fp8" | "fp8_block")`` is ``load_model(quantization=...)``'s
config; ``dummy.initialize_dummy_quantized_weights`` fills a quantized model with random weights in its
stored formats. The
parsers are pure Python; no quantization library is imported (compressed-tensors and amd-quark
are test dependencies only).
"""

from atom_core.models.quantization.config import (
    ONLINE_QUANTIZATION,
    QuantConfig,
    check_quantization_supported,
    online_quant_config,
    parse_quant_config,
)
from atom_core.models.quantization.dummy import initialize_dummy_quantized_weights
from atom_core.models.quantization.expert_methods import (
    EXPERT_WEIGHT_FORMATS,
    ExpertMethod,
    Fp8Experts,
    Mxfp4Experts,
    UnquantizedExperts,
    expert_method_for,
)
from atom_core.models.quantization.linear_methods import (
    Fp8Linear,
    Int8Linear,
    LinearMethod,
    UnquantizedLinear,
    linear_method_for,
    quantize_weight,
)
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
    "EXPERT_WEIGHT_FORMATS",
    "ExpertMethod",
    "Fp8Experts",
    "Mxfp4Experts",
    "UnquantizedExperts",
    "expert_method_for",
    "initialize_dummy_quantized_weights",
    "FP8_BLOCK_128",
    "FP8_KV_CACHE",
    "FP8_PER_CHANNEL",
    "FP8_PER_TENSOR",
    "INT8_PER_CHANNEL",
    "MXFP4_E2M1",
    "ONLINE_QUANTIZATION",
    "SUPPORTED_ACTIVATIONS",
    "UNQUANTIZED",
    "ActivationScheme",
    "Fp8Linear",
    "Int8Linear",
    "KVCacheScheme",
    "LayerRule",
    "LinearMethod",
    "LinearScheme",
    "QuantConfig",
    "QuantMethod",
    "UnquantizedLinear",
    "UnsupportedQuantizationError",
    "WeightFormat",
    "check_quantization_supported",
    "checkpoint_modules",
    "linear_method_for",
    "online_quant_config",
    "parse_quant_config",
    "quantize_weight",
]
