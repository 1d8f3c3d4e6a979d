"""atom_core.cache is pure arithmetic: it imports torch, numpy, xxhash, the standard library and
itself, never a kernel library (triton, aiter) nor another atom_core layer. Checked on the source."""

import ast
import sys
from pathlib import Path

import atom_core.cache

CACHE_DIR = Path(atom_core.cache.__file__).parent
ALLOWED_THIRD_PARTY = {"torch", "numpy", "xxhash"}


def imported_top_level_names(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.lineno, node.module


def test_cache_imports_no_kernel_library_and_no_later_layer():
    files = sorted(CACHE_DIR.rglob("*.py"))
    assert files, "no cache sources found"
    bad = []
    for path in files:
        for lineno, name in imported_top_level_names(path):
            top = name.split(".")[0]
            if name.startswith("atom_core."):
                ok = name.startswith("atom_core.cache")
            else:
                ok = top in ALLOWED_THIRD_PARTY or top in sys.stdlib_module_names or top == "__future__"
            if not ok:
                bad.append(f"{path.name}:{lineno} imports {name}")
    assert not bad, bad
