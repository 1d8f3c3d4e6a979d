"""Multi-head latent attention (MLA) as modules: the paged latent cache and DeepSeek's attention block.

Legend: T = tokens this step, E = hidden size, H = query heads on this rank, Qr = q_lora_rank,
L = kv_lora_rank, R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim, NB = pool blocks,
BS = block size.

Data flow of one layer (``MultiHeadLatentAttention.forward``)::

    q      = q_proj(x)                                   [T, H (Dn + R)]   (no q_lora_rank: V2-Lite)
           | q_b_proj(q_a_layernorm(q_a_proj(x)))        (E -> Qr -> H (Dn + R): V2, V3, Kimi-K2)
    q_nope, q_pe = q.view(T, H, Dn + R).split([Dn, R])
    kv_a   = kv_a_proj_with_mqa(x)                       [T, L + R]
    c_kv   = kv_a_layernorm(kv_a[:, :L])                 [T, L]     the latent: cached
    k_pe   = kv_a[:, L:]                                 [T, R]     one rope key for all heads: cached
    rope(q_pe, k_pe)                                     interleaved pairs (GPT-J), in place
    pool[slot] = [c_kv, k_pe]                            ops.store_mla_
    o      = MLA over the pool                           [T, H, Dv] ops.mla_prefill_attention (expanded)
                                                                    or ops.mla_decode_attention (absorbed)
    out    = o_proj(o.view(T, H Dv))                     [T, E]

``kv_b_proj`` ([H (Dn + Dv), L], HF's name and layout) is never applied as a linear layer: its
weight, viewed ``[H, Dn + Dv, L]``, is split into ``w_uk`` [H, Dn, L] and ``w_uv`` [H, Dv, L], which
the attention ops either expand the cached latents with (prefill) or absorb into the query and the
output (decode); a quantized checkpoint's is dequantized to the model dtype once at load
(``MultiHeadLatentAttention``'s "Quantization"), the other projections run their linear methods. See ``atom_core.ops.reference.mla`` for the math of both forms.

**DSA** (DeepSeek-V3.2, GLM-5; ``LightningIndexer``): a layer with an indexer first picks, per query
token, the ``index_topk`` context positions of highest index score, then attends over those only::

    q_idx  = wq_b(q_resid)                               [T, Hi, Di]  q_resid = q_a_layernorm(q_a_proj(x))
    k_idx  = k_norm(wk(x))                               [T, Di]      LayerNorm with bias: cached (own pool)
    rope(q_idx[..., :R], k_idx[:, :R])                   half-split pairs (V3.2) or interleaved (GLM-5)
    w      = weights_proj(x) * Hi^-1/2                   [T, Hi] fp32
    indexer_pool[slot] = k_idx                           ops.store_indexer_k_
    topk   = top-K positions of sum_h w relu(q_idx . k_idx) / sqrt(Di)     ops.indexer_topk   [T, K] int32
    o      = MLA over the pool at those positions        ops.mla_sparse_attention (absorbed)

A GLM-5 "shared" layer has no indexer and reuses the top-k of the last layer that ran one (``TopkShare``).
"""

from __future__ import annotations

import torch
from torch import nn

from atom_core import ops
from atom_core.cache.pool_sizing import KVCacheSpec
from atom_core.cache.token_layout import StepLayout
from atom_core.models.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.layers.rotary import RotaryEmbedding
from atom_core.models.layers.sharding import check_tp, divide
from atom_core.models.quantization.config import QuantConfig

FP8_DTYPE = torch.float8_e4m3fn  # the fp8 pools' element type (latent rows, indexer keys)

