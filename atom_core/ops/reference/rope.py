"""Reference rotary position embedding: the cos/sin cache builder and the rotation, in plain torch.

Legend: T = tokens, H = heads, D = head size, R = rotary dim (<= D, even), P = cached positions.

The cache row of position p is ``[cos(p * inv_freq) * a, sin(p * inv_freq) * a]`` with
``inv_freq`` of length R/2 and ``a`` the attention scale (yarn's mscale, longrope's attention factor,
1.0 otherwise); this is
the layout vLLM and ATOM use. The frequencies follow HF transformers' ``modeling_rope_utils``
formulas, computed in fp32 as transformers does, so the cache equals HF's cos/sin.
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """inv_freq[i] = base ** (-2i / R) for i in [0, R/2); fp32 [R/2]."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base ** exponents)


def linear_inv_freq(rotary_dim: int, base: float, factor: float) -> torch.Tensor:
    """Position interpolation: positions divided by ``factor``, i.e. every frequency divided by it."""
    return default_inv_freq(rotary_dim, base) / factor


def llama3_inv_freq(rotary_dim: int, base: float, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1 scaling: wavelengths beyond ``L / low_freq_factor`` are divided by ``factor``,
    those below ``L / high_freq_factor`` kept, and the band between blended linearly in ``L / wavelen``
    (L = original_max_position_embeddings)."""
    inv_freq = default_inv_freq(rotary_dim, base)
    old_len = original_max_position_embeddings
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # smooth = (L / wavelen - low) / (high - low); blended = (1 - smooth) * f / factor + smooth * f
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: ``0.1 * mscale * ln(scale) + 1`` (1.0 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_scale(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """The factor cos and sin are multiplied by. With both mscale and mscale_all_dim (DeepSeek),
    the ratio of the two temperatures; otherwise the temperature of ``factor`` alone."""
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_softmax_scale(head_dim: int, scaling: dict | None) -> float:
    """DeepSeek's softmax scale: ``head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2``
    when ``scaling`` names a rope type other than "default" and a non-zero ``mscale_all_dim``
    (transformers' ``yarn_apply_mscale`` of DeepSeek-V2/V3). The attention logits of extended-context
    checkpoints are thereby sharpened by the same temperature on every dim, not only the rotary ones
    (the cos/sin table carries the ratio ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``)."""
    scale = head_dim ** -0.5
    if rope_type_of(scaling) != "default" and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(float(_get(scaling, "factor", rope_type_of(scaling))), float(scaling["mscale_all_dim"]))
        scale = scale * mscale * mscale
    return scale


def yarn_inv_freq(rotary_dim: int, base: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """YaRN (NTK-by-parts): dims that rotate more than ``beta_fast`` times over the original context
    keep their frequency (extrapolate), those rotating fewer than ``beta_slow`` times are divided by
    ``factor`` (interpolate), with a linear ramp over the dims between."""
    dim = rotary_dim

    def correction_dim(num_rotations: float) -> float:
        # The dim index whose wavelength fits ``num_rotations`` times in the original context.
        return dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def _get(scaling: dict, key: str, rope_type: str):
    if scaling.get(key) is None:
        raise ValueError(f"scaling[{key!r}] is required for rope_type {rope_type!r}")
    return scaling[key]


_POSITIVE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                  "attention_factor")


def _check_positive(scaling: dict, rope_type: str) -> None:
    """The scaling's numbers that divide or scale (when given): finite and > 0. A zero factor made every angle
    NaN, a negative one a table of other positions (transformers only warns)."""
    for key in _POSITIVE_KEYS:
        value = scaling.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"scaling[{key!r}] must be a finite number > 0 for rope_type {rope_type!r}, "
                             f"got {value!r}")
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if isinstance(values, (list, tuple)) and not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in values):
            raise ValueError(f"scaling[{key!r}] must hold finite numbers > 0 for rope_type {rope_type!r}")


def rope_type_of(scaling: dict | None) -> str:
    """The rope type named by an HF ``rope_scaling`` / ``rope_parameters`` dict (``type`` is the old key)."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def longrope_inv_freq_and_attention_scale(rotary_dim: int, base: float, scaling: dict,
                                          max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3's long-context releases): per-frequency rescale factors, ``long_factor`` for a table
    longer than the pretraining length (``max_position > original_max_position_embeddings``), else
    ``short_factor``, chosen once for the whole table as vLLM does (transformers picks per forward by the
    longest position in it: the two agree on every sequence when the table is no longer than the pretraining
    length, and on sequences longer than it otherwise). The attention scale: ``attention_factor``, else
    ``sqrt(1 + ln(factor) / ln(original))`` for ``factor`` (default ``max_position / original``) above 1."""
    original = int(_get(scaling, "original_max_position_embeddings", "longrope"))
    use_long = max_position > original
    key = "long_factor" if use_long else "short_factor"
    factors = _get(scaling, key, "longrope")
    if not isinstance(factors, (list, tuple)) or len(factors) != rotary_dim // 2:
        raise ValueError(f"scaling[{key!r}] must hold rotary_dim / 2 = {rotary_dim // 2} numbers (one a frequency), "
                         f"got {len(factors) if isinstance(factors, (list, tuple)) else factors!r}")
    for extra in ("short_mscale", "long_mscale"):
        if scaling.get(extra) is not None:
            raise ValueError(f"scaling[{extra!r}] is not supported for rope_type 'longrope' (transformers' Phi-3 "
                             "ignores it and vLLM applies it: the two disagree)")
    factor = scaling.get("factor")
    factor = max_position / original if factor is None else float(factor)
    attention_scale = scaling.get("attention_factor")
    if attention_scale is None:
        attention_scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents)
    return inv_freq, float(attention_scale)


def inv_freq_and_attention_scale(rotary_dim: int, base: float, scaling: dict | None,
                                 max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """fp32 inv_freq [R/2] and the attention scale for an HF scaling dict (None = default rope);
    ``max_position`` (the table's rows) is needed by longrope only."""
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return default_inv_freq(rotary_dim, base), 1.0
    _check_positive(scaling, rope_type)
    if rope_type == "linear":
        return linear_inv_freq(rotary_dim, base, float(_get(scaling, "factor", rope_type))), 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(
            rotary_dim, base,
            factor=float(_get(scaling, "factor", rope_type)),
            low_freq_factor=float(_get(scaling, "low_freq_factor", rope_type)),
            high_freq_factor=float(_get(scaling, "high_freq_factor", rope_type)),
            original_max_position_embeddings=int(_get(scaling, "original_max_position_embeddings", rope_type)),
        ), 1.0
    if rope_type == "yarn":
        factor = float(_get(scaling, "factor", rope_type))
        inv_freq = yarn_inv_freq(
            rotary_dim, base, factor,
            original_max_position_embeddings=int(_get(scaling, "original_max_position_embeddings", rope_type)),
            # HF treats 0 / missing as "use the paper's default".
            beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            truncate=bool(scaling.get("truncate", True)),
        )
        attention_scale = scaling.get("attention_factor")
        if attention_scale is None:
            attention_scale = yarn_attention_scale(factor, scaling.get("mscale"), scaling.get("mscale_all_dim"))
        return inv_freq, float(attention_scale)
    if rope_type == "longrope":
        if max_position is None:
            raise ValueError("rope_type 'longrope' needs max_position (its factors depend on the table's length)")
        return longrope_inv_freq_and_attention_scale(rotary_dim, base, scaling, max_position)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}")


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, scaling: dict | None = None, *,
                       dtype: torch.dtype = torch.float32, device=None) -> tuple[torch.Tensor, float]:
    """The cos/sin cache [max_position, R] (cos in columns [0, R/2), sin in [R/2, R)) and the
    attention scale already folded into it (yarn's mscale, longrope's attention factor; 1.0 for the other
    types)."""
    inv_freq, attention_scale = inv_freq_and_attention_scale(rotary_dim, base, scaling, max_position)
    positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    angles = positions[:, None] * inv_freq[None, :]  # fp32 [P, R/2], one rounding per product as in HF
    cache = torch.cat([angles.cos() * attention_scale, angles.sin() * attention_scale], dim=-1)
    return cache.to(device=device, dtype=dtype), attention_scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the pairs of x [..., R] by angles with cos, sin [..., R/2] (broadcast); fp32 out.

    NeoX pairs dim i with dim i + R/2; GPT-J pairs dims 2i and 2i + 1. Each pair (a, b) becomes
    ``(a cos - b sin, b cos + a sin)``.
    """
    x = x.float()
    if is_neox:
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *,
                is_neox: bool = True) -> None:
    """Rotate the first R dims of every head of q [T, Hq, D] and k [T, Hk, D] in place.

    positions: int64 [T] rows of cos_sin_cache [P, R]. Math in fp32, written back in q's/k's dtype.
    """
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, R/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    for x in (q, k):
        x[..., :rotary_dim] = rotate(x[..., :rotary_dim], cos, sin, is_neox).to(x.dtype)
