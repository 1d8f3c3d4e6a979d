"""Triton kernels. Imported lazily by the dispatcher; importing this package needs Triton."""