# A step whose rows have at most this many queries each runs the absorbed (decode) form: it costs
# ~S H (L + R) per query token against the expanded form's ~S L H (Dn + Dv) per row, so the absorbed
# form wins until a row has about L (Dn + Dv) / (L + R) ~ 200 queries (DeepSeek-V3 shapes); a small
# bound keeps prefill chunks on the expanded form, whose kernels are plain attention.
ABSORBED_MAX_QUERY_LEN = 8
# The expanded form turns every page of every row's block table into per-head K/V (B P BS slots of
# H (Dn + R + Dv) values, ``ops.mla_prefill_attention``), whatever the row's own query count: decode rows
# of a mixed step expand their whole contexts, a prefix hit its whole prefix, a CUDA graph's static table
# max_model_len per row. Past this many slots per query token of the step the absorbed form runs instead
# (it expands nothing), so the temporary stays within EXPANDED_MAX_SLOTS_PER_TOKEN x T slots
# (``step_activation_bytes`` reserves it): prefill-dominated steps expand, the others absorb.
EXPANDED_MAX_SLOTS_PER_TOKEN = 2
FORMS = ("auto", "expanded", "absorbed")


class MLAPagedAttention(nn.Module):
    """Writes this step's latent rows into the bound MLA pool and attends over it (no parameters).

    Args:
        num_heads: H on this rank. kv_lora_rank: L. qk_rope_head_dim: R. v_head_dim: Dv.
        scale: softmax scale of q.k over Dn + R dims (``ops.yarn_softmax_scale``).
        form: "auto" (absorbed when ``batch.max_seqlen_q <= ABSORBED_MAX_QUERY_LEN`` or the block table
            spans more than ``EXPANDED_MAX_SLOTS_PER_TOKEN`` slots per query token, else expanded),
            or always "expanded" / "absorbed" (the two give the same result; tests pin both).
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, v_head_dim: int, *, scale: float,
                 form: str = "auto") -> None:
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = float(scale)
        self.form = form
        self.mla_cache: torch.Tensor | None = None
        self.kv_scale: torch.Tensor | None = None
        # FP8 KV-cache scales a checkpoint ships beside this layer (fp32 [1] each; set by the loader under the
        # names ``PagedAttention`` uses): ``checkpoint_kv_scale`` is the latent cache's.
        self.checkpoint_k_scale: torch.Tensor | None = None
        self.checkpoint_v_scale: torch.Tensor | None = None

    @property
    def checkpoint_kv_scale(self) -> torch.Tensor | None:
        """The latent cache's FP8 scale from the checkpoint (fp32 [1]), or None: its ``k_scale`` (``kv_scale``
        loads as both), or its ``v_scale`` where that is the only one stored. vLLM's rule: its MLA layers write
        and read the latent cache with ``k_scale`` (a lone scale of the two counts for both)."""
        return self.checkpoint_k_scale if self.checkpoint_k_scale is not None else self.checkpoint_v_scale

    @property
    def row_size(self) -> int:
        """L + R: the numbers one token stores."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def bind_kv_cache(self, mla_cache: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        """Attach this layer's latent pool ``[NB, BS, L + R]`` (float8_e4m3fn pools: with an fp32 [1] kv_scale)."""
        if not isinstance(mla_cache, torch.Tensor):
            raise TypeError(f"mla_cache must be a torch.Tensor, got {type(mla_cache).__name__}")
        if mla_cache.dim() != 3 or mla_cache.shape[2] != self.row_size:
            raise ValueError(f"mla_cache must have shape [num_blocks, block_size, {self.row_size}] "
                             f"(kv_lora_rank + qk_rope_head_dim), got {tuple(mla_cache.shape)}")
        self.mla_cache, self.kv_scale = mla_cache, kv_scale

    def uses_absorbed(self, batch: StepLayout) -> bool:
        """Whether this step runs the absorbed form (a function of the layout's shapes and ints, fixed per
        CUDA-graph bucket: no host read)."""
        if self.form != "auto":
            return self.form == "absorbed"
        rows, pages = batch.block_tables.shape
        slots = rows * pages * self.mla_cache.shape[1]
        return (batch.max_seqlen_q <= ABSORBED_MAX_QUERY_LEN
                or slots > EXPANDED_MAX_SLOTS_PER_TOKEN * batch.positions.shape[0])

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                w_uk: torch.Tensor, w_uv: torch.Tensor, batch: StepLayout,
                topk_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Store ``[kv_c, k_pe]`` at ``batch.slot_mapping`` and attend.

        q_nope [T, H, Dn], q_pe [T, H, R] (rotated), kv_c [T, L], k_pe [T, R] (rotated), w_uk [H, Dn, L],
        w_uv [H, Dv, L]; returns [T, H, Dv] in q's dtype. With ``topk_indices`` (int32 [T, K], DSA), each
        query attends only to its selected positions (``ops.mla_sparse_attention``, whatever the form).
        """
        if self.mla_cache is None:
            raise RuntimeError(
                "MLAPagedAttention: no latent cache is bound; allocate the pool (model.kv_cache_spec() is an MLA "
                "spec: one [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] tensor per layer) and call "
                "model.bind_kv_cache(kv_caches) before forward, even for a prefill-only step")
        batch.check_pool_block_size(self.mla_cache.shape[1], "the latent cache (mla_cache)")
        ops.store_mla_(kv_c, k_pe, self.mla_cache, batch.slot_mapping, kv_scale=self.kv_scale)
        if topk_indices is not None:
            return ops.mla_sparse_attention(q_nope, q_pe, self.mla_cache, w_uk, w_uv, topk_indices, batch.block_tables,
                                            batch.cu_seqlens_q, batch.context_lens, batch.max_seqlen_q,
                                            batch.max_seqlen_k, scale=self.scale, kv_scale=self.kv_scale)
        attend = ops.mla_decode_attention if self.uses_absorbed(batch) else ops.mla_prefill_attention
        return attend(q_nope, q_pe, self.mla_cache, w_uk, w_uv, batch.block_tables, batch.cu_seqlens_q,
                      batch.context_lens, batch.max_seqlen_q, batch.max_seqlen_k, scale=self.scale,
                      kv_scale=self.kv_scale)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, scale={self.scale:.6g}, "
                f"form={self.form}, bound={self.mla_cache is not None}")


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (``ops.layer_norm``); ``weight`` and
    ``bias`` [D] in ``dtype`` (HF's ``nn.LayerNorm`` names), replicated."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, float(eps)
        dtype = dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


def _quant(quant_config: QuantConfig | None, prefix: str, name: str) -> dict:
    """A linear layer's ``quant_config`` / ``prefix`` keyword arguments (none for an unquantized model)."""
    return {} if quant_config is None else {"quant_config": quant_config, "prefix": f"{prefix}.{name}"}


