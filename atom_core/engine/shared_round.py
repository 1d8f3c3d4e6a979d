"""One round of ``DataParallelEngine.load_weights`` through one shared-memory file: the front writes the round's
tensors into a new file once (``write_round``), every replica maps that file and takes its tensors as views into
the mapping (``read_round``); the small pickled ``WEIGHTS`` message carries only the file's path and each tensor's
``(name, dtype, shape, byte offset)`` (``engine/dp_replica.py``'s module docstring).

The file lives in ``SHARED_DIR``: /dev/shm (a RAM-backed tmpfs, so the replicas map the very pages the front
wrote: no copy and no socket), or the temporary directory where there is no /dev/shm; a round that does not fit
there (a container's /dev/shm is often 64 MB, a round up to ``weight_sync.BATCH_BYTES`` or one larger tensor)
is written to the temporary directory instead. Bytes are copied as they are (each tensor viewed as uint8), so
every dtype crosses bit-exact, bfloat16 and float8 included; each tensor starts at a multiple of ``ALIGN``
bytes, so a view of the bytes as any dtype is aligned.

The front removes the file (``remove_round``) once every replica has answered the round, and on every failure:
a replica's mapping, and the views into it, outlive the file's name. Each round gets a new file, so a tensor a
replica still holds from an earlier round never changes under it.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Sequence

import torch

__all__ = ["ALIGN", "SHARED_DIR", "read_round", "remove_round", "write_round"]

SHARED_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
ALIGN = 64  # each tensor's byte offset is a multiple of this (>= any element size: the views are aligned)
_PREFIX = "atom_core-weights-"
_WRITE_CHUNK = 1 << 30  # bytes per pwrite (Linux writes at most 2 GiB - 4 KiB in one call)


def _layout(batch: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.dtype, tuple, int]], int]:
    """Each tensor's ``(name, dtype, shape, byte offset)`` in the file, and the file's size in bytes."""
    tensors, end = [], 0
    for name, tensor in batch:
        offset = -(-end // ALIGN) * ALIGN
        tensors.append((name, tensor.dtype, tuple(tensor.shape), offset))
        end = offset + tensor.numel() * tensor.element_size()
    return tensors, end


def _write_at(fd: int, tensor: torch.Tensor, offset: int) -> None:
    """Write ``tensor``'s bytes (a CPU tensor, any dtype) into file ``fd`` at ``offset``."""
    data = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:done + _WRITE_CHUNK], offset + done)


def write_round(batch: Sequence[tuple[str, torch.Tensor]]) -> dict:
    """Write ``batch``'s ``(name, CPU tensor)`` pairs into a new file of ``SHARED_DIR`` (the temporary directory
    if that one cannot take it) and return the round's message: ``{"file": its path, "nbytes": its size,
    "tensors": [(name, dtype, shape, byte offset)]}``. The caller removes the file (``remove_round``); a write
    that fails leaves no file and raises OSError naming the directories tried."""
    tensors, nbytes = _layout(batch)
    directories = list(dict.fromkeys([SHARED_DIR, tempfile.gettempdir()]))
    failures = []
    for directory in directories:
        try:
            fd, path = tempfile.mkstemp(prefix=_PREFIX, dir=directory)
        except OSError as error:
            failures.append(f"{directory}: {error.strerror or error}")
            continue
        written = False
        try:
            os.ftruncate(fd, nbytes)  # (the gaps between tensors read as zeros)
            for (_, _, _, offset), (_, tensor) in zip(tensors, batch):
                _write_at(fd, tensor, offset)
            written = True
        except OSError as error:  # no room there (ENOSPC), say: the next directory
            failures.append(f"{directory}: {error.strerror or error}")
        finally:
            os.close(fd)
            if not written:  # (an interrupt included)
                os.unlink(path)
        if written:
            return {"file": path, "nbytes": nbytes, "tensors": tensors}
    raise OSError(f"could not write a round of new weights ({nbytes} bytes) to a shared file: {'; '.join(failures)}")


def read_round(message: dict) -> list[tuple[str, torch.Tensor]]:
    """The round's ``(name, tensor)`` pairs (``write_round``'s message), each tensor a view of its dtype and shape
    into the file mapped privately (``MAP_PRIVATE`` of a read-only descriptor: the file is never written, and
    nothing is copied until written to). The mapping lives as long as a view does."""
    nbytes = message["nbytes"]
    data = torch.empty(0, dtype=torch.uint8)
    if nbytes:  # (a round of empty tensors only has an empty file: nothing to map)
        data.set_(torch.UntypedStorage.from_file(message["file"], shared=False, nbytes=nbytes))
    pairs = []
    for name, dtype, shape, offset in message["tensors"]:
        size = math.prod(shape) * dtype.itemsize
        pairs.append((name, data[offset:offset + size].view(dtype).view(shape)))
    return pairs


def remove_round(message: dict) -> None:
    """Remove the round's file (its name: mappings of it stay valid)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(message["file"])
