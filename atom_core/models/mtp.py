"""The multi-token-prediction (MTP) layers of DeepSeek-V3 / R1, V3.2 and GLM-5 as a draft module.

Legend: T = tokens, E = hidden size, V = vocabulary, N = ``num_hidden_layers`` of the target,
k = MTP depth (``num_nextn_predict_layers``, 1 in every release), p = a token's position.

**What it computes** (DeepSeek-V3 report, section 2.2, "MTP module k"). For a token at position p, with
``h`` the target's hidden state at p (``target.forward``'s output, final norm applied, as vLLM and SGLang
feed it) or, for depth k > 0, the previous MTP module's output, and ``t`` the token at p + k + 1::

    h'  = eh_proj([enorm(embed(t)); hnorm(h)])     [E]    embed / lm_head: the target's (shared)
    h'' = mtp_block(h', p)                         [E]    a full decoder layer (MLA, DSA where the target has
                                                          it, MoE), with its own latent (and indexer) cache
    logits = lm_head(shared_head.norm(h''))        [V]    the distribution of the token at p + k + 2

``forward`` returns ``h''`` (the next depth's ``h``), ``compute_logits`` the logits. The report writes the
concatenation as ``[RMSNorm(h); RMSNorm(Emb(t))]``; the released weights were trained with the embedding
half first (Megatron's MTP, and every serving engine: vLLM's and SGLang's ``torch.cat([enorm(emb),
hnorm(h)])``), so ``eh_proj``'s first E input columns read the token. vLLM also zeroes the embedding at
position 0; this module does not (the equations have no such term).

In speculative decoding the draft runs one step behind the target, over the target's layout: the draft's
token at position p is the target's token at p + 1 (known once the target has sampled it), its hidden
the target's at p, its slots the target's (the MTP block caches its rows at the same slots, in its own
pool). A runner allocates that pool from this module's ``kv_cache_spec()`` / ``extra_kv_cache_specs()``
(one latent layer per depth, plus the indexer for DSA targets), over the target pool's blocks. Since the
draft's row at position p depends on the token at p + 1, a prefix-cache hit of c tokens serves the draft
only where the request's token c equals the one cached with it: a runner drops the last hit block when it
drafts (as vLLM does) rather than rewrite a row of a shared block.

**Weights.** Checkpoint layer ``N + k`` holds depth k: ``model.layers.{N+k}.{enorm, hnorm, eh_proj,
shared_head.norm}.weight`` and the decoder block's tensors under the same prefix (``self_attn.*``,
``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``). Parameter names here are
``layers.{k}.{enorm, hnorm, eh_proj, shared_head.norm}.weight`` and ``layers.{k}.mtp_block.<block name>``
(vLLM's spelling), with the target's fusing and expert stacking. DeepSeek-V3's ``model.layers.{N+k}.
embed_tokens.weight`` and ``shared_head.head.weight`` are copies of the target's embedding and head (its
README: "shared with the main model"; GLM-5 does not even ship them): they are not read, the target's
modules are used.

**Loading.** ``load_mtp_module(path, target)`` builds the module next to a loaded target (same dtype,
device and tensor-parallel shard) and fills it from the checkpoint's MTP tensors; ``load_model`` keeps
skipping them (``loader``: layers >= ``num_hidden_layers``). A quantized checkpoint's MTP layer (DeepSeek-V3's
FP8 release stores it in block FP8 like the others) loads as stored: the block is built with the target's
quantization.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch
from torch import nn

from atom_core.cache.token_layout import StepLayout
from atom_core.models.base import QUANTIZED_DENSE_FORMATS
from atom_core.models.layers.linear import ReplicatedLinear
from atom_core.models.layers.mla import LightningIndexer, MLACaches, MLAPagedAttention
from atom_core.models.layers.norm import RMSNorm
from atom_core.models.loader import load_weights

# Tensors of the MTP layer that are the target's own (shared), never read into the draft module.
SHARED_WITH_TARGET = ("embed_tokens.", "shared_head.head.")
# The MTP layer's own glue (everything else in the layer is the decoder block).
MTP_GLUE = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")


class SharedHead(nn.Module):
    """``shared_head.norm`` (the head itself is the target's ``lm_head``)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, dtype=dtype)


class MTPLayer(nn.Module):
    """One MTP depth: ``enorm``, ``hnorm``, ``eh_proj`` (2E -> E, replicated), ``shared_head.norm`` and the
    decoder block ``mtp_block`` (``forward(positions, hidden, residual, batch) -> (hidden, residual)``)."""

    def __init__(self, hidden_size: int, eps: float, block: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.hnorm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.eh_proj = ReplicatedLinear(2 * hidden_size, hidden_size, False, dtype=dtype)
        self.shared_head = SharedHead(hidden_size, eps, dtype)
        self.mtp_block = block


class MultiTokenPredictor(MLACaches, nn.Module):
    """The draft module of a DeepSeek-family target (see the module docstring for what it computes).

    Built from a target model (``DeepseekV2ForCausalLM`` family, or any ``CausalLM`` whose ``make_layer(i)``
    builds its decoder layer i, also past ``num_hidden_layers``, and whose caches are MLA's): one ``MTPLayer``
    per ``num_nextn_predict_layers``, each block ``target.make_layer(N + k)``. Parameters are created
    uninitialised on the target's device in its dtype; ``load_mtp_module`` fills them. The target's
    ``model.embed_tokens`` and ``lm_head`` are used, not copied (and are not parameters of this module).
    """

    # Its blocks are the target's own layers (``target.make_layer``), built with the target's quantization: a
    # quantized checkpoint loads here in the formats the target's class loads (the target refused the others).
    supported_quantization = QUANTIZED_DENSE_FORMATS

    def __init__(self, target: nn.Module, *, num_layers: int | None = None) -> None:
        super().__init__()
        config = target.config
        if num_layers is None:
            num_layers = int(config.get("num_nextn_predict_layers") or 0)
        if num_layers < 1:
            raise ValueError(f"{type(target).__name__}'s config has no MTP layers (num_nextn_predict_layers = "
                             f"{config.get('num_nextn_predict_layers')!r})")
        self.config = config                  # read by the loader (layer count, tied head, quantization)
        self.dtype = target.dtype
        self.first_layer = config.num_hidden_layers   # checkpoint index of depth 0
        device = next(target.parameters()).device
        with torch.device(device):
            self.layers = nn.ModuleList(
                MTPLayer(config.hidden_size, config.rms_norm_eps, target.make_layer(self.first_layer + k), self.dtype)
                for k in range(num_layers))
        self._target = (target,)  # a tuple: the target's embedding and head are used, not registered here
        self.packed_modules_mapping = dict(target.packed_modules_mapping)
        self.expert_params_mapping = list(getattr(target, "expert_params_mapping", []))
        self._mla_layers = [m for m in self.layers.modules() if isinstance(m, MLAPagedAttention)]
        self._indexers = [m for m in self.layers.modules() if isinstance(m, LightningIndexer)]
        self.bound_kv_caches: list | None = None

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, batch: StepLayout,
                *, depth: int = 0) -> torch.Tensor:
        """input_ids [T] int64 (the token at p + depth + 1), positions [T] int64 (p), hidden [T, E] (the target's
        hidden at p for depth 0, else depth - 1's output), batch: the step's layout over this module's pool.
        Returns h'' [T, E] in the model's dtype (before ``shared_head.norm``)."""
        layer = self.layers[depth]
        embedded = self.target.model.embed(input_ids)                                           # [T, E]
        x = layer.eh_proj(torch.cat([layer.enorm(embedded), layer.hnorm(hidden)], dim=-1))       # [T, E]
        out, residual = layer.mtp_block(positions, x, None, batch)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor, *, depth: int = 0) -> torch.Tensor:
        """hidden [N, E] (``forward``'s output) -> logits [N, V] float32 through ``shared_head.norm`` and the
        target's head."""
        return self.target.compute_logits(self.layers[depth].shared_head.norm(hidden))

    def checkpoint_renames(self, name: str) -> str | None:
        """``model.layers.{N+k}.<glue>`` -> ``layers.{k}.<glue>``; ``model.layers.{N+k}.<block>`` ->
        ``layers.{k}.mtp_block.<block>``; the shared embedding / head copies and every other tensor -> None."""
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match is None:
            return None
        depth = int(match.group(1)) - self.first_layer
        rest = match.group(2)
        if not 0 <= depth < len(self.layers) or rest.startswith(SHARED_WITH_TARGET):
            return None
        return f"layers.{depth}.{rest}" if rest.startswith(MTP_GLUE) else f"layers.{depth}.mtp_block.{rest}"

    def checkpoint_name(self, param_name: str) -> str:
        """The inverse of ``checkpoint_renames`` on names (before the loader's fusing and stacking)."""
        match = re.fullmatch(r"layers\.(\d+)\.(?:mtp_block\.)?(.+)", param_name)
        if match is None:
            raise ValueError(f"{param_name!r} is not a parameter name of this module")
        return f"model.layers.{self.first_layer + int(match.group(1))}.{match.group(2)}"


