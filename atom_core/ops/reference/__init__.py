"""Reference twins: plain-torch definitions of every op, written for clarity. They are the spec."""

from atom_core.ops.reference.norm import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm"]
