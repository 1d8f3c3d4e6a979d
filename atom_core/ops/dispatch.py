"""Backend choice for ops: one registry per op; the choice is made once per argument signature.

Order of choice: explicit ``backend=`` argument > ``use_backend(...)`` context > the default
backend (``ATOM_CORE_BACKEND``, read once at import; ``set_default_backend`` changes it later) >
auto: ``aiter`` on ROCm with amd-aiter where the selftest record says it passed for the op on this
device and these library versions, ``triton`` on a GPU with Triton unless the record says it failed,
``scaled_mm`` (``torch._scaled_mm``, only the scaled GEMMs have it) on a GPU where Triton cannot serve
or failed, ``torch`` otherwise (``atom_core.ops.verified``; ``python -m atom_core.ops.selftest`` writes
the record). An op may put one backend first on the calls a rule of its own picks (``Op.prefer``: the
block-format GEMM sends 256 rows and more to cuBLAS), under the same record and refusals.

A backend named by the ``backend=`` argument is strict: if it cannot serve the call, the call
raises ``BackendUnavailable`` with the reason. A backend named by the context or the default
is a preference: when it cannot serve, the call falls through to the auto order, and the
reference twin (``torch``) serves last. ``trace_backends()`` records which backend served each call.

The choice is cached per op. Each backend registers, next to its ``supports`` rule, a ``key``: a
function of the call's arguments returning the facts that rule reads (last-dim strides, dtypes,
flags, None-ness, the size limits it tests) and nothing else, so it is cheap and builds no
string. A call's signature is the devices of its tensors (read by ``on_device_for``) plus the keys
of the backends available on this machine (on a CPU without Triton it is empty). Calls with equal
signatures and the same preference get the same backend, so the rules, and the reason strings
they build, run once per signature; ``Op.choose_uncached`` runs them every time, and is what the
cache is tested against.

Backend implementations (and keys that live next to an adapter's ``supports``) are registered by
module path (``"atom_core.ops.triton.norm:rms_norm"``) and imported on first use, so
``import atom_core.ops`` needs neither Triton nor AITER.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator

import torch

from atom_core.ops import verified

# Auto order: most specialised first. "scaled_mm" is torch._scaled_mm (cuBLASLt / hipBLASLt), which only
# the scaled GEMMs register: a backend of its own because "torch" is the twin, the definition the others
# are checked against; after "triton" so that the project's kernels stay the GPU default, as for every op
# (except where an op's Op.prefer rule says otherwise, from measurements: scaled_mm_block at 256 rows and more).
BACKENDS = ("aiter", "triton", "scaled_mm", "torch")
ENV_VAR = "ATOM_CORE_BACKEND"
# Signatures kept per op before its cache starts over: a few per model in practice; only the
# exact default key (shapes included) could grow without bound.
_CACHE_LIMIT = 4096

_CUDA_AVAILABLE = torch.cuda.is_available()  # read once: the call is not free and the answer does not change
_preferred: contextvars.ContextVar[str | None] = contextvars.ContextVar("atom_core_backend", default=None)
_trace: contextvars.ContextVar[list | None] = contextvars.ContextVar("atom_core_backend_trace", default=None)
OPS: dict[str, "Op"] = {}  # every op by name (for tests and tools that walk all ops)


def clear_choices() -> None:
    """Forget every op's cached backend choices (after the selftest record changed, or availability)."""
    for op in OPS.values():
        op.clear_cache()


class BackendUnavailable(RuntimeError):
    """The backend asked for by name cannot serve this call; the message says why."""


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    return name


def _backend_from_env() -> str | None:
    """``ATOM_CORE_BACKEND``, checked: a name that is not a backend fails at import, naming the variable."""
    name = os.environ.get(ENV_VAR) or None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={name!r} is not a backend; choose one of {BACKENDS} or unset it (auto)")
    return name


# Read once: an environment lookup costs about a microsecond, and the choice cache assumes a fixed default.
_default_backend: str | None = _backend_from_env()


def set_default_backend(name: str | None) -> None:
    """Prefer ``name`` for op calls from now on; ``None`` = auto.

    Replaces what ``ATOM_CORE_BACKEND`` said at import. Like the variable it is a preference
    (falls through when the backend cannot serve); ``use_backend`` and ``backend=`` take precedence.
    """
    global _default_backend
    _default_backend = None if name is None else _check_name(name)


