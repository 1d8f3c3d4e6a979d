"""Which backends the selftest verified on this machine: the record, read once, and auto's rule.

``python -m atom_core.ops.selftest`` runs every op of every available backend against the twins and
writes the results here, one entry per device name and library versions (:func:`record_key`):

    {"format": 1, "entries": {"<key>": {"key": {"device": ..., "torch": ..., "triton": ..., "aiter": ...},
                                        "written": "<UTC time>",
                                        "results": {"<op>": {"<backend>": {"passed": bool, "cases": int,
                                                                           "refused": int, "failures": [str]}}}}}}

at ``$ATOM_CORE_SELFTEST_PATH``, else ``$XDG_CACHE_HOME/atom_core/selftest.json``, else
``~/.cache/atom_core/selftest.json``.

The rule ``auto`` follows (:func:`auto_may_choose`; a backend named by ``backend=``, ``use_backend``
or ``ATOM_CORE_BACKEND`` is not subject to it):

* ``aiter`` only where the entry for the call's device and these versions says it passed for the
  op: the adapters have run only against a stand-in of AITER's signatures, never on an AMD GPU;
* ``triton`` unless that entry says it failed for the op: the project's own kernels, tested on
  GPUs and under the CPU interpreter, stay the default where no selftest has run;
* ``torch`` always.

The file is read on first use and cached; :func:`reload` (also called by :func:`write_results`)
reads it again and clears every op's cached backend choice, so a selftest run in this process
takes effect at once.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import warnings
from pathlib import Path

import torch

PATH_ENV_VAR = "ATOM_CORE_SELFTEST_PATH"
FORMAT = 1
NEEDS_PASSING_RECORD = ("aiter",)  # chosen by auto only where the selftest passed

_entries: dict | None = None  # the record's entries, read once (None: not read yet)


def record_path() -> Path:
    """Where the record lives (the environment is read on each call: tests point it elsewhere)."""
    override = os.environ.get(PATH_ENV_VAR)
    if override:
        return Path(override)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "atom_core" / "selftest.json"


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def library_versions() -> dict[str, str | None]:
    """torch, triton and aiter versions (None where not installed), from package metadata: no import."""
    return {"torch": torch.__version__,
            "triton": _distribution_version("triton", "pytorch-triton-rocm", "pytorch-triton"),
            "aiter": _distribution_version("amd-aiter", "aiter")}


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The GPU's marketing name (``torch.cuda.get_device_name``), or the device type for CPU and meta."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index if device.index is not None else torch.cuda.current_device())
    return device.type


def record_key(device: torch.device) -> dict[str, str | None]:
    """What an entry is keyed by: the device's name and the library versions."""
    return {"device": device_name(torch.device(device)), **library_versions()}


def key_string(key: dict) -> str:
    """The record's dict key for an entry keyed by ``key`` (see :func:`record_key`)."""
    return json.dumps(key, sort_keys=True)


def read_record(path: Path | None = None) -> dict:
    """The whole record file as a dict (an empty record when it is missing or unreadable)."""
    path = record_path() if path is None else Path(path)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return {"format": FORMAT, "entries": {}}
    except (OSError, ValueError) as error:
        warnings.warn(f"atom_core selftest record {path} is unreadable ({error}); treating it as empty",
                      stacklevel=2)
        return {"format": FORMAT, "entries": {}}
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("entries"), dict):
        warnings.warn(f"atom_core selftest record {path} has an unknown format; treating it as empty", stacklevel=2)
        return {"format": FORMAT, "entries": {}}
    return record


def verdict(op_name: str, backend: str, device: torch.device) -> bool | None:
    """Whether the record says ``backend`` passed ``op_name`` on this device and these versions
    (None: no result for it)."""
    global _entries
    if _entries is None:
        _entries = read_record()["entries"]
    entry = _entries.get(key_string(record_key(device)))
    result = None if entry is None else entry.get("results", {}).get(op_name, {}).get(backend)
    return None if result is None else bool(result.get("passed"))


def auto_may_choose(op_name: str, backend: str, device: torch.device | None) -> bool:
    """The rule in the module docstring: may ``auto`` choose ``backend`` for this op on ``device``?"""
    if backend == "torch" or device is None:
        return backend not in NEEDS_PASSING_RECORD
    result = verdict(op_name, backend, device)
    return result is True if backend in NEEDS_PASSING_RECORD else result is not False


def reload() -> None:
    """Forget the record read so far and every op's cached choice (both are read again on next use)."""
    global _entries
    _entries = None
    from atom_core.ops import dispatch  # here, not at the top: dispatch imports this module

    dispatch.clear_choices()


def write_results(device: torch.device, results: dict[str, dict[str, dict]], path: Path | None = None) -> Path:
    """Merge ``results`` ({op: {backend: result}}) into the entry for ``device`` and these versions,
    write the record (atomically) and :func:`reload`. Other entries, ops and backends are kept."""
    path = record_path() if path is None else Path(path)
    record = read_record(path)
    key = record_key(device)
    entry = record["entries"].setdefault(key_string(key), {"key": key, "results": {}})
    for op_name, by_backend in results.items():
        entry["results"].setdefault(op_name, {}).update(by_backend)
    entry["written"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(partial, path)
    reload()
    return path
