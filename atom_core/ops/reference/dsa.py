"""Reference twins of DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): the write of the lightning
indexer's keys into their paged cache, the indexer's scores and top-k over each row's context, and MLA
attention restricted to the selected tokens. Plain torch, fp32 math.

Legend: T = query tokens of the step, B = rows, Hi = indexer heads (``index_n_heads``), Di = indexer
head dim (``index_head_dim``), K = ``index_topk``, S = a row's context length, H = MLA query heads,
L = kv_lora_rank, R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim, NB = pool blocks,
BS = block size, P = pages per row.

**The indexer cache.** One key row of Di numbers per token and indexer layer, in a pool ``[NB, BS, Di]``
indexed by the same slots (block tables, slot_mapping) as the MLA latent pool::

    k_idx = k_norm(wk(x))            [Di]    LayerNorm with bias; its first R dims then rotated (rope)

in the model's dtype, or (an FP8 KV cache) as float8_e4m3fn with one fp32 scale per token beside it,
``indexer_scale [NB, BS]`` (``k_idx ~ cache * k_scale``, k_scale = amax / 448: DeepSeek's release keeps its
indexer keys so, one 128-wide block a token). A positive per-key scale commutes with the relu, so a kernel
may apply it after the head sum: ``I[t, s] = k_scale[s] * sum_h w[t, h] relu(Di^-1/2 q_idx[t, h] . cache[s])``.
Against fp8 keys the queries are rounded to e4m3 too, one scale per (token, head) (``indexer_queries``), as
DeepSeek's indexer does, so a kernel can take both dot operands in e4m3: with q_idx = q_hat * q_scale,
``I[t, s] = k_scale[s] * sum_h (w[t, h] q_scale[t, h]) relu(Di^-1/2 q_hat[t, h] . cache[s])``.

**The index score** of query token t (position p in its row) against context token s (s <= p)::

    I[t, s] = sum_h w[t, h] * relu(scale * q_idx[t, h] . k_idx[s])      (scale = Di^-1/2)

with ``q_idx = wq_b(q_a_layernorm(q_a_proj(x)))`` [Hi, Di] (first R dims rotated) and
``w = weights_proj(x) * Hi^-1/2`` [Hi] fp32. Query t keeps the ``min(K, p + 1)`` context tokens of highest
score: ``topk_indices[t]`` [K] int32 holds their positions in the row's sequence (0 .. p), -1 in the
unused entries (a query at position p < K - 1 keeps all of its p + 1 tokens: DSA is then dense MLA).
Which of several exactly tied tokens is kept, and the order of the kept positions, are not specified
(the twin: ``torch.topk``'s, descending score). DeepSeek's own inference code rotates q and k by a
Hadamard matrix and scores them in fp8; the Hadamard rotation leaves every dot product unchanged and
fp8 is a precision shortcut, so over 16-bit keys the twin (like HF transformers) scores unrotated, in fp32;
over fp8 keys (an fp8 KV cache) it rounds q as DeepSeek does (above), still unrotated.

**Sparse attention.** MLA in its absorbed form (``reference.mla.mla_decode_attention``), each query
attending only to the cached rows at its selected positions::

    q_lat = q_nope @ w_uk                                               [T, H, L]
    o_lat[t, h] = sum_{s in sel(t)} softmax_s(scale * [q_lat, q_pe] . row[s]) c_kv[s]       [L]
    out = o_lat @ w_uv^T                                                 [T, H, Dv]

The twin gathers the row's whole context and masks (dense-masked); a kernel reads only the K selected
rows per query (the point of DSA: O(K) instead of O(S) per query token).
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_core.ops.reference.attention import attention_mask, dense_attention, gather_context
from atom_core.ops.reference.mla import gather_latent
from atom_core.ops.reference.quant import FP8_DTYPE, per_token_quant


def store_indexer_k_(k: Tensor, indexer_cache: Tensor, slot_mapping: Tensor, indexer_scale: Tensor | None = None,
                     ) -> None:
    """Write ``k[t]`` (Di numbers) at slot ``s = slot_mapping[t]`` of ``indexer_cache`` ``[NB, BS, Di]``:
    block s // BS, offset s % BS; s == -1 writes nothing. k: [T, Di]; stored cast to the cache's dtype, or,
    for a float8_e4m3fn cache, quantized per token (``reference.quant.per_token_quant``: scale =
    max(amax(k[t]), AMAX_FLOOR) / 448, one IEEE division) with the scale written at the same slot of
    ``indexer_scale`` fp32 [NB, BS] (the key is ``cache * scale``)."""
    block_size = indexer_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    if indexer_cache.dtype == FP8_DTYPE:
        q, token_scale = per_token_quant(k[keep], FP8_DTYPE)
        indexer_cache[blocks, offsets] = q
        indexer_scale[blocks, offsets] = token_scale[:, 0]
    else:
        indexer_cache[blocks, offsets] = k[keep].to(indexer_cache.dtype)


def indexer_keys(indexer_cache: Tensor, indexer_scale: Tensor | None) -> Tensor:
    """The keys the cache holds, [NB, BS, Di]: the cache itself, or an fp8 cache times its per-slot scales (fp32)."""
    if indexer_cache.dtype != FP8_DTYPE:
        return indexer_cache
    return indexer_cache.float() * indexer_scale.float()[..., None]


def indexer_queries(q: Tensor, indexer_cache: Tensor) -> Tensor:
    """The queries as scored, [T, Hi, Di]: q itself, or against an fp8 cache q rounded to e4m3 too, one scale a
    (token, head) (``per_token_quant`` of its Di values; fp32, dequantized), as DeepSeek's indexer scores."""
    if indexer_cache.dtype != FP8_DTYPE:
        return q
    q_hat, q_scale = per_token_quant(q.reshape(-1, q.shape[-1]), FP8_DTYPE)
    return (q_hat.float() * q_scale).view(q.shape)