def default_backend() -> str | None:
    """The default preference: ``ATOM_CORE_BACKEND`` as read at import, or the last ``set_default_backend``."""
    return _default_backend


def preferred_backend() -> str | None:
    """The preference ops called here now follow: the innermost ``use_backend``, else the default."""
    return _preferred.get() or _default_backend


@functools.lru_cache(maxsize=None)
def triton_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``).

    Read once: Triton itself reads the variable when a kernel is defined, so a later change
    would not take effect anyway.
    """
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
    if name == "scaled_mm":
        return _CUDA_AVAILABLE and hasattr(torch, "_scaled_mm")
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
    """Common device check: Triton needs GPU tensors (or the interpreter with CPU ones), AITER and
    scaled_mm GPU ones (torch._scaled_mm also runs on the CPU, slower than the twin: not worth choosing)."""
    devices = {t.device.type for t in tensors if t is not None}
    if backend == "triton":
        if devices <= {"cuda"} or (triton_interpret() and devices <= {"cpu"}):
            return None
        return f"triton needs CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors), got {sorted(devices)}"
    if backend == "aiter" and devices - {"cuda"}:
        return f"aiter needs ROCm GPU tensors, got {sorted(devices)}"
    if backend == "scaled_mm" and devices - {"cuda"}:
        return f"scaled_mm needs GPU tensors, got {sorted(devices)}"
    return None


_Tensor = torch.Tensor  # a module global: `torch.Tensor` costs an attribute lookup per argument


def tensor_devices(args: tuple) -> tuple:
    """The device of every tensor among ``args``, in order: all that ``on_device_for`` reads."""
    return tuple([a.device for a in args if isinstance(a, _Tensor)])


def exact_key(*args) -> tuple:
    """The default key of a ``supports`` rule: each tensor's dtype, shape and strides, each other
    argument itself. Right for any rule that reads metadata and argument values (never tensor
    contents), but slower and finer than a key that lists what one rule reads."""
    return tuple([(a.dtype, tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a for a in args])


def _resolve(target: str | Callable) -> Callable:
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass
class _Impl:
    target: str | Callable  # "package.module:function" (imported lazily) or a callable
    supports: Callable[..., str | None] | None  # returns why it cannot serve, or None
    key: str | Callable[..., Hashable] | None  # the facts `supports` reads (a callable or "module:function")

    def load(self) -> Callable:
        self.target = _resolve(self.target)
        return self.target


class Op:
    """One op's backends. ``op(*args, backend=None, **kwargs)`` picks one (cached) and calls it."""

    def __init__(self, name: str):
        self.name = name
        self._impls: dict[str, _Impl] = {}
        self._first: tuple[str, Callable[..., bool]] | None = None  # (backend, rule): see prefer()
        self._signature_fn: Callable[[tuple], Hashable] | None = None
        self._chosen: dict[Hashable, tuple[str, Callable]] = {}  # (signature, preference) -> backend, function
        self._strict: dict[Hashable, tuple[str, Callable]] = {}  # (signature, named backend) -> backend, function
        OPS[name] = self

    def register(self, backend: str, target: str | Callable, supports: Callable[..., str | None] | None = None,
                 key: str | Callable[..., Hashable] | None = None) -> None:
        """Add a backend. ``supports(*args)`` says why it cannot serve a call, or None; ``key(*args)``
        returns everything ``supports`` reads, so that equal keys mean equal answers (default:
        :func:`exact_key`). Keys run on every call: ``t.stride()[-1]`` costs a third less than
        ``t.stride(-1)``, and a key builds no string."""
        if supports is not None and key is None:
            key = exact_key
        self._impls[_check_name(backend)] = _Impl(target, supports, key)
        self.clear_cache()

    def prefer(self, backend: str, rule: Callable[..., bool]) -> None:
        """Put ``backend`` first in this op's auto order on the calls where ``rule(*args)`` is true (where it
        is measured faster than the backends before it); elsewhere the order stays as it is. It is still
        chosen only where it can serve and the selftest record allows it, a preference named by
        ``use_backend`` or the default comes before it, and ``backend=`` is unaffected. ``rule`` is also its
        own key: it reads only metadata and returns a bool (part of the call's signature)."""
        self._first = (_check_name(backend), rule)
        self.clear_cache()

    def _auto_order(self, args: tuple, kwargs: dict) -> list[str]:
        if self._first is not None and self._first[1](*args, **kwargs):
            return [self._first[0]] + [b for b in BACKENDS if b != self._first[0]]
        return list(BACKENDS)

    def clear_cache(self) -> None:
        """Forget the cached choices and the signature (after availability changed, e.g. in a test)."""
        self._signature_fn = None
        self._chosen.clear()
        self._strict.clear()

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

    def choose_uncached(self, *args, backend: str | None = None, **kwargs) -> str:
        """The backend for this call by running every rule now (what the cache must agree with)."""
        if backend is not None:
            reason = self.why_not(_check_name(backend), *args, **kwargs)
            if reason:
                raise BackendUnavailable(f"{self.name}: backend {backend!r} cannot serve this call: {reason}")
            return backend
        preferred = preferred_backend()
        order = ([_check_name(preferred)] if preferred else []) + [
            b for b in self._auto_order(args, kwargs) if b != preferred]
        device = _first_device(args, kwargs)
        for candidate in order:
            # A named preference is tried as named; the others only where the selftest record allows.
            if self.why_not(candidate, *args, **kwargs) is None and (
                    candidate == preferred or verified.auto_may_choose(self.name, candidate, device)):
                return candidate
        raise BackendUnavailable(f"{self.name}: no backend can serve this call")

    def signature(self, *args) -> Hashable:
        """What every rule of this op reads from a (positional) call, on this machine."""
        return (self._signature_fn or self._build_signature())(args)

    def _build_signature(self) -> Callable[[tuple], Hashable]:
        # Only backends that can run here ask anything of the arguments; the others refuse every call alike.
        available = [impl for b, impl in self._impls.items() if backend_available(b)]
        keys = [_resolve(impl.key) for impl in available if impl.supports is not None]
        if self._first is not None and backend_available(self._first[0]):
            keys.append(self._first[1])
        device_checked = any(b != "torch" and backend_available(b) for b in self._impls)
        if not device_checked and not keys:
            fn = _no_signature
        elif not keys:
            fn = tensor_devices
        elif len(keys) == 1:
            key = keys[0]

            def fn(args):
                return tensor_devices(args), key(*args)
        else:
            def fn(args):
                return tensor_devices(args), tuple([key(*args) for key in keys])
        self._signature_fn = fn
        return fn

    def _choice(self, args: tuple, kwargs: dict, backend: str | None) -> tuple[str, Callable]:
        """(backend, function) for this call: cached per signature, the rules run on a new one."""
        if backend is None and not kwargs and self._signature_fn is not None:
            try:  # the hot path: a known signature under a preference, one dict lookup
                hit = self._chosen.get((self._signature_fn(args), _preferred.get() or _default_backend))
            except TypeError:  # an unhashable argument under the exact key: chosen without the cache below
                hit = None
            if hit is not None:
                return hit
        return self._choose_and_remember(args, kwargs, backend)

    def _choose_and_remember(self, args: tuple, kwargs: dict, backend: str | None) -> tuple[str, Callable]:
        if kwargs:  # the ops call positionally; a keyword call is chosen afresh
            name = self.choose_uncached(*args, backend=backend, **kwargs)
            return name, self._impls[name].load()
        signature = (self._signature_fn or self._build_signature())(args)
        if backend is None:
            cache, entry = self._chosen, (signature, _preferred.get() or _default_backend)
        else:
            cache, entry = self._strict, (signature, backend)
        try:
            hit = cache.get(entry)
        except TypeError:  # an unhashable argument under the exact key: no caching for this call
            name = self.choose_uncached(*args, backend=backend)
            return name, self._impls[name].load()
        if hit is None:
            name = self.choose_uncached(*args, backend=backend)  # a refusal raises here, with its reason
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            hit = cache[entry] = (name, self._impls[name].load())
        return hit

    def choose(self, *args, backend: str | None = None, **kwargs) -> str:
        """The backend that serves this call (cached per signature and preference)."""
        return self._choice(args, kwargs, backend)[0]

    def __call__(self, *args, backend: str | None = None, **kwargs):
        chosen, fn = self._choice(args, kwargs, backend)
        calls = _trace.get()
        if calls is not None:
            calls.append((self.name, chosen))
        return fn(*args, **kwargs)


def _first_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The device of the call's first tensor (a backend that serves has all its tensors on one device)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def _no_signature(args: tuple) -> tuple:
    return ()


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