def load_mtp_module(path: str | Path, target: nn.Module, *, check_finite: bool = True) -> MultiTokenPredictor:
    """The draft module of ``target`` (loaded from the same checkpoint folder ``path``) with its MTP weights.

    Raises ValueError when the config has no MTP layers, when the checkpoint holds none of an MTP layer's
    tensors (released checkpoints re-exported without them; HF's DeepSeek-V3 config sets one MTP layer by
    default), or, naming them as the checkpoint does, when it lacks some of them. Returns the module in eval
    mode; its caches are still to be allocated and bound.
    """
    module = MultiTokenPredictor(target)
    report = load_weights(module, path, strict=False, load_extra_layers=True, check_finite=check_finite)
    missing = [entry.partition(" ") for entry in report.missing]  # (parameter, " ", "(shards ... missing)")
    if missing:
        for depth, layer in enumerate(module.layers):
            names = {f"layers.{depth}.{name}" for name, _ in layer.named_parameters()}
            if names <= {name for name, _, _ in missing}:
                index = module.first_layer + depth
                raise ValueError(f"checkpoint {path} holds no tensor of MTP layer {index} (model.layers.{index}.*), "
                                 f"which config.json's num_nextn_predict_layers = {len(module.layers)} announces: "
                                 f"this checkpoint has no draft layers")
        as_stored = functools.partial(re.sub, r"layers\.\d+\.[\w.]+", lambda m: module.checkpoint_name(m.group(0)))
        shown = ", ".join(f"{module.checkpoint_name(name)}{gap}{as_stored(shards)}" for name, gap, shards in missing[:20])
        more = f" (and {len(missing) - 20} more)" if len(missing) > 20 else ""
        raise ValueError(f"{len(missing)} MTP tensors not found in checkpoint {path}: {shown}{more}")
    return module.eval()
