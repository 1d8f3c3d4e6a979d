"""Block manager: ref-counted KV-pool blocks with a prefix cache.

The KV pool is ``num_blocks`` blocks of ``block_size`` token slots each. A sequence owns a
*block table*: the list of pool block ids holding its tokens in order (token at position
``pos`` lives in block ``table[pos // block_size]``, slot ``pos % block_size``).

Prefix cache. Once a step has computed the KV of a full block, ``publish`` gives the block a
chained hash (see ``prefix_hash``) and records it in an index ``hash -> block id``. A later
``allocate`` whose prompt starts with the same full blocks takes those blocks (incrementing
their ref count) instead of recomputing them. Freed blocks keep their hash and content until
they are handed out for something else, so a finished or preempted sequence's prefix stays
reusable for a while. A hit must also match the block's key: its parent's hash, its token ids and
a 128-bit digest of the whole prefix (xxh3-128, chained like the hash), so a 64-bit collision of two
prefixes is a miss, never KV computed after other tokens (vLLM offers sha256 for the same reason).

Free list. Blocks with ref count 0 sit in one ordered list; new blocks are taken from its
head. A freed block without a hash holds nothing reusable and goes to the head; a freed
block with a hash goes to the tail, so hashed content is evicted least-recently-freed first.
A sequence's blocks are freed tail first, so its tail is evicted before its head (a cached
head is useful on its own, a cached tail is not). A hit on a free block removes it from the
list in O(1) (an ``OrderedDict`` keyed by block id).

Reset. ``reset_prefix_cache`` forgets every hash (after a weight update the pool's KV was computed by
other weights, so no later prompt may take it). As vLLM's block pool does, it refuses (returns False,
changes nothing) while any block is held by a sequence: a running sequence's blocks would otherwise
lose the hashes its chain relies on. The caller drains (or aborts) its requests first.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from atom_core.cache.pool_sizing import check_fits_in_memory, host_memory_available_bytes
from atom_core.cache.prefix_hash import ROOT_PARENT_HASH, hash_block_tokens

logger = logging.getLogger(__name__)

__all__ = ["BlockManager", "PrefixCacheStats", "HOST_BYTES_PER_BLOCK"]

# Host bytes the manager holds per pool block (measured with tracemalloc at 10^5..10^6 blocks:
# 147..161): three list slots (ref count, hash, stored tokens: 8 bytes each), an OrderedDict
# entry of the free list (~90) and the block id's int object (28).
HOST_BYTES_PER_BLOCK = 150


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters since construction or the last ``reset_stats``.

    ``queries``: full prompt blocks looked up (those eligible to be served from the cache:
    ``(len(prompt) - 1) // block_size`` per successful ``allocate``); ``hits``: of those, blocks
    served from the cache. ``query_tokens`` / ``hit_tokens`` are the same in tokens
    (``hit_tokens`` = the sum of ``allocate``'s return values). ``allocate`` calls that return
    None count nothing.
    """

    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries, 0.0 when nothing was queried."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _SeqBlocks:
    """Per-sequence state: its block table and the chained hashes of its leading known blocks."""

    block_ids: list[int]
    # Hashes of blocks 0 .. len(block_hashes)-1, whose KV is known to be in the pool (served
    # from the cache or published). Kept even when the block itself is not in the index
    # (duplicate content), because the next block's hash chains on it.
    block_hashes: list[int]
    block_digests: list[bytes]  # the prefix digests of the same blocks
    # Held through a ``reset_prefix_cache(keep_held=True)``: its KV mixes two weight sets, so it publishes nothing.
    unpublishable: bool = False


# The prefix digest chained before a sequence's first block; block i's digest is
# xxh3_128(digest of block i-1 ‖ its token ids as little-endian int64).
ROOT_DIGEST = bytes(16)