class TopkShare:
    """The top-k of the last DSA layer that ran its indexer this step, for the GLM-5 layers that reuse it
    (``indexer_types`` "shared"). One per model; not a module (it holds no parameters, only this step's
    int32 [T, K] tensor)."""

    def __init__(self) -> None:
        self.indices: torch.Tensor | None = None


class LightningIndexer(nn.Module):
    """DSA's lightning indexer (DeepSeek-V3.2, GLM-5): scores each query token against the cached indexer keys
    of its row and returns the ``topk`` best positions. HF's names: ``wq_b``, ``wk``, ``k_norm`` (LayerNorm
    with bias, eps 1e-6), ``weights_proj`` (fp32, as HF keeps it). Replicated on every tensor-parallel rank
    (each rank selects the same positions).

    Args:
        hidden_size: E. q_lora_rank: Qr (the indexer reads ``q_a_layernorm(q_a_proj(x))``).
        num_heads: Hi (``index_n_heads``). head_dim: Di (``index_head_dim``). topk: K (``index_topk``).
        rotary_emb: the MLA layers' rotary table over R = qk_rope_head_dim dims (the indexer rotates the first
            R dims of its q and k with the same cos/sin, YaRN scale included, as HF does).
        rope_is_neox: True for half-split pairs (DeepSeek-V3.2), False for interleaved (GLM-5).
        quant_config, prefix: the model's quantization and this indexer's name (``model.layers.{i}.self_attn.
            indexer``): ``wq_b`` and ``wk`` get the linear methods their rules give them (block FP8 in the
            released V3.2 checkpoint); ``weights_proj`` is always unquantized fp32 (DeepSeek's release stores it
            unquantized, and vLLM builds it without a quantization: a stored FP8 ``weights_proj`` is refused by
            the loader's dtype check, naming the tensor).
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, topk: int, *,
                 rotary_emb: RotaryEmbedding, rope_is_neox: bool, dtype: torch.dtype | None = None,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        if rotary_emb.rotary_dim > head_dim:
            raise ValueError(f"index_head_dim={head_dim} must hold the {rotary_emb.rotary_dim} rope dims")
        if topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {topk}")
        self.num_heads, self.head_dim, self.topk = num_heads, head_dim, topk
        self.scale = head_dim ** -0.5
        self.rope_is_neox = rope_is_neox
        self.wq_b = ReplicatedLinear(q_lora_rank, num_heads * head_dim, False, dtype=dtype,
                                     **_quant(quant_config, prefix, "wq_b"))
        self.wk = ReplicatedLinear(hidden_size, head_dim, False, dtype=dtype, **_quant(quant_config, prefix, "wk"))
        self.k_norm = LayerNorm(head_dim, 1e-6, dtype=dtype)
        self.weights_proj = ReplicatedLinear(hidden_size, num_heads, False, dtype=torch.float32)
        self.rotary_emb = rotary_emb
        self.indexer_cache: torch.Tensor | None = None
        self.indexer_scale: torch.Tensor | None = None

    def bind_kv_cache(self, indexer_cache: torch.Tensor, indexer_scale: torch.Tensor | None = None) -> None:
        """Attach this layer's indexer key pool ``[NB, BS, Di]`` (same blocks and slots as the latent pool); a
        float8_e4m3fn pool with its per-key scales ``indexer_scale`` fp32 [NB, BS] (``ops.store_indexer_k_``)."""
        if not isinstance(indexer_cache, torch.Tensor):
            raise TypeError(f"indexer_cache must be a torch.Tensor, got {type(indexer_cache).__name__}")
        if indexer_cache.dim() != 3 or indexer_cache.shape[2] != self.head_dim:
            raise ValueError(f"indexer_cache must have shape [num_blocks, block_size, {self.head_dim}] "
                             f"(index_head_dim), got {tuple(indexer_cache.shape)}")
        if indexer_cache.dtype == FP8_DTYPE:
            if (not isinstance(indexer_scale, torch.Tensor) or indexer_scale.dtype != torch.float32
                    or tuple(indexer_scale.shape) != tuple(indexer_cache.shape[:2])):
                got = (f"{indexer_scale.dtype} {tuple(indexer_scale.shape)}" if isinstance(indexer_scale, torch.Tensor)
                       else repr(indexer_scale))
                raise ValueError(f"an fp8 indexer_cache needs indexer_scale fp32 {tuple(indexer_cache.shape[:2])} "
                                 f"(one scale per key), got {got}")
        else:
            indexer_scale = None
        self.indexer_cache, self.indexer_scale = indexer_cache, indexer_scale

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, q_resid: torch.Tensor,
                batch: StepLayout) -> torch.Tensor:
        """positions [T], hidden [T, E], q_resid [T, Qr] -> topk_indices int32 [T, K] (positions, -1 padded)."""
        if self.indexer_cache is None:
            raise RuntimeError(
                "LightningIndexer: no indexer cache is bound; allocate model.extra_kv_cache_specs()['indexer'] "
                "(one [num_blocks, block_size, index_head_dim] tensor per indexer layer, the latent pool's blocks) "
                "and call model.bind_extra_kv_caches({'indexer': [...]}) before forward")
        batch.check_pool_block_size(self.indexer_cache.shape[1], "the indexer cache")
        num_tokens = hidden.shape[0]
        q = self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim)       # [T, Hi, Di]
        k = self.k_norm(self.wk(hidden))                                              # [T, Di]
        ops.apply_rope_(q, k.unsqueeze(1), positions, self.rotary_emb.cos_sin_cache, is_neox=self.rope_is_neox)
        weights = self.weights_proj(hidden.float()) * self.num_heads ** -0.5          # [T, Hi] fp32
        ops.store_indexer_k_(k, self.indexer_cache, batch.slot_mapping, indexer_scale=self.indexer_scale)
        return ops.indexer_topk(q, weights, self.indexer_cache, batch.block_tables, batch.cu_seqlens_q,
                                batch.context_lens, batch.max_seqlen_q, batch.max_seqlen_k, topk=self.topk,
                                scale=self.scale, indexer_scale=self.indexer_scale)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, topk={self.topk}, "
                f"rope_is_neox={self.rope_is_neox}, bound={self.indexer_cache is not None}")


class DequantizedProjection(nn.Module):
    """What a quantized ``kv_b_proj`` leaves once ``MultiHeadLatentAttention.w_kv_b`` holds its weight: no tensors
    (its stored weight and scales are freed), its ``scheme`` (what the checkpoint stored), ``prefix`` (its
    checkpoint name) and ``shape`` (this rank's [H (Dn + Dv), L])."""

    def __init__(self, scheme, prefix: str, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.scheme, self.prefix, self.shape = scheme, prefix, shape

    def extra_repr(self) -> str:
        return f"{self.scheme.describe()}, dequantized into w_kv_b {list(self.shape)}"


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2/V3's attention block, HF's parameter names (see the module docstring for the data flow).

    Args:
        hidden_size: E. num_heads: all query heads (split across ``tp_size`` ranks).
        q_lora_rank: Qr, or None for a direct ``q_proj`` (DeepSeek-V2-Lite).
        kv_lora_rank: L. qk_nope_head_dim: Dn. qk_rope_head_dim: R. v_head_dim: Dv.
        rotary_emb: a ``RotaryEmbedding`` over R dims (its ``is_neox`` says the pair layout).
        scale: softmax scale (``ops.yarn_softmax_scale(Dn + R, rope_scaling)``).
        rms_norm_eps: of ``q_a_layernorm`` / ``kv_a_layernorm``.
        bias: ``attention_bias`` (on q_a_proj, kv_a_proj_with_mqa and o_proj, as in transformers).
        indexer: a ``LightningIndexer`` (DSA layers: attention over its top-k positions only), or None.
        topk_share: DSA only: the model's ``TopkShare``. A layer with an indexer writes its top-k there; a layer
            without one (GLM-5 "shared") reads the last one written instead of attending densely.
        quant_config, prefix: the model's quantization and this block's name (``model.layers.{i}.self_attn``).

    **Quantization.** ``q_proj`` / ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` get the
    linear method their rules give them (``Fp8Linear`` with 128 x 128 block scales in DeepSeek-V3/R1's FP8
    release; each rule applies to the checkpoint module itself: ``q_a_proj`` and ``kv_a_proj_with_mqa``, which
    vLLM fuses, are separate layers here and may differ). ``kv_b_proj`` is never a GEMM: a quantized one is
    built with its stored FP8 / INT8 weight and scales (so the checkpoint loads as stored, through the same
    weight loaders and tensor-parallel splits) and is dequantized ONCE after loading
    (``process_weights_after_loading``, as vLLM does) into ``w_kv_b``, its weight in the model dtype, which
    ``w_uk`` / ``w_uv`` view; the quantized layer is then replaced by a ``DequantizedProjection`` holding no
    tensors (its scheme and name only), so the stored copy is freed. Memory: ``H (Dn + Dv) L`` elements per
    layer per rank in the model dtype, 2 bytes per element in bf16 where the checkpoint stores 1 (DeepSeek-V3:
    128 x 256 x 512 = 16.8 M elements, 32 MiB per layer at tensor-parallel size 1, 1.9 GiB over its 61 layers,
    1/tp of that per rank, against ~640 GiB of FP8 weights; the FP8 copy freed is 16 MiB a layer, 0.95 GiB).
    ``w_kv_b`` is a buffer of the module (``state_dict`` carries it once loaded; weights load into a model
    that has not yet been processed: a fresh one). Online quantization (``quant_config.online``) leaves
    ``kv_b_proj`` in the model dtype: rounding it to FP8 only to dequantize it again would lose precision and
    save nothing.

    Tensor parallelism splits the heads: ``q_proj`` / ``q_b_proj`` / ``kv_b_proj`` are column-parallel
    (their rows are head-major), ``o_proj`` row-parallel; the low-rank ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` and their norms are replicated, so every rank caches the same latent rows.
    ``tp_group``: the process group ``o_proj``'s sum runs over.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rotary_emb: RotaryEmbedding,
                 scale: float, rms_norm_eps: float, bias: bool = False, dtype: torch.dtype | None = None,
                 tp_rank: int = 0, tp_size: int = 1, indexer: LightningIndexer | None = None,
                 topk_share: TopkShare | None = None, tp_group=None, quant_config: QuantConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        if indexer is not None and q_lora_rank is None:
            raise ValueError("a DSA indexer reads q_a_layernorm's output: it needs q_lora_rank")
        if rotary_emb.rotary_dim != qk_rope_head_dim:
            raise ValueError(f"rotary_emb turns {rotary_emb.rotary_dim} dims, qk_rope_head_dim is {qk_rope_head_dim}")
        self.num_heads = divide(num_heads, tp_size, what="num_attention_heads")  # H on this rank
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.dtype = dtype or torch.get_default_dtype()
        tp = {"tp_rank": tp_rank, "tp_size": tp_size, "tp_group": tp_group, "dtype": dtype}

        def quant(name: str) -> dict:
            return _quant(quant_config, prefix, name)

        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * qk_head_dim, False, **tp, **quant("q_proj"))
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, q_lora_rank, bias, dtype=dtype, **quant("q_a_proj"))
            self.q_a_layernorm = RMSNorm(q_lora_rank, rms_norm_eps, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * qk_head_dim, False, **tp,
                                                 **quant("q_b_proj"))
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias, dtype=dtype,
                                                   **quant("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, rms_norm_eps, dtype=dtype)
        online = quant_config is not None and quant_config.online
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False, **tp,
                                              **({} if online else quant("kv_b_proj")))
        # kv_b_proj's weight in the model dtype, dequantized once after loading (quantized kv_b_proj only).
        self.register_buffer("w_kv_b", None)
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, bias, **tp, **quant("o_proj"))
        self.rotary_emb = rotary_emb
        self.attn = MLAPagedAttention(self.num_heads, kv_lora_rank, qk_rope_head_dim, v_head_dim, scale=scale)
        self.indexer = indexer
        self.topk_share = topk_share

    def process_weights_after_loading(self) -> None:
        """A quantized ``kv_b_proj``: its stored values times their scales, once, into ``w_kv_b`` [H (Dn + Dv), L]
        in the model dtype (fp32 arithmetic), then the quantized layer is replaced by a ``DequantizedProjection``
        (its weight and scales freed; idempotent). An unquantized one is viewed as it is."""
        kv_b = self.kv_b_proj
        if isinstance(kv_b, DequantizedProjection) or not kv_b.scheme.is_quantized:
            return
        with torch.no_grad():
            self.w_kv_b = kv_b.quant_method.dequantized_weight(kv_b).to(self.dtype)
        # (the loader calls this before kv_b_proj's own hook: the replacement is what it visits next)
        self.kv_b_proj = DequantizedProjection(kv_b.scheme, kv_b.prefix, tuple(self.w_kv_b.shape))

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [H, Dn, L], w_uv [H, Dv, L]) in the model dtype: views of this rank's ``kv_b_proj.weight`` (no
        copy), or of ``w_kv_b`` where ``kv_b_proj`` is quantized."""
        if self.w_kv_b is not None:
            w = self.w_kv_b
        elif self.kv_b_proj.scheme.is_quantized:
            raise RuntimeError("MultiHeadLatentAttention: kv_b_proj is quantized and process_weights_after_loading() "
                               "has not dequantized it (load_model and load_weights run it)")
        else:
            w = self.kv_b_proj.weight
        w = w.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: StepLayout) -> torch.Tensor:
        """positions [T] int64, hidden [T, E] -> [T, E]."""
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))                          # [T, Qr]
            q = self.q_b_proj(q_resid)
        q = q.view(num_tokens, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q[..., :self.qk_nope_head_dim], q[..., self.qk_nope_head_dim:]   # views
        kv_a = self.kv_a_proj_with_mqa(hidden)                                          # [T, L + R]
        kv_c = self.kv_a_layernorm(kv_a[:, :self.kv_lora_rank])                          # [T, L]
        k_pe = kv_a[:, self.kv_lora_rank:]                                               # [T, R] view
        self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))                              # in place
        topk_indices = None
        if self.indexer is not None:
            topk_indices = self.indexer(positions, hidden, q_resid, batch)               # [T, K] int32
            if self.topk_share is not None:
                self.topk_share.indices = topk_indices
        elif self.topk_share is not None:
            topk_indices = self.topk_share.indices
            if topk_indices is None or topk_indices.shape[0] != num_tokens:
                raise RuntimeError("a DSA layer that shares top-k ran before any layer with an indexer this step")
        w_uk, w_uv = self.absorbed_weights()
        out = self.attn(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, batch, topk_indices)      # [T, H, Dv]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))


class MLACaches:
    """The cache half of the model contract for a module whose MLA layers are ``self._mla_layers``
    (``MLAPagedAttention``, in order) and whose DSA indexers are ``self._indexers`` (``LightningIndexer``, in
    order), in ``self.dtype``: the DeepSeek models and their MTP draft module (``models.mtp``)."""

    # ---- the latent pool -------------------------------------------------------------------------------------------

    def kv_cache_spec(self, dtype: torch.dtype | None = None) -> KVCacheSpec:
        """One latent row of L + R per token per layer, no V (``KVCacheSpec.mla``), in ``dtype`` (default: the
        model's; ``torch.float8_e4m3fn`` for an fp8 pool)."""
        first = self._mla_layers[0]
        return KVCacheSpec.mla(num_layers=len(self._mla_layers), kv_lora_rank=first.kv_lora_rank,
                               qk_rope_head_dim=first.qk_rope_head_dim, dtype=dtype or self.dtype)

    def kv_cache_scales(self) -> list[tuple[torch.Tensor | None]]:
        """Per layer ``(kv_scale,)``: the checkpoint's fp8 scale of the latent cache (fp32 [1]; its ``k_scale``, see
        ``MLAPagedAttention.checkpoint_kv_scale``), or None (an fp8 pool then uses 1.0)."""
        return [(attn.checkpoint_kv_scale,) for attn in self._mla_layers]

    def bind_kv_cache(self, kv_caches: list) -> None:
        """Give each layer its latent pool: ``kv_caches[i]`` is ``(latent_cache,)`` (or the bare tensor) of shape
        ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, or ``(latent_cache, kv_scale)`` for a
        float8_e4m3fn pool (fp32 [1]); one entry per layer in order. ``bound_kv_caches`` is that list."""
        if len(kv_caches) != len(self._mla_layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries, the model has {len(self._mla_layers)} "
                             f"MLA layers")
        for i, (attn, entry) in enumerate(zip(self._mla_layers, kv_caches)):
            if isinstance(entry, torch.Tensor):
                entry = (entry,)
            if not isinstance(entry, (tuple, list)) or len(entry) not in (1, 2):
                raise ValueError(f"kv_caches[{i}] must be (latent_cache,) or (latent_cache, kv_scale): MLA caches one "
                                 f"latent row per token, no separate K and V")
            attn.bind_kv_cache(entry[0], entry[1] if len(entry) == 2 else None)
        self.bound_kv_caches = kv_caches

    # ---- caches besides the latent pool (DSA's indexer keys) -------------------------------------------------------

    def extra_kv_cache_specs(self, dtype: torch.dtype | None = None) -> dict[str, KVCacheSpec]:
        """The per-token caches a runner allocates besides ``kv_cache_spec(dtype)``'s, by name; empty for V2/V3.

        DSA models: ``{"indexer": spec}``, one ``[num_blocks, block_size, index_head_dim]`` tensor per layer
        with an indexer (``spec.kv_shape(NB, BS)``) in the model's dtype, over the SAME num_blocks and
        block_size as the latent pool: each token's key goes to the slot its latent row goes to (same block
        tables, same slot_mapping). With an fp8 latent pool (``dtype`` float8_e4m3fn) the keys are fp8 too,
        one fp32 scale per key beside them: ``{"indexer": spec (fp8), "indexer_scale": spec}``, the second one
        ``[num_blocks, block_size, 1]`` fp32 tensor per indexer layer (Di + 4 bytes a key, as DeepSeek's release
        keeps them). A runner budgets ``kv_cache_spec(dtype).bytes_per_token + sum(spec.bytes_per_token for spec
        in extra_kv_cache_specs(dtype).values())`` per token.
        """
        if not self._indexers:
            return {}
        layers, head_dim = len(self._indexers), self._indexers[0].head_dim
        if dtype != FP8_DTYPE:
            return {"indexer": KVCacheSpec.mla(num_layers=layers, kv_lora_rank=head_dim, qk_rope_head_dim=0,
                                               dtype=self.dtype)}
        return {"indexer": KVCacheSpec.mla(num_layers=layers, kv_lora_rank=head_dim, qk_rope_head_dim=0,
                                           dtype=FP8_DTYPE),
                "indexer_scale": KVCacheSpec.mla(num_layers=layers, kv_lora_rank=1, qk_rope_head_dim=0,
                                                 dtype=torch.float32)}

    def bind_extra_kv_caches(self, caches: dict[str, list[torch.Tensor]]) -> None:
        """Bind what ``extra_kv_cache_specs(dtype)`` asked for: ``caches[name]`` holds one tensor per layer of
        that cache, in layer order (``{"indexer": [k_idx_cache_of_indexer_layer_0, ...]}``, plus
        ``"indexer_scale"`` ([NB, BS, 1] or [NB, BS] fp32 each) when the key caches are fp8).
        ``bound_extra_kv_caches`` is that dict."""
        wanted = set(self.extra_kv_cache_specs())
        fp8 = bool(wanted) and "indexer" in caches and any(t.dtype == FP8_DTYPE for t in caches["indexer"])
        if fp8:
            wanted.add("indexer_scale")
        if set(caches) != wanted:
            raise ValueError(f"extra caches must be exactly {sorted(wanted)}, got {sorted(caches)}"
                             + (" (fp8 indexer keys need their per-key scales)" if fp8 else ""))
        if wanted:
            tensors = list(caches["indexer"])
            scales = list(caches["indexer_scale"]) if fp8 else [None] * len(tensors)
            for name, entries in (("indexer", tensors), ("indexer_scale", scales)):
                if len(entries) != len(self._indexers):
                    raise ValueError(f"caches[{name!r}] has {len(entries)} tensors, the model has "
                                     f"{len(self._indexers)} indexer layers")
            for indexer, cache, scale in zip(self._indexers, tensors, scales):
                indexer.bind_kv_cache(cache, None if scale is None else scale.reshape(scale.shape[:2]))
        self.bound_extra_kv_caches = caches
