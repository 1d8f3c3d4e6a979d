"""A stand-in ``aiter`` module whose functions have exactly AITER's signatures.

The signatures are parsed from ``aiter_signatures.txt`` (read from the amd-aiter wheel), so an
adapter that passes an argument AITER does not take, or misses one it needs, fails here.
Each call is recorded; what a function returns or writes is given per test as a behaviour.
"""

from __future__ import annotations

import enum
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Callable, Optional

import torch

SIGNATURES = Path(__file__).with_name("aiter_signatures.txt")
_LINE = re.compile(r"^aiter/(?P<file>[\w/]+)\.py: (?P<name>\w+)\((?P<params>.*)\)(?: -> .*)?$")
_ENUM = re.compile(r"^csrc/include/aiter_enum\.h: enum (?P<name>\w+) \{ (?P<members>.*) \}$")


def parse_enums() -> dict[str, type[enum.IntEnum]]:
    """AITER's C++ enums (ActivationType, QuantType) as IntEnums with the header's values."""
    found = {}
    for line in SIGNATURES.read_text().splitlines():
        m = _ENUM.match(line)
        if not m:
            continue
        members, value = {}, -1
        for member in m["members"].split(", "):
            name, _, explicit = member.partition(" = ")
            value = int(explicit) if explicit else value + 1  # C++: one more than the previous
            members[name] = value
        found[m["name"]] = enum.IntEnum(m["name"], members)
    return found


def parse_signatures() -> dict[str, tuple[str, inspect.Signature]]:
    """name -> (source file, signature) for every function found in the wheel."""
    namespace = {
        "torch": torch, "Tensor": torch.Tensor, "Optional": Optional, "Generator": torch.Generator,
        "dtypes": types.SimpleNamespace(fp32=torch.float32, i8=torch.int8, bf16=torch.bfloat16),
        **parse_enums(),
    }
    found = {}
    for line in SIGNATURES.read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        params = m["params"].replace("torch.tensor", "torch.Tensor")
        exec(f"def {m['name']}({params}): pass", namespace)  # noqa: S102 - our own checked-in text
        found[m["name"]] = (m["file"], inspect.signature(namespace[m["name"]]))
    return found


class FakeAiter(types.ModuleType):
    def __init__(self, behaviours: dict[str, Callable]):
        super().__init__("aiter")
        self.calls: list[tuple[str, dict]] = []
        for name, values in parse_enums().items():  # `from aiter import ActivationType, QuantType`
            setattr(self, name, values)
        for name, (_, signature) in parse_signatures().items():
            setattr(self, name, self._make(name, signature, behaviours.get(name)))
        # Sub-modules the adapters import from (aiter.fused_moe.fused_moe, aiter.mla.*).
        self.fused_moe_module = types.ModuleType("aiter.fused_moe")
        self.fused_moe_module.fused_moe = getattr(self, "fused_moe")
        self.mla = types.ModuleType("aiter.mla")
        self.mla.mla_decode_fwd = getattr(self, "mla_decode_fwd")
        self.mla.mla_prefill_fwd = getattr(self, "mla_prefill_fwd")

    def _make(self, name, signature, behaviour):
        def fake(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)  # TypeError on a wrong argument list
            bound.apply_defaults()
            self.calls.append((name, dict(bound.arguments)))
            if behaviour is None:
                raise NotImplementedError(f"fake aiter: no behaviour given for {name}")
            return behaviour(**bound.arguments)

        fake.__name__ = name
        fake.__signature__ = signature
        return fake


def install(monkeypatch, behaviours: dict[str, Callable]) -> FakeAiter:
    """Put a FakeAiter in ``sys.modules`` and drop cached adapters so they import it."""
    fake = FakeAiter(behaviours)
    monkeypatch.setitem(sys.modules, "aiter", fake)
    monkeypatch.setitem(sys.modules, "aiter.fused_moe", fake.fused_moe_module)
    monkeypatch.setitem(sys.modules, "aiter.mla", fake.mla)
    import atom_core.ops.aiter as adapters

    for mod in [m for m in sys.modules if m.startswith("atom_core.ops.aiter.")]:
        monkeypatch.delitem(sys.modules, mod)
        # `from atom_core.ops.aiter import x` reads the package attribute: drop it too.
        monkeypatch.delattr(adapters, mod.rsplit(".", 1)[1], raising=False)
    return fake