def _prefix_digest(parent_digest: bytes, token_bytes: bytes) -> bytes:
    return xxhash.xxh3_128_digest(parent_digest + token_bytes)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _as_token_array(name: str, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a 1-D int64 array (accepts lists, tuples, numpy arrays, CPU tensors)."""
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {tokens.dtype}")
    return tokens.astype(np.int64, copy=False)


class BlockManager:
    """Hands out KV-pool blocks to sequences; shares full prefix blocks through a hash index.

    Args:
        num_blocks: blocks in the pool (ids ``0 .. num_blocks-1``).
        block_size: token slots per block.
        enable_prefix_caching: when False no block is ever hashed or shared.

    Sequences are named by any hashable ``seq_id``. Every method that cannot be served
    leaves the manager unchanged (``allocate`` returns None, ``append_slots`` False).

    Its per-block bookkeeping lives in host memory (about ``HOST_BYTES_PER_BLOCK`` bytes a block);
    a ``num_blocks`` whose bookkeeping would exceed the host memory available raises
    ``pool_sizing.InsufficientMemoryError`` before anything is allocated.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
        check_fits_in_memory(
            f"BlockManager(num_blocks={num_blocks})", int(num_blocks) * HOST_BYTES_PER_BLOCK,
            host_memory_available_bytes(), where="host memory",
            detail=f"about {HOST_BYTES_PER_BLOCK} bytes of bookkeeping per block",
            hint="use fewer KV blocks (num_kv_blocks, or a smaller memory budget)")
        self._num_blocks = int(num_blocks)
        self._block_size = int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)

        self._ref_counts = [0] * self._num_blocks
        # Published content of each block: its hash, and its key (parent hash, token ids, prefix digest);
        # None = nothing reusable.
        self._block_hash: list[int | None] = [None] * self._num_blocks
        self._block_key: list[tuple[int, tuple[int, ...], bytes] | None] = [None] * self._num_blocks
        self._hash_to_block: dict[int, int] = {}
        # Ref-0 blocks in hand-out order (head first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self._num_blocks))
        self._seqs: dict[Hashable, _SeqBlocks] = {}

        self._queries = self._hits = self._query_tokens = self._hit_tokens = 0

    # ---------------------------------------------------------------- properties

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (hashed or not): what new allocations can take."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently in the hash index (in use or free)."""
        return len(self._hash_to_block)

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits, self._query_tokens, self._hit_tokens)

    def reset_stats(self) -> None:
        self._queries = self._hits = self._query_tokens = self._hit_tokens = 0

    def __contains__(self, seq_id: Hashable) -> bool:
        """True while ``seq_id`` holds blocks (between ``allocate`` and ``free``)."""
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable, start: int = 0) -> list[int]:
        """A copy of the sequence's block table (pool block ids, in token order) from page ``start`` on.

        ``start`` lets a caller that mirrors the table fetch only the blocks ``append_slots`` added.
        """
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        return self._get_seq(seq_id).block_ids[start:]

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens fit in free blocks, not counting prefix-cache hits."""
        return _blocks_for(num_tokens, self._block_size) <= len(self._free)

    # ---------------------------------------------------------------- allocation

    def allocate(self, seq_id: Hashable, prompt_token_ids: Sequence[int] | np.ndarray, *,
                 use_cache: bool = True, count_stats: bool = True) -> int | None:
        """Reserve blocks for every prompt token, taking cached full prefix blocks where possible.

        Args:
            seq_id: a name not currently allocated.
            prompt_token_ids: the tokens to hold, 1-D ints, at least one (after a preemption:
                the prompt plus the tokens generated so far).
            use_cache: False allocates every block fresh, whatever the prefix cache holds (a
                request that needs every prompt position computed); its blocks are still published.
            count_stats: False keeps the lookup out of ``stats`` (a preempted request's recompute:
                the statistics count prompts).

        Returns:
            The number of leading prompt tokens whose KV is already in the pool (a multiple of
            ``block_size``, always < len(prompt): the last prompt block is never served from the
            cache, so at least one token runs and produces logits), or None if the blocks do not
            fit; then nothing changed.
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already allocated; free it first")
        tokens = _as_token_array("prompt_token_ids", prompt_token_ids)
        num_tokens = len(tokens)
        if num_tokens == 0:
            raise ValueError("prompt_token_ids is empty; a prompt needs at least one token")
        bs = self._block_size

        # Full blocks that may be served: all but the block holding the last prompt token.
        num_eligible = (num_tokens - 1) // bs if self.enable_prefix_caching and use_cache else 0
        hit_blocks: list[int] = []
        hit_hashes: list[int] = []
        hit_digests: list[bytes] = []
        hit_set: set[int] = set()
        parent, digest = ROOT_PARENT_HASH, ROOT_DIGEST
        for i in range(num_eligible):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            block_hash = hash_block_tokens(parent, block_tokens)
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            # Collision guard: the stored parent, token ids and prefix digest must equal the request's.
            digest = _prefix_digest(digest, block_tokens.astype("<i8").tobytes())
            if self._block_key[block_id] != (parent, tuple(block_tokens.tolist()), digest):
                break
            if block_id in hit_set:  # only after a 64-bit collision of two chains
                break
            hit_blocks.append(block_id)
            hit_set.add(block_id)
            hit_hashes.append(block_hash)
            hit_digests.append(digest)
            parent = block_hash

        num_hit_free = sum(1 for b in hit_blocks if self._ref_counts[b] == 0)
        num_new = _blocks_for(num_tokens, bs) - len(hit_blocks)
        if num_new > len(self._free) - num_hit_free:
            return None

        for block_id in hit_blocks:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        block_ids = hit_blocks + [self._take_free_block() for _ in range(num_new)]
        self._seqs[seq_id] = _SeqBlocks(block_ids, hit_hashes, hit_digests)

        num_cached_tokens = len(hit_blocks) * bs
        if count_stats:
            self._queries += num_eligible
            self._hits += len(hit_blocks)
            self._query_tokens += num_eligible * bs
            self._hit_tokens += num_cached_tokens
        return num_cached_tokens

    def append_slots(self, seq_id: Hashable, num_tokens_total: int) -> bool:
        """Grow the sequence's table to hold ``num_tokens_total`` tokens in all.

        Returns False (nothing changed) when the free blocks do not suffice. A total the table
        already holds is a no-op returning True; tables never shrink here.
        """
        seq = self._get_seq(seq_id)
        if num_tokens_total < 0:
            raise ValueError(f"num_tokens_total must be >= 0, got {num_tokens_total}")
        num_new = _blocks_for(num_tokens_total, self._block_size) - len(seq.block_ids)
        if num_new <= 0:
            return True
        if num_new > len(self._free):
            return False
        seq.block_ids.extend(self._take_free_block() for _ in range(num_new))
        return True

    def publish(
        self, seq_id: Hashable, token_ids: Sequence[int] | np.ndarray, num_computed_tokens: int
    ) -> None:
        """Make the sequence's newly computed full blocks reusable by later prompts.

        Call after the step that wrote their KV ran. Args: ``token_ids``, the sequence's tokens
        (at least its first ``num_computed_tokens``); ``num_computed_tokens``, how many leading
        tokens now have KV in the pool. Every full block inside that range not yet hashed gets
        its chained hash; it enters the index unless an equal block is already there.
        """
        seq = self._get_seq(seq_id)
        if not 0 <= num_computed_tokens <= len(token_ids):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} must be in [0, len(token_ids)="
                f"{len(token_ids)}]"
            )
        capacity = len(seq.block_ids) * self._block_size
        if num_computed_tokens > capacity:
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} exceeds the {capacity} slots of "
                f"seq_id {seq_id!r}'s blocks"
            )
        if not self.enable_prefix_caching or seq.unpublishable:
            return
        bs = self._block_size
        num_full = num_computed_tokens // bs
        first = len(seq.block_hashes)
        if num_full <= first:
            return
        tokens = _as_token_array("token_ids", token_ids[first * bs : num_full * bs])
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_PARENT_HASH
        digest = seq.block_digests[-1] if seq.block_digests else ROOT_DIGEST
        for i in range(first, num_full):
            block_tokens = tokens[(i - first) * bs : (i - first + 1) * bs]
            block_hash = hash_block_tokens(parent, block_tokens)
            digest = _prefix_digest(digest, block_tokens.astype("<i8").tobytes())
            seq.block_hashes.append(block_hash)
            seq.block_digests.append(digest)
            if block_hash not in self._hash_to_block:
                block_id = seq.block_ids[i]
                self._hash_to_block[block_hash] = block_id
                self._block_hash[block_id] = block_hash
                self._block_key[block_id] = (parent, tuple(block_tokens.tolist()), digest)
            parent = block_hash

    # ---------------------------------------------------------------- bulk forms for the engine's steps

    def append_block_each(self, seq_ids: Sequence[Hashable]) -> list[int]:
        """Give each sequence one more block, in order, while free blocks last.

        The bulk form of ``append_slots`` for a decode step, where each sequence whose next token
        starts a new block needs exactly one more. Returns the new block ids, ``result[i]`` going
        to ``seq_ids[i]``; shorter than ``seq_ids`` when the pool ran dry (the sequences after that
        got nothing). An unknown or repeated seq_id raises ValueError before anything changes.
        """
        seqs = self._get_distinct_seqs(seq_ids)
        free, block_hashes, ref_counts = self._free, self._block_hash, self._ref_counts
        new_block_ids = []
        for seq in seqs[: len(free)]:  # _take_free_block, inlined: this runs every decode step
            block_id, _ = free.popitem(last=False)
            old_hash = block_hashes[block_id]
            if old_hash is not None:  # its old content leaves the index
                del self._hash_to_block[old_hash]
                block_hashes[block_id] = None
                self._block_key[block_id] = None
            ref_counts[block_id] = 1
            seq.block_ids.append(block_id)
            new_block_ids.append(block_id)
        return new_block_ids

    def publish_blocks(
        self, seq_ids: Sequence[Hashable], block_indices: Sequence[int], block_token_ids: np.ndarray
    ) -> None:
        """Publish many full blocks of many sequences in one call (the bulk form of ``publish``).

        Args:
            seq_ids: int [N] or any hashables, the sequence of each block; a sequence may repeat.
            block_indices: int [N], which block of its sequence each one is. A sequence's blocks
                come in order, the first being its first block not yet published.
            block_token_ids: int [N, block_size], the tokens of those blocks (whose KV is computed).

        Same effect as ``publish(seq_ids[i], tokens, (block_indices[i] + 1) * block_size)`` for each
        i in order. Raises ValueError (nothing changed) for a bad shape or a block out of order. With
        prefix caching off nothing is published, so the order is not checked (no block is ever next);
        likewise for the blocks of a sequence held through ``reset_prefix_cache(keep_held=True)``.
        """
        bs = self._block_size
        array = np.asarray(block_token_ids)
        if array.shape != (len(seq_ids), bs) or len(block_indices) != len(seq_ids):
            raise ValueError(
                f"block_token_ids must be [{len(seq_ids)}, {bs}] and block_indices [{len(seq_ids)}] for "
                f"{len(seq_ids)} seq_ids, got {array.shape} and {len(block_indices)}"
            )
        if array.size and array.dtype.kind not in "iu":
            raise TypeError(f"block_token_ids must hold integers, got dtype {array.dtype}")
        try:
            seqs = [self._seqs[seq_id] for seq_id in seq_ids]
        except KeyError as e:
            raise ValueError(f"seq_id {e.args[0]!r} has no blocks allocated") from None
        if not self.enable_prefix_caching:
            return  # nothing is ever published (as in ``publish``)
        kept = [k for k, seq in enumerate(seqs) if not seq.unpublishable]
        if len(kept) < len(seqs):  # (sequences held through a reset publish nothing)
            seq_ids, seqs, block_indices = ([x[k] for k in kept] for x in (seq_ids, seqs, block_indices))
            array = array[kept]
        indices = [int(i) for i in block_indices]
        next_index: dict[Hashable, int] = {}
        for seq_id, seq, index in zip(seq_ids, seqs, indices):
            expected = next_index.get(seq_id, len(seq.block_hashes))
            if index != expected or index >= len(seq.block_ids):
                raise ValueError(
                    f"block {index} of seq_id {seq_id!r} is out of order: its next block to publish is "
                    f"{expected} of {len(seq.block_ids)}"
                )
            next_index[seq_id] = index + 1
        # hash_block_tokens's bytes, laid out once for all blocks: the parent hash as 8 little-endian
        # bytes, then the block's tokens as little-endian int64.
        token_bytes = array.astype("<i8").tobytes()
        row_bytes = 8 * bs
        for k, (seq, index, token_list) in enumerate(zip(seqs, indices, array.tolist())):
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_PARENT_HASH
            block_bytes = token_bytes[k * row_bytes : (k + 1) * row_bytes]
            block_hash = xxhash.xxh64_intdigest(parent.to_bytes(8, "little") + block_bytes)
            digest = _prefix_digest(seq.block_digests[-1] if seq.block_digests else ROOT_DIGEST, block_bytes)
            seq.block_hashes.append(block_hash)
            seq.block_digests.append(digest)
            if block_hash not in self._hash_to_block:
                block_id = seq.block_ids[index]
                self._hash_to_block[block_hash] = block_id
                self._block_hash[block_id] = block_hash
                self._block_key[block_id] = (parent, tuple(token_list), digest)

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks, tail first; hashed ones stay reusable until reused."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"seq_id {seq_id!r} has no blocks allocated")
        for block_id in reversed(seq.block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self._block_hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self, *, keep_held: bool = False) -> bool:
        """Forget every published block, so that no later ``allocate`` is served from the cache.

        For RL loops that update the model's weights between generations (the KV in the pool was
        computed with the old weights) and for benchmarks. Returns True once done. While any
        sequence holds blocks it returns False and changes nothing (vLLM's rule: its block pool
        refuses while blocks other than its null block are in use); free the sequences first.
        ``keep_held=True`` resets anyway (an update while requests run on): the sequences that hold
        blocks keep them, and publish nothing from now on, since their KV mixes the two weight sets.
        Free blocks stay free, in the same hand-out order; ``stats`` are counters since
        construction and are not reset (``reset_stats`` does that).
        """
        num_used = self._num_blocks - len(self._free)
        if keep_held:
            for seq in self._seqs.values():
                seq.unpublishable = True
        elif num_used:
            logger.warning("prefix cache not reset: %d blocks are still held by %d sequences", num_used,
                           len(self._seqs))
            return False
        self._hash_to_block.clear()
        self._block_hash = [None] * self._num_blocks
        self._block_key = [None] * self._num_blocks
        return True

    # ---------------------------------------------------------------- internals

    def _get_seq(self, seq_id: Hashable) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"seq_id {seq_id!r} has no blocks allocated")
        return seq

    def _get_distinct_seqs(self, seq_ids: Sequence[Hashable]) -> list[_SeqBlocks]:
        """The sequences named by ``seq_ids``; ValueError for an unknown or repeated one."""
        try:
            seqs = [self._seqs[seq_id] for seq_id in seq_ids]
        except KeyError as e:
            raise ValueError(f"seq_id {e.args[0]!r} has no blocks allocated") from None
        if len(set(seq_ids)) != len(seqs):
            raise ValueError("seq_ids must not repeat a sequence")
        return seqs

    def _take_free_block(self) -> int:
        """Pop the head of the free list; its old content (if any) leaves the index."""
        block_id, _ = self._free.popitem(last=False)
        old_hash = self._block_hash[block_id]
        if old_hash is not None:
            del self._hash_to_block[old_hash]
            self._block_hash[block_id] = None
            self._block_key[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id

    # ---------------------------------------------------------------- checking

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (for tests and debugging)."""
        n = self._num_blocks
        references = [0] * n
        for seq_id, seq in self._seqs.items():
            ids = seq.block_ids
            assert all(0 <= b < n for b in ids), f"seq {seq_id!r}: block id out of range in {ids}"
            assert len(set(ids)) == len(ids), f"seq {seq_id!r}: a block appears twice in {ids}"
            assert len(seq.block_hashes) <= len(ids), (
                f"seq {seq_id!r}: {len(seq.block_hashes)} known hashes for {len(ids)} blocks"
            )
            for i, block_id in enumerate(ids):
                references[block_id] += 1
                stored = self._block_hash[block_id]
                if i < len(seq.block_hashes) and stored is not None:
                    assert stored == seq.block_hashes[i], (
                        f"seq {seq_id!r}: block {block_id} at index {i} holds hash {stored}, "
                        f"the sequence's chain says {seq.block_hashes[i]}"
                    )
        for block_id in range(n):
            assert self._ref_counts[block_id] == references[block_id], (
                f"block {block_id}: ref count {self._ref_counts[block_id]} but "
                f"{references[block_id]} block-table references"
            )
            is_free = block_id in self._free
            assert is_free == (references[block_id] == 0), (
                f"block {block_id}: in free list={is_free} with ref count {references[block_id]}"
            )
        assert len(self._free) + sum(1 for r in references if r > 0) == n, "free ∪ used != all blocks"
        for block_hash, block_id in self._hash_to_block.items():
            assert self._block_hash[block_id] == block_hash, (
                f"index maps hash {block_hash} to block {block_id}, which holds "
                f"{self._block_hash[block_id]}"
            )
            key = self._block_key[block_id]
            assert key is not None and hash_block_tokens(key[0], key[1]) == block_hash, (
                f"block {block_id}: stored parent/tokens do not hash to {block_hash}"
            )
        for block_id in range(n):
            stored = self._block_hash[block_id]
            assert (stored is None) == (self._block_key[block_id] is None), (
                f"block {block_id}: hash and stored tokens disagree on being set"
            )
            assert stored is None or self._hash_to_block.get(stored) == block_id, (
                f"block {block_id} holds hash {stored} that the index does not map to it"
            )
