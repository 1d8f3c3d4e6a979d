"""Rotary position embedding as a module: a cos/sin table built once, applied in place per step.

Legend: T = tokens, H = query heads, Hk = KV heads, D = head dim, R = rotary dim (<= D),
P = max positions.

The table comes from ``ops.rope_cos_sin_cache`` (plain RoPE and the HF scalings ``linear``,
``llama3``, ``yarn``; yarn's attention factor is folded into it) and is held as a
non-persistent buffer, so it follows ``model.to(device)`` but is neither saved nor loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom_core import ops
from atom_core.cache.pool_sizing import check_fits_in_memory, host_memory_available_bytes
from atom_core.models.config import available_memory_bytes, memory_name

# Host bytes per (position, rotary dim) while the table is built: it is computed in fp32 on the
# host, with the angles [P, R/2], cos and sin [P, R/2] each and their concatenation [P, R] alive
# at once (2 + 2 + 2 + 4 bytes).
_BUILD_BYTES_PER_ENTRY = 10


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dims of every q and k head by its token's position.

    Args:
        head_dim: D.
        rotary_dim: R, even, <= D (``D * partial_rotary_factor``; the other dims pass unchanged).
        max_position: P, rows of the table; positions must be < P.
        base: rope theta.
        scaling: the HF ``rope_scaling`` dict (``rope_type`` plus that type's keys) or None.
        is_neox: True rotates the two halves of the R dims (Llama, Qwen); False rotates
            interleaved pairs (GPT-J).
        cache_dtype: dtype of the table (float32 by default: angles of late positions lose
            precision in 16-bit types).

    The table has P rows: a P whose table (or its fp32 build on the host, ~10 bytes per entry)
    exceeds the memory available raises ``InsufficientMemoryError`` naming max_position_embeddings,
    before anything is allocated.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict | None = None, *, is_neox: bool = True,
                 cache_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        for name, value in (("head_dim", head_dim), ("rotary_dim", rotary_dim), ("max_position", max_position)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and <= head_dim={head_dim}, got {rotary_dim}")
        _check_table_fits(max_position, rotary_dim, cache_dtype, device)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = float(base)
        self.scaling = None if scaling is None else dict(scaling)
        self.is_neox = is_neox
        cos_sin_cache, attention_scale = ops.rope_cos_sin_cache(
            rotary_dim, max_position, self.base, self.scaling, dtype=cache_dtype, device=device)
        # Already multiplied into the table; kept for inspection.
        self.attention_scale = float(attention_scale)
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)  # [P, R]

    @classmethod
    def from_config(cls, config: Any, head_dim: int, *, layer_type: str | None = None,
                    is_neox: bool = True, device: torch.device | str | None = None) -> "RotaryEmbedding":
        """The rotary embedding a ``ModelConfig`` describes for heads of ``head_dim``.

        Reads ``config.rope_params(layer_type)`` (theta and scaling, per layer type when the
        config gives them per type), ``max_position_embeddings`` and the optional
        ``partial_rotary_factor``.
        """
        base, scaling = config.rope_params(layer_type)
        factor = float(config.get("partial_rotary_factor", 1.0) or 1.0)
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
        return cls(head_dim, int(head_dim * factor), config.max_position_embeddings, base, scaling,
                   is_neox=is_neox, device=device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, D] and k [T, Hk, D] in place by positions [T] int64; returns (q, k)."""
        ops.apply_rope_(q, k, positions, self.cos_sin_cache, is_neox=self.is_neox)
        return q, k

    def extra_repr(self) -> str:
        kind = "default" if self.scaling is None else self.scaling.get("rope_type", "default")
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
                f"base={self.base}, scaling={kind}, is_neox={self.is_neox}")


def _check_table_fits(max_position: int, rotary_dim: int, cache_dtype: torch.dtype,
                      device: torch.device | str | None) -> None:
    """Refuse a table [P, R] that does not fit: its fp32 build on the host, then the table on ``device``."""
    what = f"the rotary cos/sin table of max_position_embeddings={max_position} x rotary_dim={rotary_dim}"
    hint = "lower max_position_embeddings in config.json (to the longest sequence you will run)"
    check_fits_in_memory(what, max_position * (_BUILD_BYTES_PER_ENTRY * rotary_dim + 4), host_memory_available_bytes(),
                         where="host memory", detail=f"built in fp32 on the host, {_BUILD_BYTES_PER_ENTRY} bytes per "
                                                     "entry for the angles, cos, sin and the table", hint=hint)
    if device is not None and torch.device(device).type != "cpu":
        check_fits_in_memory(what, max_position * rotary_dim * cache_dtype.itemsize, available_memory_bytes(device),
                             where=memory_name(device), detail=f"{cache_dtype}", hint=hint)
