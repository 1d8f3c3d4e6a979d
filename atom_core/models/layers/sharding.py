"""Tensor-parallel shard arithmetic: which rows or columns of a full tensor a rank holds.

Pure integer functions, no torch. The linear and embedding layers use them to size their
parameters and to cut each rank's piece out of a full checkpoint tensor.

Conventions: ``tp_size`` ranks numbered ``0 .. tp_size - 1``; a dimension of ``total``
entries is cut into ``tp_size`` contiguous, equal pieces; rank r holds
``[r * total / tp_size, (r + 1) * total / tp_size)``.
"""

from __future__ import annotations

from dataclasses import dataclass


def check_tp(tp_rank: int, tp_size: int) -> None:
    """Raise ValueError unless ``tp_size >= 1`` and ``0 <= tp_rank < tp_size`` (both ints)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if not isinstance(tp_rank, int) or isinstance(tp_rank, bool) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}")


def divide(total: int, tp_size: int, *, what: str = "size") -> int:
    """``total // tp_size``; raise ValueError naming ``what`` when it does not divide evenly."""
    if total % tp_size != 0:
        raise ValueError(f"{what}={total} is not divisible by tp_size={tp_size}")
    return total // tp_size


def shard_range(total: int, tp_rank: int, tp_size: int, *, what: str = "size") -> tuple[int, int]:
    """``(start, size)`` of rank ``tp_rank``'s contiguous piece of a dimension of ``total`` entries.

    Raises ValueError when ``total`` is not divisible by ``tp_size``.
    """
    check_tp(tp_rank, tp_size)
    if total < 0:
        raise ValueError(f"{what} must be >= 0, got {total}")
    size = divide(total, tp_size, what=what)
    return tp_rank * size, size


@dataclass(frozen=True)
class QKVShard:
    """One rank's part of a fused QKV projection, in heads and in rows of the full tensors.

    ``q_start``/``kv_start`` are the first head this rank holds in the full q and k (or v)
    projections; the rank holds ``num_heads`` query heads and ``num_kv_heads`` KV heads.
    Row ranges of the full checkpoint tensors are ``head * head_dim`` of these.
    """

    num_heads: int       # query heads on this rank
    num_kv_heads: int    # KV heads on this rank
    head_dim: int
    q_start: int         # first query head of this rank in the full q_proj
    kv_start: int        # first KV head of this rank in the full k_proj / v_proj
    kv_replicas: int     # ranks sharing each KV head (1 unless num_kv_heads < tp_size)

    @property
    def q_size(self) -> int:
        """Rows of this rank's q piece: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of this rank's k (and of its v) piece: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim


def qkv_shard(num_heads: int, num_kv_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> QKVShard:
    """Heads of the fused QKV projection held by rank ``tp_rank``.

    Query heads are split evenly (``num_heads % tp_size == 0`` required). KV heads are split
    evenly when ``num_kv_heads >= tp_size`` (then ``num_kv_heads % tp_size == 0`` required);
    when there are fewer KV heads than ranks each rank holds one KV head, replicated on
    ``tp_size // num_kv_heads`` ranks (``tp_size % num_kv_heads == 0`` required): rank r holds
    head ``r * num_kv_heads // tp_size``, so the query heads of rank r (a contiguous block)
    still map onto that one KV head under GQA's ``h // (Hq // Hk)`` grouping.
    """
    check_tp(tp_rank, tp_size)
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    heads_per_rank = divide(num_heads, tp_size, what="num_heads (num_attention_heads)")
    if num_kv_heads >= tp_size:
        kv_per_rank = divide(num_kv_heads, tp_size, what="num_kv_heads (num_key_value_heads)")
        kv_start = tp_rank * kv_per_rank
        replicas = 1
    else:
        if tp_size % num_kv_heads != 0:
            raise ValueError(
                f"tp_size={tp_size} is not a multiple of num_kv_heads={num_kv_heads}: "
                "KV heads cannot be replicated evenly"
            )
        kv_per_rank = 1
        kv_start = tp_rank * num_kv_heads // tp_size
        replicas = tp_size // num_kv_heads
    return QKVShard(
        num_heads=heads_per_rank,
        num_kv_heads=kv_per_rank,
        head_dim=head_dim,
        q_start=tp_rank * heads_per_rank,
        kv_start=kv_start,
        kv_replicas=replicas,
    )


def padded_vocab_size(num_embeddings: int, tp_size: int) -> int:
    """Vocabulary rounded up to a multiple of ``tp_size`` so every rank holds the same rows."""
    if num_embeddings < 1:
        raise ValueError(f"num_embeddings must be >= 1, got {num_embeddings}")
    return -(-num_embeddings // tp_size) * tp_size


def vocab_shard(num_embeddings: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """``(start, rows, real_rows)`` of rank ``tp_rank``'s contiguous vocabulary range.

    The vocabulary is padded to ``padded_vocab_size``; the rank holds token ids
    ``[start, start + rows)`` of the padded range, of which the first ``real_rows`` exist in
    the checkpoint (``real_rows = clamp(num_embeddings - start, 0, rows)``); the padding rows
    stay zero and their logits are cut off after the all-gather.
    """
    check_tp(tp_rank, tp_size)
    rows = padded_vocab_size(num_embeddings, tp_size) // tp_size
    start = tp_rank * rows
    real_rows = max(0, min(rows, num_embeddings - start))
    return start, rows, real_rows
