"""RMSNorm as a module over ``ops.rms_norm``, with the residual add fused in.

Legend: T = tokens, D = normalised size (the hidden size, or the head dim for per-head
QK norms).

Decoder layers thread the residual stream through their norms::

    h, residual = x, None
    for each norm:  h, residual = norm(h, residual)   # residual <- h + residual; h <- norm(residual)

so each add happens inside the norm kernel instead of as a separate pass over memory. The
first norm of the first layer has no residual yet: ``norm(x)`` returns ``norm(x)`` alone and
the caller keeps ``x`` as the residual.
"""

from __future__ import annotations

import torch
from torch import nn

from atom_core import ops
from atom_core.models.quantization.activation import ActivationQuant, QuantizedActivation


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x**2) + eps) * weight`` over the last dim (``(1 + weight)`` when ``gemma``).

    The weight ``[D]`` is a parameter named ``weight`` (HF's name) in ``dtype``; it loads
    one-to-one from the checkpoint (no tensor-parallel split: norms are replicated).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, gemma: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
            raise ValueError(f"hidden_size must be an int >= 1, got {hidden_size!r}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.gemma = gemma
        # gemma stores the offset from 1, so its neutral weight is 0.
        init = torch.zeros if gemma else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype or torch.get_default_dtype()),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant: ActivationQuant | None = None):
        """Normalise the rows of ``x``.

        x: [..., D] float; residual: like x, or None.
        Returns ``out`` (like x) without a residual; with one, ``(out, residual_out)`` where
        ``residual_out = x + residual`` (the updated residual stream) and
        ``out = rms_norm(residual_out)``. Leading dims are flattened for the op and restored.
        ``quant``: ``out`` comes as a 2-D ``QuantizedActivation`` quantized that way, for the linear layer
        that reads it (``ops.rms_norm_quant``: one launch; ``models.quantization.activation``), with the 2-D
        float rows as its ``normed`` when ``quant.keep_normed`` (a MoE block: router and experts).
        """
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: last dim must be hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden_size)
        if quant is not None:
            flat_residual = None if residual is None else residual.reshape(-1, self.hidden_size)
            normed = torch.empty_like(x2) if quant.keep_normed else None
            q, scale, *residual_out = ops.rms_norm_quant(x2, self.weight, self.eps, residual=flat_residual,
                                                         gemma=self.gemma, group_size=quant.group_size,
                                                         dtype=quant.dtype, normed=normed)
            out = QuantizedActivation(q, scale, x.dtype, normed)
            return out if residual is None else (out, residual_out[0].view(residual.shape))
        if residual is None:
            out = ops.rms_norm(x2, self.weight, self.eps, gemma=self.gemma)
            return out.view(*lead, self.hidden_size)
        out, residual_out = ops.rms_norm(x2, self.weight, self.eps,
                                         residual=residual.reshape(-1, self.hidden_size), gemma=self.gemma)
        return out.view(*lead, self.hidden_size), residual_out.view(*lead, self.hidden_size)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}" + (", gemma=True" if self.gemma else "")
