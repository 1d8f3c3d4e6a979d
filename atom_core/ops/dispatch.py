"""Backend choice for ops: one registry per op, resolved per call.

Order of choice: explicit ``backend=`` argument > ``use_backend(...)`` context > the
``ATOM_CORE_BACKEND`` environment variable > auto (``aiter`` on ROCm with amd-aiter, ``triton``
on a GPU with Triton, ``torch`` otherwise).

A backend named by the ``backend=`` argument is strict: if it cannot serve the call, the call
raises ``BackendUnavailable`` with the reason. A backend named by the context or the environment
is a preference: when it cannot serve, the call falls through to the auto order, and the
reference twin (``torch``) serves last. ``trace_backends()`` records which backend served each call.

Backend implementations are registered by module path (``"atom_core.ops.triton.norm:rms_norm"``)
and imported on first use, so ``import atom_core.ops`` needs neither Triton nor AITER.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

BACKENDS = ("aiter", "triton", "torch")  # auto order: most specialised first
ENV_VAR = "ATOM_CORE_BACKEND"

_CUDA_AVAILABLE = torch.cuda.is_available()  # read once: the call is not free and the answer does not change
_preferred: contextvars.ContextVar[str | None] = contextvars.ContextVar("atom_core_backend", default=None)
_trace: contextvars.ContextVar[list | None] = contextvars.ContextVar("atom_core_backend_trace", default=None)


class BackendUnavailable(RuntimeError):
    """The backend asked for by name cannot serve this call; the message says why."""


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    return name


def triton_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@functools.lru_cache(maxsize=None)
def _aiter_imports() -> bool:
    # `import aiter` raises off ROCm ("ROCm version file not found"), so only try it there.
    if torch.version.hip is None or not _has_module("aiter"):
        return False
    try:
        importlib.import_module("aiter")
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def backend_available(name: str) -> bool:
    """Whether ``name`` can run on this machine at all (per-call limits are checked separately)."""
    _check_name(name)
    if name == "torch":
        return True
    if name == "triton":
        return _has_module("triton") and (_CUDA_AVAILABLE or triton_interpret())
    return _aiter_imports()


def available_backends() -> list[str]:
    """Backends that can run here, in auto order."""
    return [b for b in BACKENDS if backend_available(b)]


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Prefer ``name`` for ops called inside the block (falls through when it cannot serve)."""
    token = _preferred.set(None if name is None else _check_name(name))
    try:
        yield
    finally:
        _preferred.reset(token)


@contextlib.contextmanager
def trace_backends() -> Iterator[list[tuple[str, str]]]:
    """Record ``(op_name, backend)`` for every op call inside the block."""
    calls: list[tuple[str, str]] = []
    token = _trace.set(calls)
    try:
        yield calls
    finally:
        _trace.reset(token)


def on_device_for(backend: str, *tensors: torch.Tensor | None) -> str | None:
    """Common device check: Triton needs GPU tensors (or the interpreter with CPU ones), AITER GPU ones."""
    devices = {t.device.type for t in tensors if t is not None}
    if backend == "triton":
        if devices <= {"cuda"} or (triton_interpret() and devices <= {"cpu"}):
            return None
        return f"triton needs CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors), got {sorted(devices)}"
    if backend == "aiter" and devices - {"cuda"}:
        return f"aiter needs ROCm GPU tensors, got {sorted(devices)}"
    return None


@dataclass
class _Impl:
    target: str | Callable  # "package.module:function" (imported lazily) or a callable
    supports: Callable[..., str | None] | None  # returns why it cannot serve, or None

    def load(self) -> Callable:
        if callable(self.target):
            return self.target
        module, _, attr = self.target.partition(":")
        self.target = getattr(importlib.import_module(module), attr)
        return self.target


class Op:
    """One op's backends. ``op(*args, backend=None, **kwargs)`` picks one and calls it."""

    def __init__(self, name: str):
        self.name = name
        self._impls: dict[str, _Impl] = {}

    def register(self, backend: str, target: str | Callable, supports: Callable[..., str | None] | None = None) -> None:
        self._impls[_check_name(backend)] = _Impl(target, supports)

    @property
    def backends(self) -> list[str]:
        return [b for b in BACKENDS if b in self._impls]

    def why_not(self, backend: str, *args, **kwargs) -> str | None:
        """Why ``backend`` cannot serve this call, or None when it can."""
        impl = self._impls.get(backend)
        if impl is None:
            return f"op {self.name!r} has no {backend} implementation"
        if not backend_available(backend):
            return f"backend {backend!r} is not available on this machine"
        if backend != "torch":
            reason = on_device_for(backend, *[a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
            if reason:
                return reason
        return impl.supports(*args, **kwargs) if impl.supports else None

    def choose(self, *args, backend: str | None = None, **kwargs) -> str:
        if backend is not None:
            reason = self.why_not(_check_name(backend), *args, **kwargs)
            if reason:
                raise BackendUnavailable(f"{self.name}: backend {backend!r} cannot serve this call: {reason}")
            return backend
        preferred = _preferred.get() or os.environ.get(ENV_VAR) or None
        order = ([_check_name(preferred)] if preferred else []) + [b for b in BACKENDS if b != preferred]
        for candidate in order:
            if self.why_not(candidate, *args, **kwargs) is None:
                return candidate
        raise BackendUnavailable(f"{self.name}: no backend can serve this call")

    def __call__(self, *args, backend: str | None = None, **kwargs):
        chosen = self.choose(*args, backend=backend, **kwargs)
        calls = _trace.get()
        if calls is not None:
            calls.append((self.name, chosen))
        return self._impls[chosen].load()(*args, **kwargs)


_EAGER_BODIES: dict[str, Callable] = {}


def custom_op(name: str, *, mutates_args):
    """Register ``fn`` as ``torch.ops.atom_core.<name>`` and remember the plain function.

    ``call_op`` goes through the registered op only while ``torch.compile`` traces (where the op
    must stay one opaque node); eagerly it calls the function itself, because the custom-op
    wrapper costs tens of microseconds per call, as much as a small kernel. CUDA-graph capture
    records the kernels either way.
    """

    def register(fn):
        _EAGER_BODIES[name] = fn
        return torch.library.custom_op(f"atom_core::{name}", mutates_args=mutates_args)(fn)

    return register


def call_op(name: str, *args):
    if torch.compiler.is_compiling():
        return getattr(torch.ops.atom_core, name)(*args)
    return _EAGER_BODIES[name](*args)
