"""RoPE and the KV-cache write as one op: ``rope_store_kv_``.

``rope_store_kv_(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)`` is
``apply_rope_(q, k, positions, cos_sin_cache)`` followed by ``store_kv_(k, v, k_cache, v_cache, slot_mapping)``:
q and k rotated in place, the rotated k and v written to their slots. The Triton backend does it in one
launch (a decode step's attention layer saves one kernel); the twin and AITER run the two ops' own backends.
Legend and layouts as in ``atom_core.ops.rope`` and ``atom_core.ops.kv_cache``.
"""

from __future__ import annotations

from torch import Tensor

from atom_core.ops import kv_cache, rope
from atom_core.ops.dispatch import Op, call_op, custom_op
from atom_core.ops.reference import rope_kv as reference_rope_kv
from atom_core.ops.validation import debug_enabled

ROPE_STORE_KV = Op("rope_store_kv_")


def _rope_args(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale):
    return q, k, positions, cos_sin_cache, is_neox


def _store_args(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale):
    return k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale


def _torch_rope_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, k_scale,
                         v_scale):
    reference_rope_kv.rope_store_kv_(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                     is_neox=is_neox, k_scale=k_scale, v_scale=v_scale)


def _both(rope_supports, store_supports):
    """A backend's ``supports``: what the rope op's and the store op's backends of that name both serve."""
    def supports(*args) -> str | None:
        return rope_supports(*_rope_args(*args)) or store_supports(*_store_args(*args))
    return supports


def _both_keys(rope_key, store_key):
    def key(*args):
        return rope_key(*_rope_args(*args)), store_key(*_store_args(*args))
    return key


def _aiter_rope_store_kv(*args):
    from atom_core.ops.aiter import kv_cache as aiter_kv_cache
    from atom_core.ops.aiter import rope as aiter_rope

    aiter_rope.apply_rope_(*_rope_args(*args))
    aiter_kv_cache.store_kv_(*_store_args(*args))


ROPE_STORE_KV.register("torch", _torch_rope_store_kv)
ROPE_STORE_KV.register("triton", "atom_core.ops.triton.rope_kv:rope_store_kv_",
                       _both(rope._triton_supports, kv_cache._triton_supports),
                       _both_keys(rope._triton_key, kv_cache._triton_key))
ROPE_STORE_KV.register("aiter", _aiter_rope_store_kv, _both(rope._aiter_supports, kv_cache._aiter_supports),
                       _both_keys(rope._aiter_key, kv_cache._aiter_key))


@custom_op("rope_store_kv_", mutates_args=("q", "k", "k_cache", "v_cache"))
def _rope_store_kv_op(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, k_cache: Tensor,
                      v_cache: Tensor, slot_mapping: Tensor, is_neox: bool, k_scale: Tensor | None,
                      v_scale: Tensor | None, backend: str | None) -> None:
    ROPE_STORE_KV(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale,
                  backend=backend)


@_rope_store_kv_op.register_fake
def _(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale, backend) -> None:
    return None


def rope_store_kv_(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, k_cache: Tensor,
                   v_cache: Tensor, slot_mapping: Tensor, *, is_neox: bool = True, k_scale: Tensor | None = None,
                   v_scale: Tensor | None = None, backend: str | None = None) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place by ``positions`` (``apply_rope_``), then write k and
    v [T, Hk, D] to their slots of k_cache / v_cache [NB, BS, Hk, D] (``store_kv_``: slot -1 writes nothing;
    an fp8 cache stores ``k / k_scale`` and ``v / v_scale``). Arguments as in those two ops."""
    if debug_enabled():
        rope._check_rope_args(q, k, positions, cos_sin_cache)
        kv_cache._check_store_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    elif slot_mapping.shape[0] != k.shape[0]:  # always on, as in store_kv_
        raise ValueError(f"slot_mapping must have one slot per token ({k.shape[0]}), got {slot_mapping.shape[0]}")
    k_scale, v_scale = kv_cache.pool_scales(k_cache, k_scale, v_scale)
    call_op("rope_store_kv_", q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, bool(is_neox),
            k_scale, v_scale, backend)
