"""Block hashes for the prefix cache.

A full block of ``block_size`` token ids is named by a hash that chains its parent's hash
with its own token ids, so equal hashes mean (up to a 64-bit collision) an equal *prefix*,
not just an equal block:

    hash(block i) = xxh64( uint64_le(hash(block i-1)) ‖ int64_le(token ids of block i) ),
    hash(block -1) = ROOT_PARENT_HASH.

The byte layout is fixed (little-endian on every platform) so hashes are stable across
machines and runs, e.g. for a cache shared between processes.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import xxhash

# Parent hash of a sequence's first block.
ROOT_PARENT_HASH = 0

_UINT64_LIMIT = 1 << 64


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int] | np.ndarray) -> int:
    """Hash of one block given its parent's hash.

    Args:
        parent_hash: hash of the previous block of the same sequence, or ``ROOT_PARENT_HASH``
            for the first block; an int in [0, 2**64).
        token_ids: the block's token ids, int-like, 1-D (any length; the block manager only
            hashes full blocks). Each must fit in int64.

    Returns:
        ``xxh64(parent_hash as 8 little-endian bytes ‖ token ids as little-endian int64 bytes)``
        as an int in [0, 2**64).
    """
    if isinstance(parent_hash, bool) or not isinstance(parent_hash, numbers.Integral):
        raise TypeError(f"parent_hash must be an int, got {type(parent_hash).__name__}")
    parent_hash = int(parent_hash)  # (a numpy uint64 from a framework's array of hashes)
    if not 0 <= parent_hash < _UINT64_LIMIT:
        raise ValueError(f"parent_hash must be in [0, 2**64), got {parent_hash}")
    tokens = np.asarray(token_ids, dtype="<i8")
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
    return xxhash.xxh64_intdigest(parent_hash.to_bytes(8, "little") + tokens.tobytes())


def hash_full_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent_hash: int = ROOT_PARENT_HASH,
) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block is skipped).

    Returns ``len(token_ids) // block_size`` hashes; entry i names tokens ``[0, (i+1)*block_size)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = np.asarray(token_ids, dtype="<i8")
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, tokens[start : start + block_size])
        hashes.append(parent_hash)
    return hashes
