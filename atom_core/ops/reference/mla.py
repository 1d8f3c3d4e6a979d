"""Reference twins of multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2): the write of the
latent rows into the paged pool and attention over it, in its two equal forms. Plain torch, fp32 math.

Legend: T = query tokens of the step, B = rows, H = query heads (on this rank), L = kv_lora_rank,
R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim, S = a row's context length,
NB = pool blocks, BS = block size, P = pages per row.

**What is cached.** One row of L + R numbers per token and layer, in a pool ``[NB, BS, L + R]``
(slot s = block s // BS, offset s % BS, as for the K/V pool)::

    row[:L] = c_kv = kv_a_layernorm(kv_a_proj_with_mqa(x)[:L])    the compressed KV (the latent)
    row[L:] = k_pe = rope(kv_a_proj_with_mqa(x)[L:], position)     the decoupled RoPE key, shared by all heads

**What the latent expands to.** ``kv_b_proj``'s weight ``[H (Dn + Dv), L]`` seen as
``[H, Dn + Dv, L]`` splits into ``w_uk = W[:, :Dn]`` ``[H, Dn, L]`` and ``w_uv = W[:, Dn:]``
``[H, Dv, L]``; per context token s and head h::

    k_nope[s, h] = w_uk[h] @ c_kv[s]                 [Dn]
    v[s, h]      = w_uv[h] @ c_kv[s]                 [Dv]
    k[s, h]      = [k_nope[s, h], k_pe[s]]           [Dn + R]    against q[t, h] = [q_nope[t, h], q_pe[t, h]]
    out[t, h]    = sum_s softmax_s(scale * q[t, h] . k[s, h]) v[s, h]          [Dv]

**Two forms of that attention** (equal up to rounding; the tests pin them together):

* expanded (:func:`mla_prefill_attention`): gather each row's S latent rows, expand them to per-head
  k_nope and v, attend as ordinary multi-head attention with q.k over Dn + R dims and Dv-dim
  values. Costs ~ S L H (Dn + Dv) per row: cheap per token when a row has many queries (prefill).
* absorbed (:func:`mla_decode_attention`): since ``q_nope . (w_uk[h] c_kv[s]) = (q_nope @ w_uk[h]) . c_kv[s]``,
  the query moves into latent space once, ``q_lat[t, h] = q_nope[t, h] @ w_uk[h]`` ``[L]``; attention is
  then multi-query attention over the cached rows themselves (one shared key ``[c_kv, k_pe]`` of L + R
  dims, value ``c_kv`` of L dims) giving ``o_lat[t, h]`` ``[L]``, which goes back through
  ``out[t, h] = w_uv[h] @ o_lat[t, h]``. Costs ~ S H (L + R) per query token and never expands the
  context: right for decode.

The mask is ``reference.attention``'s: row r's q_len queries are the last of its ``context_lens[r]``
tokens; query i sits at position ``p = context_len - q_len + i`` and sees keys ``j <= p``
(bottom-right causal). Rows with an empty context output zeros. An fp8 pool holds ``row / kv_scale``
(one per-tensor scale for the whole row); the twins read ``row * kv_scale``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops.reference.attention import attention_mask, dense_attention, gather_context
from atom_core.ops.reference.kv_cache import FP8_DTYPE, quantize_fp8


def store_mla_(kv_c: Tensor, k_pe: Tensor, mla_cache: Tensor, slot_mapping: Tensor,
               kv_scale: Tensor | None = None) -> None:
    """Write ``[kv_c[t], k_pe[t]]`` (L + R numbers) at slot ``s = slot_mapping[t]`` of ``mla_cache``
    ``[NB, BS, L + R]``: block s // BS, offset s % BS; s == -1 writes nothing.

    kv_c: [T, L] (the normalised latent), k_pe: [T, R] (the rotated rope key). An fp8 cache stores
    ``quantize_fp8(row, kv_scale)``; other caches store the row cast to their dtype.
    """
    block_size = mla_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    rows = torch.cat([kv_c[keep].float(), k_pe[keep].float()], dim=-1)  # [T', L + R]; exact for 16/32-bit inputs
    rows = quantize_fp8(rows, kv_scale) if mla_cache.dtype == FP8_DTYPE else rows.to(mla_cache.dtype)
    mla_cache[slots // block_size, slots % block_size] = rows


def gather_latent(mla_cache: Tensor, block_table_row: Tensor, context_len: int,
                  kv_scale: Tensor | None = None) -> Tensor:
    """The first ``context_len`` cached rows of one sequence, in position order: fp32 [S, L + R]
    (dequantised with ``kv_scale`` when given)."""
    rows = gather_context(mla_cache.unsqueeze(2), block_table_row, context_len)[:, 0].float()  # [S, L + R]
    return rows if kv_scale is None else rows * kv_scale.float().reshape(())


def expand_latent(c_kv: Tensor, w_uk: Tensor, w_uv: Tensor) -> tuple[Tensor, Tensor]:
    """Per-head keys and values of latent rows: c_kv [S, L], w_uk [H, Dn, L], w_uv [H, Dv, L] ->
    (k_nope [S, H, Dn], v [S, H, Dv]), fp32."""
    k_nope = torch.einsum("sl,hdl->shd", c_kv.float(), w_uk.float())
    v = torch.einsum("sl,hdl->shd", c_kv.float(), w_uv.float())
    return k_nope, v


def mla_prefill_attention(q_nope: Tensor, q_pe: Tensor, mla_cache: Tensor, w_uk: Tensor, w_uv: Tensor,
                          block_tables: Tensor, cu_seqlens_q: Tensor, context_lens: Tensor, max_seqlen_q: int,
                          max_seqlen_k: int, *, scale: float, kv_scale: Tensor | None = None) -> Tensor:
    """MLA, expanded form: each row's context expanded through w_uk / w_uv, then multi-head attention.

    q_nope: [T, H, Dn]; q_pe: [T, H, R] (rotated); mla_cache: [NB, BS, L + R]; w_uk: [H, Dn, L];
    w_uv: [H, Dv, L]; block_tables int32 [B, P]; cu_seqlens_q int32 [B + 1]; context_lens int32 [B];
    max_seqlen_q / max_seqlen_k: ints (unused here, part of the op's signature); kv_scale: fp32 [1] or
    None. Returns [T, H, Dv] in q_nope's dtype.
    """
    num_tokens, num_heads, _ = q_nope.shape
    latent_dim = w_uk.shape[-1]
    out = torch.zeros(num_tokens, num_heads, w_uv.shape[1], dtype=torch.float32, device=q_nope.device)
    starts = cu_seqlens_q.tolist()
    for row, context_len in enumerate(context_lens.tolist()):
        first, last = starts[row], starts[row + 1]
        if context_len == 0 or last == first:
            continue
        rows = gather_latent(mla_cache, block_tables[row], context_len, kv_scale)   # [S, L + R]
        c_kv, k_pe = rows[:, :latent_dim], rows[:, latent_dim:]
        k_nope, v = expand_latent(c_kv, w_uk, w_uv)                                  # [S, H, Dn], [S, H, Dv]
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)  # [S, H, Dn + R]
        q = torch.cat([q_nope[first:last].float(), q_pe[first:last].float()], dim=-1)  # [Tq, H, Dn + R]
        mask = attention_mask(last - first, context_len).to(q.device)
        out[first:last] = dense_attention(q, k, v, mask, scale=scale)
    return out.to(q_nope.dtype)


def mla_decode_attention(q_nope: Tensor, q_pe: Tensor, mla_cache: Tensor, w_uk: Tensor, w_uv: Tensor,
                         block_tables: Tensor, cu_seqlens_q: Tensor, context_lens: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, *, scale: float, kv_scale: Tensor | None = None) -> Tensor:
    """MLA, absorbed form: queries moved into latent space, attention over the cached rows, back through w_uv.

    Arguments and result as in :func:`mla_prefill_attention`. Steps (fp32)::

        q_lat = q_nope @ w_uk                 [T, H, L]      (per head: [Dn] @ [Dn, L])
        o_lat = MQA([q_lat, q_pe] over rows [c_kv, k_pe], values c_kv)       [T, H, L]
        out   = o_lat @ w_uv^T                [T, H, Dv]     (per head: [Dv, L] @ [L])
    """
    num_tokens, num_heads, _ = q_nope.shape
    latent_dim = w_uk.shape[-1]
    q_lat = torch.einsum("thd,hdl->thl", q_nope.float(), w_uk.float())            # [T, H, L]
    q = torch.cat([q_lat, q_pe.float()], dim=-1)                                   # [T, H, L + R]
    o_lat = torch.zeros(num_tokens, num_heads, latent_dim, dtype=torch.float32, device=q_nope.device)
    starts = cu_seqlens_q.tolist()
    for row, context_len in enumerate(context_lens.tolist()):
        first, last = starts[row], starts[row + 1]
        if context_len == 0 or last == first:
            continue
        rows = gather_latent(mla_cache, block_tables[row], context_len, kv_scale)[:, None, :]  # [S, 1, L + R]
        mask = attention_mask(last - first, context_len).to(q.device)
        # One shared key/value "head": every query head reads it (multi-query attention).
        o_lat[first:last] = dense_attention(q[first:last], rows, rows[..., :latent_dim], mask, scale=scale)
    out = torch.einsum("thl,hdl->thd", o_lat, w_uv.float())                        # [T, H, Dv]
    return out.to(q_nope.dtype)