def index_scores(q: Tensor, weights: Tensor, keys: Tensor, *, scale: float) -> Tensor:
    """``I[t, s] = sum_h weights[t, h] relu(scale q[t, h] . keys[s])`` in fp32.

    q: [Tq, Hi, Di]; weights: [Tq, Hi]; keys: [S, Di]. Returns fp32 [Tq, S]."""
    logits = torch.einsum("thd,sd->ths", q.float(), keys.float()) * scale         # [Tq, Hi, S]
    return torch.einsum("th,ths->ts", weights.float(), torch.relu(logits))


def indexer_topk(q: Tensor, weights: Tensor, indexer_cache: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor,
                 context_lens: Tensor, max_seqlen_q: int, max_seqlen_k: int, *, topk: int, scale: float,
                 indexer_scale: Tensor | None = None) -> Tensor:
    """Each query token's ``min(topk, p + 1)`` context positions of highest index score (module docstring).

    q: [T, Hi, Di] (rotated); weights: fp32 [T, Hi]; indexer_cache: [NB, BS, Di] (this step's keys written;
    float8_e4m3fn with indexer_scale fp32 [NB, BS]: the keys are ``indexer_keys``, dequantized, and q is
    scored as ``indexer_queries``, rounded to e4m3 a head at a time);
    block_tables int32 [B, P]; cu_seqlens_q int32 [B + 1]; context_lens int32 [B]; max_seqlen_q /
    max_seqlen_k: ints (unused here, part of the op's signature); topk: K >= 1; scale: Di^-1/2.
    Returns int32 [T, K]: positions in the row's sequence, -1 padded (all -1 for tokens of rows with an
    empty context). Query i of row r sits at position ``context_lens[r] - q_len + i`` (bottom-right causal).
    """
    num_tokens = q.shape[0]
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    starts = cu_seqlens_q.tolist()
    pool = indexer_keys(indexer_cache, indexer_scale)
    q = indexer_queries(q, indexer_cache)
    for row, context_len in enumerate(context_lens.tolist()):
        first, last = starts[row], starts[row + 1]
        if context_len == 0 or last == first:
            continue
        keys = gather_context(pool.unsqueeze(2), block_tables[row], context_len)[:, 0]  # [S, Di]
        scores = index_scores(q[first:last], weights[first:last], keys, scale=scale)          # [Tq, S]
        visible = attention_mask(last - first, context_len).to(q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(topk, context_len)
        values, positions = scores.topk(k, dim=-1)                                            # [Tq, k]
        positions = positions.to(torch.int32).masked_fill(values == float("-inf"), -1)
        out[first:last, :k] = positions
    return out


def selected_mask(topk_indices: Tensor, context_len: int) -> Tensor:
    """bool [Tq, S]: True at the positions each query selected (-1 entries ignored). topk_indices: [Tq, K]."""
    mask = torch.zeros(topk_indices.shape[0], context_len + 1, dtype=torch.bool, device=topk_indices.device)
    index = topk_indices.long().clamp(min=-1, max=context_len)
    index = torch.where(index < 0, context_len, index)  # -1 -> a spare column, dropped below
    mask.scatter_(1, index, True)
    return mask[:, :context_len]


def mla_sparse_attention(q_nope: Tensor, q_pe: Tensor, mla_cache: Tensor, w_uk: Tensor, w_uv: Tensor,
                         topk_indices: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor, context_lens: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, *, scale: float,
                         kv_scale: Tensor | None = None) -> Tensor:
    """MLA (absorbed form) over each query's selected positions only.

    Arguments as ``reference.mla.mla_decode_attention``, plus topk_indices: int32 [T, K], positions in the
    row's sequence (each in [0, p] for the query at position p, distinct), -1 = no entry. A query with no
    entry outputs zeros. Returns [T, H, Dv] in q_nope's dtype.
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
        mask = selected_mask(topk_indices[first:last], context_len)
        o_lat[first:last] = dense_attention(q[first:last], rows, rows[..., :latent_dim], mask, scale=scale)
    out = torch.einsum("thl,hdl->thd", o_lat, w_uv.float())                        # [T, H, Dv]
    return out.to(q_nope.dtype)
