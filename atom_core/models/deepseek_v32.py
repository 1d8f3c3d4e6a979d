"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3 plus DeepSeek
Sparse Attention (DSA). Everything else — MLA with its latent pool, the YaRN rope, DeepSeekMoE with
``noaux_tc`` routing, dense first layers, HF's parameter names — is ``deepseek_v2.DeepseekV3ForCausalLM``'s.

Legend: T = tokens, E = hidden size, Hi = ``index_n_heads``, Di = ``index_head_dim``, K = ``index_topk``,
R = qk_rope_head_dim, NB = pool blocks, BS = block size.

**DSA.** Each attention layer has a lightning indexer (``layers.mla.LightningIndexer``: ``self_attn.indexer.
{wq_b, wk, k_norm.{weight, bias}, weights_proj}``) that caches one key of Di numbers per token in its own
pool and picks, for each query token, the K context positions of highest index score; MLA then attends over
those positions only (``ops.mla_sparse_attention``). A query with at most K visible tokens keeps all of them:
short contexts are dense MLA. q_lora_rank is required (the indexer reads ``q_a_layernorm``'s output).
What matches transformers, in fp32: the scores ``sum_h w_h relu(q_h . k / sqrt(Di))`` unrotated and
unquantised (DeepSeek's release scores Hadamard-rotated fp8 q and k; the rotation keeps dot products and
fp8 is a precision shortcut, which transformers skips too), the indexer's rope on the first R dims of its
q and k with the MLA table (YaRN scale included), MLA's rope always interleaved.

**What GLM-5 changes** (transformers' ``glm_moe_dsa``, otherwise V3.2's code):

- the indexer rotates interleaved pairs (V3.2: half-split); ``indexer_rope_interleave`` in config.json says
  it explicitly (GLM-5.1 ships ``true``), each class defaults to its model's;
- cross-layer top-k sharing: ``indexer_types[i]`` is ``"full"`` (runs its indexer) or ``"shared"`` (no indexer
  weights, no indexer cache: reuses the top-k of the last full layer), given as ``indexer_types``, as
  ``index_topk_pattern`` ("FSS...") or by ``index_topk_freq`` / ``index_skip_topk_offset`` (transformers'
  rule; the defaults make every layer full, as the released GLM-5 / GLM-5.1 are);
- its own defaults (set in every released config.json): 64 heads, q_lora_rank 2048, Dn 192, Dv 256, one
  expert group, rms_norm_eps 1e-5, Hi 32.

**Caches** (what a runner allocates): the latent pool of ``kv_cache_spec()`` as for V3, plus
``extra_kv_cache_specs() == {"indexer": spec}``: one tensor ``[NB, BS, Di]`` in the model's dtype per layer
with an indexer, over the latent pool's blocks (same block tables and slot_mapping), bound with
``bind_extra_kv_caches({"indexer": [tensor, ...]})`` (see ``DeepseekV2ForCausalLM.extra_kv_cache_specs``).

**Quantization** (the FP8 releases; see ``deepseek_v2``): MLA as V3's, and the indexer's ``wq_b`` / ``wk`` with
the linear methods their rules give them (block FP8); ``weights_proj`` always fp32 and unquantized, as
DeepSeek stores it. The indexer's scores stay unquantized (see DSA above).
"""

from __future__ import annotations

from atom_core.models.config import ModelConfig
from atom_core.models.deepseek_v2 import DeepseekV3ForCausalLM
from atom_core.models.layers.mla import LightningIndexer, MultiHeadLatentAttention, TopkShare
from atom_core.models.qwen3_moe import config_int
from atom_core.models.registry import register_model

INDEXER_TYPES = ("full", "shared")


@register_model("DeepseekV32ForCausalLM")
class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2(-Exp): every layer (and the MTP block) runs its own indexer."""

    model_types = ("deepseek_v32",)
    default_indexer_rope_interleave = False

    def __init__(self, config: ModelConfig, **kwargs) -> None:
        if config.get("q_lora_rank") is None:
            raise ValueError(f"{type(self).__name__} needs q_lora_rank: the DSA indexer reads q_a_layernorm's output")
        self.index_topk = config_int(config, "index_topk")
        self.index_n_heads = config_int(config, "index_n_heads")
        self.index_head_dim = config_int(config, "index_head_dim")
        interleave = config.get("indexer_rope_interleave")
        interleave = self.default_indexer_rope_interleave if interleave is None else bool(interleave)
        self.indexer_rope_is_neox = not interleave
        self.indexer_types = self.resolve_indexer_types(config)
        if self.indexer_types[0] != "full":
            raise ValueError("the first layer must run its indexer (indexer_types[0] == 'full'): a 'shared' layer "
                             "reuses the top-k of an earlier one")
        # Model-wide only where some layer reuses another's top-k.
        self.topk_share = TopkShare() if "shared" in self.indexer_types else None
        super().__init__(config, **kwargs)

    @classmethod
    def resolve_indexer_types(cls, config: ModelConfig) -> list[str]:
        """One entry per decoder layer; V3.2: every layer ``"full"``."""
        return ["full"] * config.num_hidden_layers

    def indexer_type(self, layer_idx: int) -> str:
        """``"full"`` or ``"shared"``; layers past ``num_hidden_layers`` (MTP blocks) run their own indexer."""
        return self.indexer_types[layer_idx] if layer_idx < len(self.indexer_types) else "full"

    def rope_is_neox(self) -> bool:
        """MLA's rope dims: interleaved pairs, always (transformers' V3.2 and GLM-5 have no other layout)."""
        return False

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """``mlp_layer_types[i] == "sparse"`` where config.json lists them (transformers writes the list), else the
        DeepSeek rule (``first_k_dense_replace``, ``moe_layer_freq``), which also places the MTP blocks."""
        kinds = self.config.get("mlp_layer_types")
        if isinstance(kinds, list) and layer_idx < len(kinds):
            if kinds[layer_idx] not in ("dense", "sparse"):
                raise ValueError(f"mlp_layer_types[{layer_idx}] must be 'dense' or 'sparse', got {kinds[layer_idx]!r}")
            return kinds[layer_idx] == "sparse" and self.num_experts > 0
        return super().is_sparse_layer(layer_idx)

    def make_indexer(self, layer_idx: int) -> LightningIndexer:
        """Layer ``layer_idx``'s indexer; ``wq_b`` / ``wk`` get the model's quantization (``weights_proj`` none)."""
        return LightningIndexer(self.config.hidden_size, self.q_lora_rank, self.index_n_heads, self.index_head_dim,
                                self.index_topk, rotary_emb=self.mla_rotary_embedding(),
                                rope_is_neox=self.indexer_rope_is_neox, dtype=self.dtype,
                                **self.quant_args(f"model.layers.{layer_idx}.self_attn.indexer"))

    def make_attention(self, layer_idx: int, **dsa) -> MultiHeadLatentAttention:
        indexer = self.make_indexer(layer_idx) if self.indexer_type(layer_idx) == "full" else None
        # An MTP block (past num_hidden_layers) runs in its own forward: it shares no top-k with the decoder.
        share = self.topk_share if layer_idx < self.config.num_hidden_layers else None
        return super().make_attention(layer_idx, indexer=indexer, topk_share=share)


@register_model("GlmMoeDsaForCausalLM")
class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5 / GLM-5.1: V3.2's DSA with an interleaved indexer rope and optional cross-layer top-k sharing."""

    model_types = ("glm_moe_dsa",)
    default_indexer_rope_interleave = True

    @classmethod
    def resolve_indexer_types(cls, config: ModelConfig) -> list[str]:
        """``indexer_types``, else ``index_topk_pattern`` ("F"/"S" per layer), else transformers' schedule: layer i
        is full when ``max(i - offset + 1, 0) % freq == 0`` (``index_topk_freq``, default 1;
        ``index_skip_topk_offset``, default 2)."""
        layers = config.num_hidden_layers
        kinds = config.get("indexer_types")
        if kinds is None:
            pattern = config.get("index_topk_pattern")
            if pattern is not None:
                kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) \
                    else list(pattern)
            else:
                freq = max(config_int(config, "index_topk_freq", default=1), 1)
                offset = config_int(config, "index_skip_topk_offset", default=2)
                kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        if not isinstance(kinds, list) or len(kinds) != layers or any(k not in INDEXER_TYPES for k in kinds):
            raise ValueError(f"indexer_types must list 'full' or 'shared' for each of the {layers} layers, "
                             f"got {kinds!r}")
        return kinds
