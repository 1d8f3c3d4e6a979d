"""Model definitions, weight loading and the architecture registry.

``load_model(folder)`` builds the model named by ``config.json`` and fills it from the
folder's ``*.safetensors``; ``build_model(config)`` builds one with dummy or zero weights (quantized
as the config's ``quantization_config`` or ``quantization=`` says: random weights in the stored format).
Both return the model in eval mode. Architecture files are imported only when a model of
that architecture is built.

A model split over several processes takes ``parallel=`` (a ``ParallelContext``: this process's shard and
the process groups its layers reduce and gather over, ``models.parallel``); without it, one process and no
``torch.distributed`` at all. ``tp_rank`` / ``tp_size`` / ``expert_parallel`` remain as a convenience that
builds a context over the default world group (the only place a model reads the default group).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atom_core.cache.pool_sizing import GIB, InsufficientMemoryError, check_fits_in_memory
from atom_core.models.quantization import (
    QuantConfig,
    UnsupportedQuantizationError,
    check_quantization_supported,
    initialize_dummy_quantized_weights,
    online_quant_config,
    parse_quant_config,
)
from atom_core.models.config import ModelConfig, available_memory_bytes, memory_name, parse_dtype
from atom_core.models.dummy_weights import initialize_dummy_weights, initialize_zero_weights
from atom_core.models.loader import LoadReport, load_weights, process_weights_after_loading
from atom_core.models.named_tensors import load_named_tensors
from atom_core.models.parallel import MissingProcessGroupError, ParallelContext, resolve_parallel
from atom_core.models.registry import (
    get_model_class,
    register_model,
    resolve_architecture,
    supported_architectures,
)

__all__ = [
    "InsufficientMemoryError",
    "LoadReport",
    "MissingProcessGroupError",
    "ModelConfig",
    "ParallelContext",
    "build_model",
    "check_buildable",
    "estimate_model_bytes",
    "get_model_class",
    "load_model",
    "load_named_tensors",
    "load_weights",
    "register_model",
    "supported_architectures",
]

logger = logging.getLogger(__name__)

_LOAD_FORMATS = ("auto", "safetensors", "dummy", "zeros")


def _default_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _default_dtype(config: ModelConfig, dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """Explicit dtype > (on a GPU) the checkpoint's torch_dtype, else bfloat16 > (on CPU) float32 ("auto", as
    vLLM spells it, is None: the default)."""
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype, what="dtype")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or a name like 'bfloat16', got {dtype!r}")
        return dtype
    if device.type == "cpu":
        return torch.float32
    return config.torch_dtype or torch.bfloat16


def _extra_count(config: ModelConfig, *names: str, default: int = 0) -> int:
    """The first of ``names`` holding an int >= 0 (other values are the model class's to refuse)."""
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return default


def _num_sparse_layers(config: ModelConfig) -> int:
    """Layers whose MLP is the experts: from ``first_k_dense_replace`` on, every ``decoder_sparse_step``-th
    (layer i when ``(i + 1) % step == 0``), not in ``mlp_only_layers`` (the rules of GLM-4-MoE and Qwen3-MoE)."""
    layers = config.num_hidden_layers
    first = min(_extra_count(config, "first_k_dense_replace"), layers)
    step = max(_extra_count(config, "decoder_sparse_step", default=1), 1)
    sparse = layers // step - first // step
    dense_listed = config.get("mlp_only_layers") or []
    listed = {i for i in dense_listed if isinstance(i, int)} if isinstance(dense_listed, list) else set()
    return sparse - sum(1 for i in listed if first <= i < layers and (i + 1) % step == 0)


def estimate_model_bytes(config: ModelConfig, dtype: torch.dtype, *, tp_size: int = 1,
                         expert_bytes_per_weight: float | None = None,
                         kv_b_bytes_per_weight: float | None = None) -> tuple[int, str]:
    """A lower bound of the bytes one rank's model of ``config`` takes, and what they are made of.

    Parameters in ``dtype`` (E hidden, V vocabulary, L layers, H/Hk heads, D head dim, I intermediate,
    X experts): embedding ``V E``, LM head ``V E`` (none when tied), per layer attention
    ``E (H + 2 Hk) D + H D E`` (MLA: ``E H (Dn + R)`` or ``E Qr + Qr H (Dn + R)`` with a q LoRA rank Qr,
    plus ``E (Lr + R) + Lr H (Dn + Dv) + H Dv E`` for latent rank Lr; a DSA layer that runs its indexer adds
    ``Qr Hi Di + E Di`` and the fp32 ``E Hi``, replicated on every rank), MLP ``3 E I`` or, in a sparse layer, ``X`` experts of
    ``3 E I_moe`` plus the router ``E X`` and shared experts; all divided by ``tp_size`` (norms and
    biases are left out: a lower bound, so a refusal means the model cannot fit). Plus the fp32 rotary
    cos/sin table(s), ``max_position_embeddings x rotary dim``, one per rope layer type.
    ``expert_bytes_per_weight``: the routed experts' bytes per weight when they are stored otherwise than
    ``dtype`` (MXFP4: 0.5 + 1/32; scales included or not, a lower bound stays one).
    ``kv_b_bytes_per_weight``: MLA's ``Lr H (Dn + Dv)`` of ``kv_b_proj`` when it is held otherwise than
    ``dtype`` (a quantized checkpoint's is dequantized to the model dtype at load: ``w_kv_b``).
    """
    e, v, layers, d = config.hidden_size, config.vocab_size, config.num_hidden_layers, config.head_dim
    h, hk = config.num_attention_heads, config.num_key_value_heads
    inter = config.intermediate_size or 0
    experts = _extra_count(config, "num_experts", "num_local_experts", "n_routed_experts")
    sparse = _num_sparse_layers(config) if experts else 0
    moe_inter = _extra_count(config, "moe_intermediate_size", default=inter)
    shared = _extra_count(config, "n_shared_experts")
    per_param = dtype.itemsize / tp_size
    per_expert_param = per_param if expert_bytes_per_weight is None else expert_bytes_per_weight / tp_size
    per_kv_b_param = per_param if kv_b_bytes_per_weight is None else kv_b_bytes_per_weight / tp_size
    attention, rotary_dim = e * (h + 2 * hk) * d + h * d * e, d
    kv_b = 0
    kv_lora = _extra_count(config, "kv_lora_rank")
    if kv_lora:  # MLA: q (through q_lora_rank or not), the latent down/up projections, o_proj
        nope, rope = _extra_count(config, "qk_nope_head_dim"), _extra_count(config, "qk_rope_head_dim")
        v_dim, q_lora = _extra_count(config, "v_head_dim"), _extra_count(config, "q_lora_rank")
        q = e * q_lora + q_lora * h * (nope + rope) if q_lora else e * h * (nope + rope)
        attention = q + e * (kv_lora + rope) + h * v_dim * e
        kv_b = kv_lora * h * (nope + v_dim)
        rotary_dim = rope
    indexer_heads = _extra_count(config, "index_n_heads")
    indexers = _indexer_layers(config) if kv_lora and indexer_heads else 0
    index_dim, q_lora = _extra_count(config, "index_head_dim"), _extra_count(config, "q_lora_rank")
    parts = {
        "embedding": v * e * per_param,
        "lm head": 0 if config.tie_word_embeddings else v * e * per_param,
        f"{layers} layers' attention": layers * (attention * per_param + kv_b * per_kv_b_param),
        f"{indexers} DSA indexers": indexers * ((q_lora * indexer_heads * index_dim + e * index_dim) * dtype.itemsize
                                                + e * indexer_heads * 4),
        f"{layers - sparse} dense MLPs": (layers - sparse) * 3 * e * inter * per_param,
        f"{sparse} x {experts} experts": sparse * (experts * 3 * e * moe_inter * per_expert_param
                                                    + (e * experts + shared * 3 * e * moe_inter) * per_param),
    }
    factor = config.get("partial_rotary_factor", 1.0)
    factor = factor if isinstance(factor, (int, float)) and 0 < factor <= 1 else 1.0
    tables = len(config.rope_by_layer_type) if config.rope_by_layer_type else 1
    parts["rotary table"] = tables * config.max_position_embeddings * int(rotary_dim * factor) * 4
    total = int(sum(parts.values()))
    # The parts that make up at least 1% of the total, largest first: they name the field to look at.
    large = sorted(((size, name) for name, size in parts.items() if size >= total / 100), reverse=True)
    return total, f"{dtype}: " + ", ".join(f"{name} {size / GIB:.2f} GiB" for size, name in large)


def _indexer_layers(config: ModelConfig) -> int:
    """How many decoder layers of a DSA model run their own indexer (the others reuse an earlier layer's top-k)."""
    _, cls = resolve_architecture(config.architectures)
    resolve = getattr(cls, "resolve_indexer_types", None)
    return config.num_hidden_layers if resolve is None else resolve(config).count("full")


def _estimate_args(quant_config: QuantConfig | None, dtype: torch.dtype) -> dict:
    """``estimate_model_bytes``' dtype and expert bytes for a model built with ``quant_config`` (lower bounds):
    MXFP4 (gpt-oss: experts only) keeps the dense layers in ``dtype`` and counts the experts at half a byte;
    the 8-bit formats count one byte per element, but MLA's ``kv_b_proj``, held in ``dtype`` however it is
    stored (dequantized at load into ``w_kv_b``, its stored copy freed; online quantization leaves it)."""
    if quant_config is None:
        return {"dtype": dtype}
    if quant_config.quant_method == "mxfp4":
        return {"dtype": dtype, "expert_bytes_per_weight": 0.5}
    return {"dtype": torch.float8_e4m3fn, "kv_b_bytes_per_weight": dtype.itemsize}


def _check_fits(config: ModelConfig, dtype: torch.dtype, device: torch.device, tp_size: int, source: str,
                quant_config: QuantConfig | None = None) -> None:
    """Refuse, before any module is built, a model whose estimate exceeds the memory of ``device``."""
    args = _estimate_args(quant_config, dtype)
    needed, detail = estimate_model_bytes(config, args.pop("dtype"), tp_size=tp_size, **args)
    check_fits_in_memory(
        f"the {'/'.join(config.architectures) or 'model'} of {source}", needed, available_memory_bytes(device),
        where=memory_name(device), detail=detail,
        hint="check vocab_size, hidden_size, intermediate_size, num_hidden_layers and max_position_embeddings, "
             "or use a smaller dtype, more tensor-parallel ranks or a device with more memory")


def _instantiate(config: ModelConfig, dtype: torch.dtype, device: torch.device, parallel: ParallelContext,
                 quant_config: QuantConfig | None = None) -> nn.Module:
    _, cls = resolve_architecture(config.architectures)
    # (a single-rank build passes no context: a registered model need not take one)
    extra = {} if parallel == ParallelContext.single() else {"parallel": parallel}
    if quant_config is not None:  # (likewise: only quantized builds pass it)
        extra["quant_config"] = quant_config
    # Parameters created without an explicit device land on `device` (no CPU detour).
    with torch.device(device):
        return cls(config, dtype=dtype, device=device, **extra)


def _initialize(model: nn.Module, load_format: str, seed: int, quantized: bool = False) -> None:
    if load_format == "dummy" and quantized:
        initialize_dummy_quantized_weights(model, seed=seed)
    elif load_format == "dummy":
        initialize_dummy_weights(model, seed=seed)
    else:
        initialize_zero_weights(model)
    process_weights_after_loading(model)


def build_model(config: ModelConfig | dict[str, Any], *, dtype: torch.dtype | str | None = None,
                device: str | torch.device | None = None, load_format: str = "dummy",
                seed: int = 0, parallel: ParallelContext | None = None, tp_rank: int = 0, tp_size: int = 1,
                expert_parallel: bool = False, quantization: str | None = None) -> nn.Module:
    """A model of ``config``'s architecture with ``"dummy"`` (seeded normal(0, 0.02)) or ``"zeros"`` weights.

    ``config``: a ``ModelConfig`` or a config.json-style dict. ``device`` defaults to CUDA when
    available, else CPU; ``dtype`` to the config's ``torch_dtype`` on a GPU and float32 on CPU.
    ``parallel``: this process's shard and the process groups its layers communicate over
    (``ParallelContext``; None: one rank, no ``torch.distributed``). Convenience instead of it:
    ``tp_rank``/``tp_size`` (this process's tensor-parallel shard, reducing over the default world
    group, which must hold exactly ``tp_size`` ranks; without an initialized group, a shard that cannot
    communicate, to inspect) and ``expert_parallel`` (a MoE model's experts are split across those
    ranks instead of each expert's intermediate dim); see ``models.parallel.resolve_parallel``.
    Raises ``InsufficientMemoryError`` before any module is built when ``estimate_model_bytes`` exceeds
    the memory free on ``device``.

    Quantized builds (benchmarks of the real storage formats): the config's ``quantization_config``
    is honoured as a checkpoint's would be (gpt-oss's ``mxfp4``: packed random MXFP4 experts), or
    ``quantization="fp8"`` (per-channel FP8 weights, dynamic per-token activations) / ``"fp8_block"``
    (128 x 128 blocks) quantizes every linear layer and expert of an unquantized config, as
    ``load_model(quantization=...)`` does. Dummy weights are drawn and quantized a layer (an expert)
    at a time (``quantization.dummy``): the unquantized model never exists.
    """
    if load_format not in ("dummy", "zeros"):
        raise ValueError(f"build_model: load_format must be 'dummy' or 'zeros', got {load_format!r}")
    if isinstance(config, dict):
        config = ModelConfig.from_dict(config)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig or a dict, got {type(config).__name__}")
    _, cls = resolve_architecture(config.architectures)
    parallel = resolve_parallel(parallel, tp_rank, tp_size, expert_parallel)
    device = _default_device(device)
    dtype = _default_dtype(config, dtype, device)
    model, quantized = _build_random(config, cls, quantization, None, "this config", dtype, device, parallel)
    _initialize(model, load_format, seed, quantized=quantized)
    return model.eval()


def _build_random(config: ModelConfig, cls: type, quantization: str | None, config_file: Path | None,
                  where: str | Path, dtype: torch.dtype, device: torch.device,
                  parallel: ParallelContext) -> tuple[nn.Module, bool]:
    """The model of a random-weight build (not yet filled) and whether it is quantized. The config's own
    ``quantization_config`` is honoured where atom_core serves it; where it does not (a format, or a layer
    of it, refused by name) the model is built unquantized, with a warning: random weights of the shapes
    are still what a benchmark wants. An explicit ``quantization`` is never dropped."""
    try:
        quant_config = _quant_config_of(config, cls, quantization, config_file, where)
        _check_fits(config, dtype, device, parallel.tp_size, str(where), quant_config)
        return _instantiate(config, dtype, device, parallel, quant_config), quant_config is not None
    except UnsupportedQuantizationError as e:
        if quantization is not None or config.get("quantization_config") is None:
            raise
        logger.warning("%s: random weights built unquantized: %s", where, e)
    _check_fits(config, dtype, device, parallel.tp_size, str(where))
    return _instantiate(config, dtype, device, parallel), False


def _quant_config_of(config: ModelConfig, cls: type, quantization: str | None, config_file: Path | None,
                     where: str | Path) -> QuantConfig | None:
    """The ``QuantConfig`` a model of ``config`` is built with: the config's ``quantization_config`` parsed
    (formats no layer can serve refused by name), or ``online_quant_config(quantization)`` for an
    unquantized config (both at once refused); one the architecture does not load
    (``cls.supported_quantization``) is refused, before anything is built or read."""
    quant = parse_quant_config(config.get("quantization_config"), source_file=config_file)
    if quantization is not None:
        if quant is not None:
            raise UnsupportedQuantizationError(
                f"{where}: quantization={quantization!r} asks to quantize while loading, but the checkpoint is "
                f"already quantized (quant_method={quant.quant_method!r}); drop the quantization argument to load it "
                "as is")
        quant = online_quant_config(quantization)
    if quant is not None:
        check_quantization_supported(quant, cls, source=where)
    return quant


def _model_folder(path: str | Path) -> Path:
    """``path`` as a folder holding a config.json; FileNotFoundError naming what is missing."""
    folder = Path(path)
    if not folder.is_dir():
        hub_id = str(path).count("/") == 1 and not str(path).startswith((".", "/", "~"))
        raise FileNotFoundError(
            f"model folder not found: {folder}" + (
                f" (atom_core loads local folders only; a Hugging Face Hub model downloads to one with "
                f"`huggingface-cli download {path} --local-dir {folder.name}`)" if hub_id else ""))
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model folder {folder}")
    return folder


def check_buildable(path: str | Path, parallel: ParallelContext, *, quantization: str | None = None) -> None:
    """Raise what building ``path``'s model as rank 0 of ``parallel`` would raise for its sizes and quantization
    (heads or intermediate sizes a tensor-parallel size does not divide, experts an expert-parallel size does not
    split, a quantization format that cannot be cut so), without reading a weight or touching a device: the
    model is built on the meta device. An engine calls it before it starts its ranks or replicas, whose every
    process would otherwise start, join its group and then fail on the same error."""
    folder = _model_folder(path)
    config = ModelConfig.from_file(folder / "config.json")
    _, cls = resolve_architecture(config.architectures)
    quant_config = _quant_config_of(config, cls, quantization, folder / "config.json", folder)
    _instantiate(config, _default_dtype(config, None, torch.device("cuda")), torch.device("meta"), parallel,
                 quant_config)


def load_model(path: str | Path, *, dtype: torch.dtype | str | None = None,
               device: str | torch.device | None = None, load_format: str = "auto",
               parallel: ParallelContext | None = None, tp_rank: int = 0, tp_size: int = 1,
               expert_parallel: bool = False, check_finite: bool = True, quantization: str | None = None) -> nn.Module:
    """Build the model described by ``path/config.json`` and load its weights.

    ``load_format``: ``"auto"``/``"safetensors"`` read ``path/*.safetensors`` (see
    ``loader.load_weights``); ``"dummy"``/``"zeros"`` skip the shards. Defaults, ``parallel`` and the
    ``tp_rank``/``tp_size``/``expert_parallel`` convenience as in ``build_model`` (each rank reads the
    full tensors and keeps its shard of each). ``check_finite``: refuse a checkpoint tensor holding NaN or Inf, naming it and its
    file (one extra read of each tensor; ``check_finite=False`` skips it for a trusted checkpoint).

    A quantized checkpoint (``quantization_config`` in config.json: HF ``fp8``, ``compressed-tensors``,
    ``quark``; see docs/models.md) is built with the linear method each layer's rule gives it and
    loads its FP8 / INT8 tensors and scales as stored; MoE experts load as FP8 (block or per-channel)
    or, for gpt-oss, MXFP4 kept packed. ``quantization``: ``"fp8"`` (per-channel FP8 weights, dynamic
    per-token activations) or ``"fp8_block"`` (128 x 128 blocks, 1 x 128 activation groups) quantizes an
    unquantized checkpoint while it loads, each tensor as it is read (the unquantized model never exists
    on ``device``); None loads the checkpoint as it is. With ``load_format="dummy"`` / ``"zeros"`` the
    model is built quantized the same way (the config's ``quantization_config``, or ``quantization``) and
    filled with random weights in its stored formats (``build_model``).
    Raises FileNotFoundError for a missing folder, config.json or shards, ValueError for an
    unsupported architecture or a bad file (named), and ``InsufficientMemoryError`` (before any
    module is built) when ``estimate_model_bytes`` exceeds the memory free on ``device``.
    """
    if load_format not in _LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {load_format!r}")
    folder = _model_folder(path)
    config = ModelConfig.from_file(folder / "config.json")
    _, cls = resolve_architecture(config.architectures)  # unsupported architecture: fail before anything is built
    parallel = resolve_parallel(parallel, tp_rank, tp_size, expert_parallel)
    device = _default_device(device)
    dtype = _default_dtype(config, dtype, device)
    if load_format in ("dummy", "zeros"):
        model, quantized = _build_random(config, cls, quantization, folder / "config.json", folder, dtype, device,
                                         parallel)
        _initialize(model, load_format, seed=0, quantized=quantized)
        return model.eval()
    quant_config = _quant_config_of(config, cls, quantization, folder / "config.json", folder)
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(
            f"no *.safetensors files in {folder} (pass load_format='dummy' to build it with random weights)"
        )
    # A quantized model's weights take one byte per element (MXFP4 experts half): lower bounds.
    _check_fits(config, dtype, device, parallel.tp_size, str(folder / "config.json"), quant_config)
    model = _instantiate(config, dtype, device, parallel, quant_config)
    load_weights(model, folder, check_finite=check_finite)
    return model.eval()
