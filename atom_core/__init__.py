"""atom_core: LLM inference out of parts.

Layers (each imports only the ones before it): ``cache`` -> ``ops`` -> ``models`` -> ``engine``.
Importing the package has no side effects and needs no GPU, Triton or AITER.
"""

__version__ = "0.1.0"
