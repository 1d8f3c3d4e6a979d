"""A checkpoint folder's ``*.safetensors`` shards: which files (the index, or every shard), each checked to
stay inside the folder (or, for a Hugging Face cache snapshot, inside its cache repository), each header
checked against its file before any tensor is read, and tensors read with errors that name the file.
``loader.load_weights`` maps what these read into a model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
_HF_CACHE_REPO_PREFIX = "models--"  # huggingface_hub's cache: <cache>/models--org--name/{snapshots,blobs}
# Bits per element of each safetensors dtype (the format's own list); sub-byte types are not size-checked.
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
# The torch dtype safetensors reads each header dtype as (the sub-byte types have none).
TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
    "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32, "I64": torch.int64,
    "U64": torch.uint64, "F64": torch.float64, "C64": torch.complex64,
}


def tensor_source(file: Path | None, short: bool = False) -> str:
    """Where a tensor came from, for messages: ``in <shard>`` (its name only when ``short``), or, for
    ``load_named_tensors`` (``file`` None), ``given to load_named_tensors``."""
    if file is None:
        return "given to load_named_tensors"
    return f"in {file.name if short else file}"


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """Tensor entries of a ``.safetensors`` file's JSON header (name -> {dtype, shape, data_offsets}).

    Reads only the 8-byte length and the header, never the tensor data, and checks the header
    against the file: known dtypes, shapes of ints >= 0, ``data_offsets`` that hold exactly
    ``numel x element size`` bytes, follow each other without gap or overlap and end where the
    file does. ValueError naming the file (and tensor) otherwise: a truncated or corrupt file.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        n = int.from_bytes(head, "little")
        size = os.fstat(f.fileno()).st_size
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"{path}: corrupt safetensors header (length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    _check_header_entries(path, header, data_bytes=size - 8 - n)
    return header


def _check_header_entries(path: Path, header: dict, data_bytes: int) -> None:
    """The rules safetensors applies on opening, checked here so that the error names the file."""
    spans = []
    for name, entry in header.items():
        ok = (isinstance(entry, dict) and entry.get("dtype") in _DTYPE_BITS
              and isinstance(entry.get("shape"), list)
              and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in entry["shape"])
              and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) for x in entry["data_offsets"]))
        if not ok:
            raise ValueError(f"{path}: corrupt safetensors header: bad entry for tensor {name!r}: {entry!r}")
        begin, end = entry["data_offsets"]
        bits = _DTYPE_BITS[entry["dtype"]]
        numel = math.prod(entry["shape"])
        if begin > end or (bits % 8 == 0 and end - begin != numel * bits // 8):
            raise ValueError(f"{path}: corrupt safetensors header: tensor {name!r} ({entry['dtype']} "
                             f"{entry['shape']}) has data_offsets {entry['data_offsets']}")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise ValueError(f"{path}: corrupt safetensors header: tensor {name!r} starts at byte {begin} of the "
                             f"data, the previous tensor ends at {position}")
        position = end
    if position > data_bytes:
        raise ValueError(f"{path}: truncated: its header places tensor data up to byte {position} after the "
                         f"header, but the file holds only {data_bytes} bytes there")
    if position < data_bytes:
        raise ValueError(f"{path}: corrupt safetensors file: {data_bytes - position} bytes after the last "
                         "tensor's data")


def _link_root(folder: Path) -> Path:
    """Where the shards of ``folder`` may resolve to: the folder itself, or, for a Hugging Face
    cache snapshot (``models--org--name/snapshots/<rev>``), the whole cache repository, whose
    ``blobs/`` holds the files the snapshot's links point at."""
    root = folder.resolve()
    repo = root.parent.parent
    if root.parent.name == "snapshots" and repo.name.startswith(_HF_CACHE_REPO_PREFIX):
        return repo
    return root


def _inside(folder: Path, file_name: str) -> Path:
    """``folder / file_name`` after refusing names that leave the folder (absolute, ``..``) and links
    whose target leaves it (or, for a cache snapshot, leaves its cache repository; see ``_link_root``)."""
    if not isinstance(file_name, str) or not file_name:
        raise ValueError(f"{INDEX_FILE}: bad file entry {file_name!r}")
    if os.path.isabs(file_name):
        raise ValueError(f"{INDEX_FILE}: refusing absolute shard path {file_name!r}")
    path = Path(os.path.normpath(folder / file_name))
    if os.path.normpath(file_name).split(os.sep)[0] == os.pardir:
        raise ValueError(f"{INDEX_FILE}: refusing shard path {file_name!r} that resolves outside {folder}")
    root = _link_root(folder)
    resolved = path.resolve()
    if resolved != root and root not in resolved.parents:
        raise ValueError(f"{INDEX_FILE}: refusing shard path {file_name!r} that resolves outside {root} "
                         f"(to {resolved})")
    return path


def checkpoint_files(folder: str | Path) -> dict[Path, list[str] | None]:
    """Shard files of a checkpoint folder -> tensor names the index assigns to them.

    With ``model.safetensors.index.json``: the files its ``weight_map`` names (each checked to
    lie inside the folder, see ``_inside``), as paths inside the folder, with their names; a
    tensor listed twice keeps its first entry. Without an index: every ``*.safetensors`` file in
    the folder, sorted, with ``None`` (names come from the headers).
    """
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {folder}")
        return {f: None for f in files}

    def first_wins(pairs: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                logger.warning("%s: duplicate entry %r ignored", index_path, key)
                continue
            out[key] = value
        return out

    try:
        index = json.loads(index_path.read_text(), object_pairs_hook=first_wins)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{index_path}: not valid JSON ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path}: no 'weight_map' object")
    files: dict[Path, list[str]] = {}
    for name, file_name in weight_map.items():
        path = _inside(folder, file_name)
        files.setdefault(path, []).append(name)
    for path in files:
        if not path.is_file():
            broken = f" (a link to {path.resolve()}, which is missing)" if path.is_symlink() else ""
            raise FileNotFoundError(f"{index_path} names {path.name}, which does not exist{broken}")
    return files


@contextlib.contextmanager
def open_shard(path: Path):
    """``safe_open`` of a shard, its errors re-raised as ValueError naming the file."""
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: cannot open as safetensors ({e})") from e
    with handle as f:
        yield f


def get_tensor(f, name: str, path: Path) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: cannot read tensor {name!r} ({e})") from e


def read_tensor(open_file, open_path: Path | None, name: str, path: Path) -> torch.Tensor:
    """Tensor ``name`` from ``path``: from the already open ``open_file`` when that is the same file."""
    if path == open_path:
        return get_tensor(open_file, name, path)
    with open_shard(path) as f:
        return get_tensor(f, name, path)
