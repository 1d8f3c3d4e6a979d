"""Shared body of decoder-only causal LMs: the ``model.*`` trunk, the LM head, the model contract.

Legend: T = tokens this step, D = hidden size, V = vocabulary, N = rows whose logits are
wanted, L = layers.

An architecture file supplies its decoder layer (``CausalLM.make_layer``) and, where its model
differs outside the layers, overrides the hooks ``CausalLM.make_final_norm`` (the norm after the
last layer), ``CausalLM.embed_scale`` (a factor on the embedding output) and ``compute_logits``
(e.g. soft-capped logits); this module provides the rest of the contract every model follows:

- ``Cls(config, *, dtype, device)`` (and ``quant_config=`` for a quantized checkpoint, ``parallel=`` for a
  shard of a model split over several ranks, see ``CausalLM``);
- ``forward(input_ids [T] int64, positions [T] int64, batch: StepLayout) -> hidden [T, D]``
  (final norm applied);
- ``compute_logits(hidden [N, D]) -> logits [N, V]`` float32;
- ``kv_cache_spec() -> KVCacheSpec`` and ``bind_kv_cache([(k_cache, v_cache)] * L)``;
- ``packed_modules_mapping`` for the loader.

Parameter names mirror Hugging Face's (``model.embed_tokens``, ``model.layers.{i}...``,
``model.norm``, ``lm_head``) so checkpoints load with the packed mapping alone.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from atom_core.cache.pool_sizing import KVCacheSpec
from atom_core.cache.token_layout import StepLayout
from atom_core.models.config import ModelConfig
from atom_core.models.layers.attention import PagedAttention
from atom_core.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_core.models.layers.moe import FusedMoE
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.layers.rotary import RotaryEmbedding
from atom_core.models.parallel import ParallelContext
from atom_core.models.quantization import (
    QuantConfig,
    UnsupportedQuantizationError,
    expert_method_for,
)

# The quant_methods whose dense linear layers have linear methods (``supported_quantization`` of the
# architectures that thread ``quant_config`` to their layers; see ``quantization.linear_methods``).
QUANTIZED_DENSE_FORMATS = ("fp8", "compressed-tensors", "quark")

# Checkpoint module name -> (fused module in the model, shard id it fills).
DEFAULT_PACKED_MODULES_MAPPING: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class PreNormDecoderLayer(nn.Module):
    """``x + attn(norm1(x))``, then ``+ mlp(norm2(.))``; the residual adds are fused into the norms.

    ``self_attn.forward(positions, hidden, batch)`` and ``mlp.forward(hidden)`` both map
    [T, D] -> [T, D]. The residual stream travels between layers beside the hidden states
    (see ``layers.norm``): ``forward`` returns ``(hidden, residual)`` with
    ``hidden + residual`` equal to the layer's output in the unfused formulation.
    An attention or MLP module whose first linear layer quantizes its input dynamically says how in
    its ``input_quant`` attribute; the norm before it then quantizes in the same launch
    (``models.quantization.activation``).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: RMSNorm,
                 post_attention_layernorm: RMSNorm) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self._attn_quant = getattr(self_attn, "input_quant", None)
        self._mlp_quant = getattr(mlp, "input_quant", None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                batch: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64, hidden [T, D], residual [T, D] or None (first layer) -> (hidden, residual)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, quant=self._attn_quant)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, quant=self._attn_quant)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual, quant=self._mlp_quant)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """HF's ``model.*``: ``embed_tokens``, ``layers``, ``norm``. Layers and the final norm are built by the
    caller (``norm``: called as ``norm(x)`` and ``norm(x, residual) -> (out, x + residual)``, as ``RMSNorm``).

    ``embed_scale``: a factor on the embedding output (Gemma's ``sqrt(D)``), rounded to the activations'
    dtype before it multiplies, as HF does; None: no factor.
    """

    def __init__(self, config: ModelConfig, layers: list[nn.Module], norm: nn.Module, *, dtype: torch.dtype,
                 embed_scale: float | None = None, tp_rank: int = 0, tp_size: int = 1, tp_group=None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.embed_scale = None if embed_scale is None else float(embed_scale)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, D]: the embedding rows, times ``embed_scale`` when there is one."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is None:
            return hidden
        # the factor in the activations' dtype first (bf16: sqrt(3072) = 55.43 multiplies as 55.5), as HF does
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: StepLayout) -> torch.Tensor:
        """input_ids [T], positions [T] int64 -> hidden [T, D] after the final norm."""
        hidden = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        if residual is None:  # no layers
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """Base of the ``*ForCausalLM`` classes: ``model`` (a ``DecoderModel``) and ``lm_head``.

    Subclasses implement ``make_layer(layer_idx) -> nn.Module`` (a layer with
    ``forward(positions, hidden, residual, batch) -> (hidden, residual)`` holding one
    ``PagedAttention``); ``rotary_embedding(head_dim, layer_type)`` gives them one rotary table
    per distinct (head_dim, layer type), shared by the layers that use it. What differs outside the
    layers has a hook: ``make_final_norm()`` (default a plain ``RMSNorm``), ``embed_scale()`` (a factor
    on the embedding output; default None) and ``compute_logits`` (default the LM head's logits).

    ``dtype`` is the parameters' dtype (default: torch's default dtype); ``device`` where they
    are created. ``parallel`` (a ``models.parallel.ParallelContext``; None: one rank) says which shard
    this process holds: ``tp_rank`` of ``tp_size`` splits heads, MLP and vocabulary, and
    ``expert_parallel`` a MoE model's experts across the same ranks instead of each expert's
    intermediate dim (``layers.moe.moe_ranks``); every layer that reduces or gathers gets its
    ``tp_group`` (``self.tp_args()`` in ``make_layer``). The model keeps it as ``self.parallel``,
    with ``tp_rank``, ``tp_size``, ``tp_group`` and ``expert_parallel`` read from it.

    ``quant_config`` (a checkpoint's ``QuantConfig``, or ``online_quant_config(...)``; None: every
    layer unquantized) is bound to the model's ``packed_modules_mapping`` / ``expert_params_mapping``
    (a MoE subclass sets the latter before calling this ``__init__``) and kept as
    ``self.quant_config``; ``make_layer`` passes ``self.quant_args(prefix)`` to the layer builders,
    which give each linear layer its parameter-name prefix, and ``self.expert_quant_args(prefix)`` to
    its ``FusedMoE`` (``prefix``: the experts' checkpoint name). Embeddings, the LM head and MoE
    routers stay unquantized (as in vLLM; a checkpoint storing them in FP8 is refused by the loader's
    dtype check). Quantized experts are served in the formats of ``supported_expert_formats``
    (``models.quantization.expert_methods``); others are refused by name when the model is built.
    """

    packed_modules_mapping: dict[str, tuple[str, str | int]] = DEFAULT_PACKED_MODULES_MAPPING
    supported_quantization: tuple[str, ...] = ()      # quant_methods load_model builds this class for
    # FusedMoE weight formats this class's experts load (per-expert FP8 checkpoints; gpt-oss adds MXFP4)
    supported_expert_formats: tuple[str, ...] = ("fp8_block", "fp8_channel")
    # whether transformers' model of this family rotates only head_dim * partial_rotary_factor dims; the others
    # rotate the whole head whatever the factor (and fail with a scaled rope type), so a factor below 1 is refused
    partial_rotary: bool = False

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, parallel: ParallelContext | None = None,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if config.intermediate_size is None:
            raise ValueError(f"{type(self).__name__} needs intermediate_size in the config")
        if parallel is not None and not isinstance(parallel, ParallelContext):
            raise TypeError(f"parallel must be a ParallelContext, got {type(parallel).__name__}")
        self.config = config
        self.dtype = dtype or torch.get_default_dtype()
        self._build_device = None if device is None else torch.device(device)
        self.parallel = parallel if parallel is not None else ParallelContext.single()
        self.tp_rank = self.parallel.tp_rank
        self.tp_size = self.parallel.tp_size
        self.tp_group = self.parallel.tp_group
        self.expert_parallel = self.parallel.expert_parallel
        self.quant_config = None if quant_config is None else quant_config.bind(
            self.packed_modules_mapping, getattr(self, "expert_params_mapping", None))
        self._rotary: dict[tuple[int, str | None], RotaryEmbedding] = {}
        placement = torch.device(device) if device is not None else contextlib.nullcontext()
        with placement:
            layers = [self.make_layer(i) for i in range(config.num_hidden_layers)]
            tp = {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "tp_group": self.tp_group}
            self.model = DecoderModel(config, layers, self.make_final_norm(), dtype=self.dtype,
                                      embed_scale=self.embed_scale(), **tp)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=self.dtype, **tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        del self._rotary  # only needed while building
        if self.expert_parallel and not any(isinstance(m, FusedMoE) for m in self.modules()):
            what = "dp_attention=True (experts split over the DP ranks)" if self.parallel.dp_attention else \
                "expert_parallel=True"
            raise ValueError(f"{what}, but {type(self).__name__} has no experts to split")
        self._attention_layers = [m for m in self.model.layers.modules() if isinstance(m, PagedAttention)]
        self.bound_kv_caches: list | None = None  # the list last given to bind_kv_cache

    def make_layer(self, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``: ``forward(positions, hidden, residual, batch) -> (hidden, residual)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_layer")

    def make_final_norm(self) -> nn.Module:
        """The norm after the last layer (``model.norm``): ``norm(x)`` and ``norm(x, residual) -> (out, x +
        residual)``. Default: ``RMSNorm(hidden_size, rms_norm_eps)``."""
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps, dtype=self.dtype)

    def embed_scale(self) -> float | None:
        """The factor the embedding output is multiplied by (rounded to the activations' dtype first); None:
        none. Default None."""
        return None

    def tp_args(self) -> dict:
        """A tensor-parallel layer builder's keyword arguments: ``tp_rank``, ``tp_size``, ``tp_group`` (from
        ``self.parallel``) and ``dtype``."""
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "tp_group": self.tp_group, "dtype": self.dtype}

    def quant_args(self, prefix: str) -> dict:
        """Keyword arguments giving a layer builder this model's quantization and the layer's
        parameter-name prefix (``model.layers.{i}.self_attn``); empty for an unquantized model, so
        builders that take no such arguments still work there."""
        if self.quant_config is None:
            return {}
        return {"quant_config": self.quant_config, "prefix": prefix}

    def expert_quant_args(self, prefix: str) -> dict:
        """``FusedMoE`` keyword arguments giving the experts at checkpoint name ``prefix``
        (``model.layers.{i}.mlp.experts``) this model's quantization; empty for an unquantized model.
        A quantized scheme whose format this class does not load (``supported_expert_formats``) is
        refused here, naming the layer (the layer refuses what no fused MoE serves)."""
        if self.quant_config is None:
            return {}
        scheme = self.quant_config.scheme_for(prefix)
        if scheme.is_quantized:
            where = self.quant_config.source or "quantization_config"
            method = expert_method_for(scheme, online=self.quant_config.online, where=f"{where}: layer {prefix!r}")
            if method.weight_format not in self.supported_expert_formats:
                raise UnsupportedQuantizationError(
                    f"{where}: layer {prefix!r} is MoE experts quantized as {scheme.describe()}, which "
                    f"{type(self).__name__} does not load (its experts load unquantized or as "
                    f"{', '.join(self.supported_expert_formats)}); use a checkpoint whose config excludes the "
                    "experts, or an unquantised copy")
        return {"quant_config": self.quant_config, "prefix": prefix}

    def rotary_embedding(self, head_dim: int, layer_type: str | None = None) -> RotaryEmbedding:
        """The rotary embedding for heads of ``head_dim`` in layers of ``layer_type``, built once."""
        key_type = layer_type if self.config.rope_by_layer_type else None
        key = (head_dim, key_type)
        factor = self.config.get("partial_rotary_factor")
        if not self.partial_rotary and factor is not None and factor != 1:
            raise ValueError(f"partial_rotary_factor={factor!r}: transformers' {type(self).__name__} rotates the whole "
                             "head whatever this factor (and fails with a scaled rope type), vLLM rotates part of it; "
                             "refused rather than pick one (remove the key to rotate the whole head, as transformers "
                             "does)")
        if key not in self._rotary:
            self._rotary[key] = RotaryEmbedding.from_config(self.config, head_dim, layer_type=key_type,
                                                            device=self._build_device)
        return self._rotary[key]

    def sliding_window_of(self, layer_idx: int) -> int | None:
        """``config.sliding_window`` for layers whose ``layer_types`` entry is ``sliding_attention``."""
        if self.config.layer_types[layer_idx] == "sliding_attention":
            return self.config.sliding_window
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: StepLayout) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64, batch: the step's layout (on the model's device).

        Returns hidden [T, D] in the model's dtype, final norm applied.
        """
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D [T], got shape {tuple(input_ids.shape)}")
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions must have input_ids' shape {tuple(input_ids.shape)}, "
                             f"got {tuple(positions.shape)}")
        if batch.num_tokens != input_ids.shape[0]:
            raise ValueError(f"batch describes {batch.num_tokens} tokens but input_ids has {input_ids.shape[0]}")
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] float32 (the matmul runs in the model's dtype)."""
        return self.lm_head(hidden).float()

    def kv_cache_spec(self, dtype: torch.dtype | None = None) -> KVCacheSpec:
        """Per-rank KV pool needs: one K and one V of ``[NB, BS, Hk, D]`` per attention layer, in
        ``dtype`` (default: the model's; ``torch.float8_e4m3fn`` for an FP8 pool, one byte per element)."""
        first = self._attention_layers[0]
        return KVCacheSpec(num_layers=len(self._attention_layers), num_kv_heads=first.num_kv_heads,
                           head_dim=first.head_dim, dtype=dtype or self.dtype)

    def kv_cache_scales(self) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per attention layer, the checkpoint's FP8 KV scales ``(k_scale, v_scale)`` (fp32 [1]; the
        cache holds ``k / k_scale``), or None where the checkpoint has none (an FP8 pool then uses 1.0)."""
        return [(attn.checkpoint_k_scale, attn.checkpoint_v_scale) for attn in self._attention_layers]

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        """Give each attention layer its pool tensors: ``kv_caches[i] = (k_cache, v_cache)``, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, one entry per layer in order; an FP8
        pool's entries are ``(k_cache, v_cache, k_scale, v_scale)`` with fp32 [1] scales.

        A model writes into one pool at a time: the last one bound. ``bound_kv_caches`` is that
        list (the same object), so an owner can tell whether the binding is still its own."""
        if len(kv_caches) != len(self._attention_layers):
            raise ValueError(
                f"kv_caches has {len(kv_caches)} entries, the model has {len(self._attention_layers)} attention layers"
            )
        for i, (attn, entry) in enumerate(zip(self._attention_layers, kv_caches)):
            if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 4):
                raise ValueError(f"kv_caches[{i}] must be a (k_cache, v_cache) or (k_cache, v_cache, k_scale, "
                                 f"v_scale) tuple")
            k_cache, v_cache, *scales = entry
            k_scale, v_scale = scales or (None, None)
            attn.bind_kv_cache(k_cache, v_cache, k_scale=k_scale, v_scale=v_scale)
        self.bound_kv_caches = kv_caches
