"""AITER adapter for ``store_kv_`` (aiter/ops/cache.py: ``reshape_and_cache_flash``, the NHD-page variant).

``kv_cache_dtype`` "auto" copies in the input dtype; "fp8" stores ``x / scale`` converted to fp8.
The scales are read through raw pointers even for "auto", so a unit scale is passed there.
"""

from __future__ import annotations

import aiter
import torch

from atom_core.ops.reference.kv_cache import FP8_DTYPE


def store_kv_(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    if k_cache.dtype == FP8_DTYPE:
        aiter.reshape_and_cache_flash(k, v, k_cache, v_cache, slot_mapping, "fp8", k_scale, v_scale)
        return
    unit = torch.ones(1, dtype=torch.float32, device=k.device)
    aiter.reshape_and_cache_flash(k, v, k_cache, v_cache, slot_mapping, "auto", unit, unit)
