"""Adapters onto AMD's AITER kernels (ROCm). Imported lazily by the dispatcher, only when `aiter` imports."""
