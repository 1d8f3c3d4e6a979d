"""KV-pool sizing: how many blocks a byte budget buys. Pure arithmetic, no allocation.

The pool has two parts:

* the paged KV pool, per attention layer one K and one V tensor of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` (MHA/GQA), or one latent tensor of
  shape ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (MLA: the compressed
  KV row and the decoupled RoPE key, no separate V);
* a fixed number of per-request state entries (e.g. the recurrent state of linear-attention
  layers), ``max_num_seqs * state_entries_per_req`` entries of ``state_bytes_per_entry`` bytes.

The state is reserved first; the paged pool gets what remains of the budget.

Also here, for every layer that sizes host allocations before making them: the host memory
available now (``host_memory_available_bytes``) and the error an estimate larger than it
raises (``check_fits_in_memory`` -> ``InsufficientMemoryError``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "InsufficientMemoryError",
    "KVCacheSpec",
    "PoolPlan",
    "budget_for_instance",
    "budget_from_memory",
    "check_fits_in_memory",
    "host_memory_available_bytes",
    "plan_kv_pool",
]

GIB = 1 << 30
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: memory.max / memory.current of this container


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token costs in the KV pool, and what one request costs in state.

    Fields:
        num_layers: layers with a paged KV cache (>= 1).
        num_kv_heads, head_dim: per layer, K and V each hold ``num_kv_heads * head_dim``
            elements per token. For MLA, ``num_kv_heads == 1`` and
            ``head_dim == kv_lora_rank + qk_rope_head_dim`` (one latent row); use ``mla()``.
        dtype: element type of the pool; bytes per element = ``dtype.itemsize``
            (float8_e4m3fn: 1, bfloat16: 2, float32: 4).
        kv_lora_rank, qk_rope_head_dim: set both for MLA (one row per token, no V).
        state_bytes_per_entry, state_entries_per_req: per-request fixed-size state; both 0
            (none) or both positive.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    state_bytes_per_entry: int = 0
    state_entries_per_req: int = 0

    def __post_init__(self) -> None:
        _check_int("num_layers", self.num_layers, 1)
        _check_int("num_kv_heads", self.num_kv_heads, 1)
        _check_int("head_dim", self.head_dim, 1)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(
                "kv_lora_rank and qk_rope_head_dim must be given together (MLA) or not at all, "
                f"got kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}"
            )
        if self.is_mla:
            _check_int("kv_lora_rank", self.kv_lora_rank, 1)
            _check_int("qk_rope_head_dim", self.qk_rope_head_dim, 0)
            row = self.kv_lora_rank + self.qk_rope_head_dim
            if self.num_kv_heads != 1 or self.head_dim != row:
                raise ValueError(
                    "an MLA spec stores one latent row per token: num_kv_heads must be 1 and "
                    f"head_dim must be kv_lora_rank + qk_rope_head_dim = {row}, got "
                    f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
                )
        _check_int("state_bytes_per_entry", self.state_bytes_per_entry, 0)
        _check_int("state_entries_per_req", self.state_entries_per_req, 0)
        if (self.state_bytes_per_entry == 0) != (self.state_entries_per_req == 0):
            raise ValueError(
                "state_bytes_per_entry and state_entries_per_req must both be 0 or both positive, "
                f"got {self.state_bytes_per_entry} and {self.state_entries_per_req}"
            )

    @classmethod
    def mla(
        cls,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        **state: int,
    ) -> KVCacheSpec:
        """An MLA spec: one latent row of ``kv_lora_rank + qk_rope_head_dim`` per token per layer."""
        return cls(
            num_layers=num_layers,
            num_kv_heads=1,
            head_dim=kv_lora_rank + qk_rope_head_dim,
            dtype=dtype,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            **state,
        )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_kv_tensors_per_layer(self) -> int:
        """2 (K and V) for MHA/GQA, 1 (the latent row) for MLA."""
        return 1 if self.is_mla else 2

    @property
    def bytes_per_token(self) -> int:
        """num_layers × tensors per layer × num_kv_heads × head_dim × dtype bytes."""
        return (
            self.num_layers
            * self.num_kv_tensors_per_layer
            * self.num_kv_heads
            * self.head_dim
            * self.dtype.itemsize
        )

    def bytes_per_block(self, block_size: int) -> int:
        _check_int("block_size", block_size, 1)
        return block_size * self.bytes_per_token

    @property
    def state_bytes_per_req(self) -> int:
        return self.state_entries_per_req * self.state_bytes_per_entry

    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's K (and V) tensor, or of its MLA latent tensor."""
        if self.is_mla:
            return (num_blocks, block_size, self.head_dim)
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class PoolPlan:
    """The pool a budget buys.

    ``kv_shape`` is the shape of each per-layer tensor: K and V each for MHA/GQA
    (``[num_blocks, block_size, num_kv_heads, head_dim]``), the single latent tensor for MLA
    (``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``).
    ``kv_bytes = num_blocks * bytes_per_block``; ``state_bytes = state_entries * bytes per entry``;
    ``total_bytes = kv_bytes + state_bytes``.
    """

    num_blocks: int
    block_size: int
    bytes_per_token: int
    bytes_per_block: int
    kv_bytes: int
    state_entries: int
    state_bytes: int
    total_bytes: int
    kv_shape: tuple[int, ...]


