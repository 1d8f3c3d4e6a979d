"""Twin of ``rope_store_kv_``: the RoPE twin on q and k, then the KV-store twin on the rotated k and v."""

from __future__ import annotations

import torch

from atom_core.ops.reference.kv_cache import store_kv_
from atom_core.ops.reference.rope import apply_rope_


def rope_store_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, is_neox: bool = True, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Rotate q and k in place (``apply_rope_``), then write k and v to their slots (``store_kv_``)."""
    apply_rope_(q, k, positions, cos_sin_cache, is_neox=is_neox)
    store_kv_(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
