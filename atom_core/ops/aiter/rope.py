"""AITER adapter for ``apply_rope_`` (aiter/ops/rope.py: ``rope_cached_positions_2c_fwd_inplace``).

AITER's cached-positions kernel works on "sbhd" tensors [s, b, h, d] with cos and sin given as two
tables [max_pos, 1, 1, d // 2] (``reuse_freqs_front_part=True``: one value per pair), and positions
[s, b] int64 naming a table row for each (s, b). It rotates the first d dims when
``nope_first=False``; ``rotate_style`` 0 is NeoX (halves), 1 is GPT-J (interleaved pairs).

Mapping from atom_core's arguments:

- q [T, Hq, D] → ``q[..., :R].unsqueeze(0)``: s = 1, b = T, d = R (a strided view: AITER takes
  the input's strides, and writes in place, so the unrotated dims R..D are never touched).
- cos_sin_cache [P, R] (contiguous) holds cos(p) and sin(p) side by side in row p. Viewed flat as
  rows of R/2 values, cos(p) is half-row 2p and sin(p) is half-row 2p + 1. The kernel reads its
  tables through the raw pointer with row length = their last dim, so ``cos`` is the flat view
  without its last half-row and ``sin`` the flat view without its first one, both
  [2P - 1, 1, 1, R/2] and indexed by ``2 * positions`` (row 2p of each is cos(p), resp. sin(p)).
  No copy of the table is made, so the cache can stay fp32 (AITER dispatches on the input and
  table dtypes separately).
"""

from __future__ import annotations

import aiter

NEOX, GPTJ = 0, 1  # AITER's rotate_style values


def apply_rope_(q, k, positions, cos_sin_cache, is_neox):
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    flat = cos_sin_cache.view(-1)
    cos = flat[:-half].view(-1, 1, 1, half)  # row 2p = cos(p)
    sin = flat[half:].view(-1, 1, 1, half)  # row 2p = sin(p): the same rows shifted by R/2 values
    rows = (positions * 2).view(1, num_tokens)
    aiter.rope_cached_positions_2c_fwd_inplace(
        q[..., :rotary_dim].unsqueeze(0),
        k[..., :rotary_dim].unsqueeze(0),
        cos,
        sin,
        rows,
        NEOX if is_neox else GPTJ,
        reuse_freqs_front_part=True,
        nope_first=False,
    )
