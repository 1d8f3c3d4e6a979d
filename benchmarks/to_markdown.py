"""Render a benchmark's JSON rows as a Markdown table: python -m benchmarks.to_markdown FILE [COLUMN ...]."""

from __future__ import annotations

import json
import sys


def fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, list):
        return "×".join(map(str, value))
    return str(value)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    columns = columns or [c for c in rows[0] if c != "error"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        data = json.load(f)
    print(table(data, sys.argv[2:] or None))
