"""Functional ops: tensors in, tensors out. Each has a reference twin (``atom_core.ops.reference``),
a Triton kernel and an AITER adapter, and is registered as ``torch.ops.atom_core.<name>``."""

from atom_core.ops import reference
from atom_core.ops.dispatch import (
    BackendUnavailable,
    available_backends,
    backend_available,
    trace_backends,
    use_backend,
)
from atom_core.ops.norm import layer_norm, rms_norm

__all__ = [
    "BackendUnavailable",
    "available_backends",
    "backend_available",
    "layer_norm",
    "reference",
    "rms_norm",
    "trace_backends",
    "use_backend",
]