def plan_kv_pool(
    spec: KVCacheSpec,
    *,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    budget_bytes: int | None = None,
    num_blocks: int | None = None,
) -> PoolPlan:
    """Size the pool from a byte budget or an explicit block count (exactly one of them).

    With ``budget_bytes``: state is reserved first (``max_num_seqs * state_entries_per_req``
    entries), then ``num_blocks = (budget_bytes - state_bytes) // bytes_per_block``.

    Raises ValueError when the result cannot hold the state plus one request of
    ``max_model_len`` tokens (``ceil(max_model_len / block_size)`` blocks); the message gives
    the numbers and the smallest budget that would work.
    """
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
    _check_int("block_size", block_size, 1)
    _check_int("max_num_seqs", max_num_seqs, 1)
    _check_int("max_model_len", max_model_len, 1)
    if (budget_bytes is None) == (num_blocks is None):
        raise ValueError(
            "give exactly one of budget_bytes and num_blocks, got "
            f"budget_bytes={budget_bytes}, num_blocks={num_blocks}"
        )

    bytes_per_block = spec.bytes_per_block(block_size)
    state_entries = max_num_seqs * spec.state_entries_per_req
    state_bytes = state_entries * spec.state_bytes_per_entry
    blocks_needed = _ceil_div(max_model_len, block_size)
    smallest_budget = state_bytes + blocks_needed * bytes_per_block

    if budget_bytes is not None:
        _check_int("budget_bytes", budget_bytes, 0)
        if budget_bytes < smallest_budget:
            raise ValueError(
                f"budget_bytes={budget_bytes} is too small: the per-request state needs "
                f"{state_bytes} bytes ({max_num_seqs} seqs x {spec.state_entries_per_req} entries "
                f"x {spec.state_bytes_per_entry} bytes), and one request of max_model_len="
                f"{max_model_len} needs {blocks_needed} blocks x {bytes_per_block} bytes per block "
                f"= {blocks_needed * bytes_per_block} bytes; the smallest budget that works is "
                f"{smallest_budget} bytes"
            )
        num_blocks = (budget_bytes - state_bytes) // bytes_per_block
    else:
        _check_int("num_blocks", num_blocks, 1)
        if num_blocks < blocks_needed:
            raise ValueError(
                f"num_blocks={num_blocks} cannot hold one request of max_model_len={max_model_len}: "
                f"it needs {blocks_needed} blocks of {block_size} tokens ({bytes_per_block} bytes "
                f"per block); with the state ({state_bytes} bytes) the smallest budget that works "
                f"is {smallest_budget} bytes"
            )

    kv_bytes = num_blocks * bytes_per_block
    return PoolPlan(
        num_blocks=num_blocks,
        block_size=block_size,
        bytes_per_token=spec.bytes_per_token,
        bytes_per_block=bytes_per_block,
        kv_bytes=kv_bytes,
        state_entries=state_entries,
        state_bytes=state_bytes,
        total_bytes=kv_bytes + state_bytes,
        kv_shape=spec.kv_shape(num_blocks, block_size),
    )


