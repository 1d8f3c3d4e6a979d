"""Render a benchmark's JSON rows as a Markdown table: python -m benchmarks.to_markdown FILE [COLUMN ...].

Reads both result forms: ``{"meta": {...}, "rows": [...]}`` (``benchmarks.common.write_json``), whose
meta becomes a one-line caption under the table, and the older bare list of rows (no caption).
"""

from __future__ import annotations

import json
from pathlib import Path


def load_result(path) -> tuple[dict | None, list[dict]]:
    """``(meta, rows)`` of a result file; ``meta`` is None for the older bare-list form."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return None, data
    return data.get("meta"), data["rows"]


def fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, list):
        return "×".join(map(str, value))
    return str(value)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Every key of any row is a column (in order of first appearance), unless ``columns`` names them."""
    columns = columns or [c for c in dict.fromkeys(key for row in rows for key in row) if c != "error"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _one_or_all(value, short=lambda v: str(v)) -> str:
    """A meta value as text; a file merging several runs holds a list (each run's, in order)."""
    if isinstance(value, list):
        return " / ".join(dict.fromkeys(short(v) for v in value))
    return short(value)


def _cache_state(value) -> str | None:
    """``triton_cache``'s state: a dict's ``state``, or the text a hand-merged file holds instead."""
    if isinstance(value, dict):
        return value.get("state")
    return _one_or_all(value, lambda v: v.get("state", "?") if isinstance(v, dict) else str(v)) if value else None


def caption(meta: dict) -> str:
    """One line saying where the rows come from: GPU, versions, commit, Triton cache state (where the
    file records it: ``atom-core bench`` files do not), date. A file merging several runs may hold a list
    for any of these: each run's value is shown once."""
    commit = _one_or_all(meta.get("commit", "unknown"), lambda v: str(v)[:10])
    commit += " (dirty)" if meta.get("dirty") is True else ""
    cache = _cache_state(meta.get("triton_cache"))
    cache = f"Triton cache {cache} at start; " if cache else ""
    versions = ", ".join(f"{name} {_one_or_all(meta[name])}" for name in ("torch", "triton", "cuda", "hip")
                         if meta.get(name))
    gpu, utc = _one_or_all(meta.get("gpu", "?")), _one_or_all(meta.get("utc", "?"))
    return f"*{gpu}; {versions}; commit {commit}; {cache}{utc}*"


def render(path, columns: list[str] | None = None) -> str:
    """The Markdown of one result file: its table, and the caption when the file has meta."""
    meta, rows = load_result(path)
    text = table(rows, columns)
    return text if meta is None else f"{text}\n\n{caption(meta)}"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="A result file (--json of a benchmark) as a Markdown table.")
    parser.add_argument("path", help="the result file")
    parser.add_argument("columns", nargs="*", help="the columns to show, in order (default: every column)")
    args = parser.parse_args()
    print(render(args.path, args.columns or None))
