"""AITER adapters for gated activations (aiter/ops/activation.py). AITER writes into ``out``."""

from __future__ import annotations

import aiter


def silu_and_mul(x, out):
    aiter.silu_and_mul(out, x)


def gelu_and_mul(x, approximate, out):
    if approximate == "tanh":
        aiter.gelu_tanh_and_mul(out, x)
    else:
        aiter.gelu_and_mul(out, x)
