"""The server is an optional top layer: importing atom_core and its lower layers (the AsyncEngine
included) loads no web framework, no server dependency and nothing of atom_core.serve; and the
import-linter contracts name serve above engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER_PACKAGES = {"fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic", "openai"}


def test_importing_atom_core_and_the_engine_loads_nothing_of_the_server():
    script = f"""
import json, sys
import atom_core, atom_core.cache, atom_core.ops, atom_core.models, atom_core.engine
import atom_core.engine.async_engine
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {sorted(SERVER_PACKAGES)!r}
                or m == "atom_core.serve" or m.startswith("atom_core.serve."))
print(json.dumps(loaded))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_the_import_contracts_put_serve_on_top_and_keep_web_packages_in_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    assert layers[:2] == ["atom_core.serve", "atom_core.engine"]
    forbidden = next(c for c in contracts if c["type"] == "forbidden" and "fastapi" in c["forbidden_modules"])
    assert set(forbidden["source_modules"]) == {"atom_core.cache", "atom_core.ops", "atom_core.models",
                                                "atom_core.engine"}
    assert SERVER_PACKAGES <= set(forbidden["forbidden_modules"])
