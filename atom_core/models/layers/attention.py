"""Paged attention as a module: write this step's K/V into the bound pool, attend over it.

Legend: T = tokens this step, H = query heads, Hk = KV heads (both per tensor-parallel
rank), D = head dim, NB = pool blocks, BS = block size.

The module holds no parameters, only its layer's slice of the KV pool, bound once with
``bind_kv_cache`` (``[NB, BS, Hk, D]`` each for K and V). The step's token layout
(``StepLayout``: slot mapping, block tables, sequence lengths) is an argument of
``forward``; nothing is read from global state.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from atom_core import ops
from atom_core.cache.token_layout import StepLayout
from atom_core.models.layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    """Causal attention of this step's queries over each row's context in the paged KV pool.

    Args:
        num_heads: H, query heads on this rank.
        head_dim: D.
        num_kv_heads: Hk (divides H; query head h reads KV head ``h // (H // Hk)``).
        scale: softmax scale, ``1 / sqrt(D)`` when None.
        sliding_window: W; query at position p sees keys at positions ``> p - W`` only. None = full.
        logit_softcap: c > 0 caps scores as ``c * tanh(s / c)``; 0 = off.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, *, scale: float | None = None,
                 sliding_window: int | None = None, logit_softcap: float = 0.0) -> None:
        super().__init__()
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("num_kv_heads", num_kv_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        if logit_softcap < 0:
            raise ValueError(f"logit_softcap must be >= 0, got {logit_softcap}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.sliding_window = sliding_window
        self.logit_softcap = float(logit_softcap)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # FP8 KV scales a checkpoint ships (fp32 [1]), set by the loader; the runner binds them with an FP8 pool.
        self.checkpoint_k_scale: torch.Tensor | None = None
        self.checkpoint_v_scale: torch.Tensor | None = None

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        """Attach this layer's pool tensors, each ``[NB, BS, Hk, D]`` (fp8 pools: with fp32 [1] scales)."""
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(cache, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
            if cache.dim() != 4 or tuple(cache.shape[2:]) != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"{name} must have shape [num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
                    f"got {tuple(cache.shape)}"
                )
        if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
            raise ValueError(
                f"k_cache and v_cache must match: {tuple(k_cache.shape)} {k_cache.dtype} vs "
                f"{tuple(v_cache.shape)} {v_cache.dtype}"
            )
        self.k_cache, self.v_cache = k_cache, v_cache
        self.k_scale, self.v_scale = k_scale, v_scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepLayout, *,
                sinks: torch.Tensor | None = None, quantize: bool = False, rotary_emb: RotaryEmbedding | None = None,
                positions: torch.Tensor | None = None):
        """Store k, v at ``batch.slot_mapping`` and attend.

        q: [T, H, D]; k, v: [T, Hk, D] (same dtype); batch: the step's layout, on q's device;
        sinks: optional fp32 [H] extra softmax logit per head (GPT-OSS), owned by the caller so
        its parameter keeps the checkpoint's name. With ``rotary_emb`` and positions [T] int64, q and k
        are first rotated in place by it, in the same op as the store (``ops.rope_store_kv_``).
        Returns [T, H, D] in q's dtype; with ``quantize``, ``(out, scale)``: the output as fp8 e4m3fn
        [T, H, D] with one fp32 scale per head [T, H] (``ops.paged_attention(quantize=True)``).
        """
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(
                "PagedAttention: no KV cache is bound; allocate the pool (model.kv_cache_spec(), "
                "cache.plan_kv_pool) and call model.bind_kv_cache(kv_caches) before forward, "
                "even for a prefill-only step"
            )
        if q.dim() != 3 or q.shape[1:] != (self.num_heads, self.head_dim):
            raise ValueError(f"q must have shape [T, {self.num_heads}, {self.head_dim}], got {tuple(q.shape)}")
        batch.check_pool_block_size(self.k_cache.shape[1], "the KV cache (k_cache)")
        if rotary_emb is None:
            ops.store_kv_(k, v, self.k_cache, self.v_cache, batch.slot_mapping,
                          k_scale=self.k_scale, v_scale=self.v_scale)
        else:
            ops.rope_store_kv_(q, k, v, positions, rotary_emb.cos_sin_cache, self.k_cache, self.v_cache,
                               batch.slot_mapping, is_neox=rotary_emb.is_neox, k_scale=self.k_scale,
                               v_scale=self.v_scale)
        return ops.paged_attention(
            q, self.k_cache, self.v_cache, batch.block_tables, batch.cu_seqlens_q, batch.context_lens,
            batch.max_seqlen_q, batch.max_seqlen_k, scale=self.scale, sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap, sinks=sinks, k_scale=self.k_scale, v_scale=self.v_scale,
            quantize=quantize, row_order=batch.row_order,
        )

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.6g}, sliding_window={self.sliding_window}, "
                f"logit_softcap={self.logit_softcap}, bound={self.k_cache is not None}")