def budget_from_memory(total_bytes: int, used_bytes: int, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV pool: ``floor(total_bytes * gpu_memory_utilization) - used_bytes``.

    ``total_bytes``: device memory; ``used_bytes``: already taken (weights, peak activations,
    other processes) when measured; ``gpu_memory_utilization`` in (0, 1]: the share of the
    device the process may use in all. Raises ValueError when nothing is left.
    """
    _check_int("total_bytes", total_bytes, 1)
    _check_int("used_bytes", used_bytes, 0)
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)):
        raise TypeError(
            f"gpu_memory_utilization must be a float, got {type(gpu_memory_utilization).__name__}"
        )
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    allowed = int(total_bytes * gpu_memory_utilization)
    budget = allowed - used_bytes
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV pool: gpu_memory_utilization={gpu_memory_utilization} of "
            f"total_bytes={total_bytes} allows {allowed} bytes, but used_bytes={used_bytes} are "
            "already in use; raise gpu_memory_utilization or use less memory elsewhere"
        )
    return budget


def budget_for_instance(total_bytes: int, free_bytes: int, own_bytes: int, activation_bytes: int,
                        gpu_memory_utilization: float) -> int:
    """Bytes for one engine's KV pool by vLLM V1's rule: ``gpu_memory_utilization`` is this engine's share
    of the device, whatever else holds memory there (a trainer in the same process, another engine):
    ``floor(total_bytes * gpu_memory_utilization) - own_bytes - activation_bytes``, where ``own_bytes`` is
    what this engine already holds (its weights) and ``activation_bytes`` one step's activations.

    ``free_bytes``: device memory free now (after the weights were loaded). Raises ValueError, with the
    numbers, when that share is not free (vLLM refuses to start then too: its pool would take memory
    someone else counts on), or when the share leaves nothing for the pool.
    """
    _check_int("free_bytes", free_bytes, 0)
    _check_int("own_bytes", own_bytes, 0)
    _check_int("activation_bytes", activation_bytes, 0)
    budget = budget_from_memory(total_bytes, own_bytes + activation_bytes, gpu_memory_utilization)
    if budget + activation_bytes > free_bytes:
        gib = 2 ** 30
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} gives this engine {total_bytes * gpu_memory_utilization / gib:.2f} "
            f"GiB of the device's {total_bytes / gib:.2f} GiB, of which its weights hold {own_bytes / gib:.2f} and a "
            f"step's activations need {activation_bytes / gib:.2f}, but only {free_bytes / gib:.2f} GiB are free "
            f"(other processes or tensors hold {(total_bytes - free_bytes - own_bytes) / gib:.2f} GiB): lower "
            "gpu_memory_utilization, or free memory elsewhere"
        )
    return budget


class InsufficientMemoryError(MemoryError, ValueError):
    """An allocation was refused before it was made: its estimated bytes exceed the memory available.

    A ``MemoryError`` (it is about memory) and a ``ValueError`` (the size asked for is what is wrong).
    """


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup's "max" (no limit) reads as None


def host_memory_available_bytes() -> int | None:
    """Host memory a new allocation can take now, in bytes; None when this OS does not say.

    ``MemAvailable`` of ``/proc/meminfo`` (free memory plus the page cache the kernel can drop),
    else total physical memory (``SC_PAGE_SIZE * SC_PHYS_PAGES``); capped by the cgroup v2 limit
    of this container (``memory.max - memory.current``) where one is set.
    """
    available = None
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the file says kB (KiB)
                break
    except (OSError, ValueError, IndexError):
        available = None
    if available is None:
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            available = None
        if available is not None and available <= 0:
            available = None
    limit, used = _read_int(_CGROUP / "memory.max"), _read_int(_CGROUP / "memory.current")
    if limit is not None and used is not None:
        left = max(limit - used, 0)
        available = left if available is None else min(available, left)
    return available


def check_fits_in_memory(what: str, needed_bytes: int, available_bytes: int | None, *, where: str,
                         detail: str = "", hint: str = "") -> None:
    """Raise ``InsufficientMemoryError`` when ``needed_bytes`` exceeds ``available_bytes`` (None: unknown, pass).

    The message names ``what``, gives the estimate and the memory available in GiB, ``where`` that
    memory is ("host memory", "cuda:0"), how the estimate was made (``detail``) and what to change (``hint``).
    """
    if available_bytes is None or needed_bytes <= available_bytes:
        return
    how = f" ({detail})" if detail else ""
    fix = f"; {hint}" if hint else ""
    raise InsufficientMemoryError(
        f"{what} needs an estimated {needed_bytes / GIB:.2f} GiB{how}, more than the "
        f"{available_bytes / GIB:.2f} GiB of {where} available{fix}"
    )
