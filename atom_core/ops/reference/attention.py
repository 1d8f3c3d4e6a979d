"""Reference twins for attention over the paged KV pool: plain torch, written for clarity.

Two twins, checked against each other in the tests:

* ``paged_attention`` gathers each row's keys and values out of the pool into dense tensors
  and runs dense masked attention in fp32 — the definition of correct for the kernels.
* ``naive_attention`` computes each query token and head on its own, looping over the keys it
  may see, in float64 — slow, used only on tiny shapes to check ``paged_attention``.

The mask (bottom-right causal with an optional sliding window). Row r has ``q_len`` query tokens,
the last ones of its ``context_lens[r]``-token context. Query i sits at position
``p = context_lens[r] - q_len + i`` and sees key position j when

    j <= p                      (causal)
    j >  p - sliding_window     (sliding window W: the W keys p-W+1 .. p, itself included)

which is transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``) on top
of its causal mask, as Mistral, Gemma 2/3 and GPT-OSS use it.

Logits: ``s = scale * (q . k)``; with ``logit_softcap`` c > 0, ``s = c * tanh(s / c)`` (before the
mask). ``sinks`` [Hq] add one logit per head to the softmax denominator with no value (GPT-OSS):
``out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))``. GQA: query head h reads kv head
``h // (Hq // Hk)``. Caches in fp8 hold ``k / k_scale``: keys are ``k_cache * k_scale`` (values
likewise); the scales are applied whenever given. Rows with an empty context output zeros.

Legend: T = query tokens of the step, B = rows, Hq / Hk = query / kv heads, D = head dim,
NB = pool blocks, BS = tokens per block, P = pages per row.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_mask(q_len: int, context_len: int, sliding_window: int | None = None) -> Tensor:
    """bool [q_len, context_len]: True where query i (the i-th of the row's last q_len tokens) sees key j."""
    pos = torch.arange(context_len - q_len, context_len).unsqueeze(1)  # p of each query
    key = torch.arange(context_len).unsqueeze(0)
    visible = key <= pos
    if sliding_window is not None:
        visible &= key > pos - sliding_window
    return visible


def gather_context(cache: Tensor, block_table_row: Tensor, context_len: int) -> Tensor:
    """The first ``context_len`` tokens of one row, in position order: [context_len, Hk, D].

    cache: [NB, BS, Hk, D]; block_table_row: int [P], the row's blocks (page i holds positions
    ``i * BS .. i * BS + BS - 1``), padded with -1 past the pages the row uses.
    """
    block_size = cache.shape[1]
    num_pages = -(-context_len // block_size)
    pages = cache[block_table_row[:num_pages].long()]  # [pages, BS, Hk, D]
    return pages.reshape(-1, *cache.shape[2:])[:context_len]


def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float, logit_softcap: float = 0.0,
                    sinks: Tensor | None = None) -> Tensor:
    """Masked softmax attention of one row, in fp32.

    q: [Tq, Hq, D]; k, v: [S, Hk, D]; mask: bool [Tq, S]; sinks: [Hq] or None.
    Returns fp32 [Tq, Hq, D]; a query that sees no key (and has no sink) gets zeros.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # [S, Hq, D], q head h reads kv head h // group
    v = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->hts", q.float(), k) * scale  # [Hq, Tq, S]
    if logit_softcap > 0:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_column = sinks.float().view(num_heads, 1, 1).expand(num_heads, q.shape[0], 1)
        logits = torch.cat([logits, sink_column], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a fully masked query: softmax of all -inf
    if sinks is not None:
        probs = probs[..., :-1]  # the sink takes its share of the denominator, carries no value
    return torch.einsum("hts,shd->thd", probs, v)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, *,
                    scale, sliding_window=None, logit_softcap=0.0, sinks=None, k_scale=None, v_scale=None):
    """Attention of each row's query tokens over its context in the paged pool (see the module docstring).

    q: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hk, D] (q's dtype, or float8_e4m3fn with scales);
    block_tables: int32 [B, P]; cu_seqlens_q: int32 [B+1]; context_lens: int32 [B];
    max_seqlen_q / max_seqlen_k: ints (unused here, part of the op's signature);
    sinks: fp32 [Hq] or None; k_scale, v_scale: fp32 [1] or None.
    Returns [T, Hq, D] in q's dtype.
    """
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    k_mult = 1.0 if k_scale is None else k_scale.float().reshape(())
    v_mult = 1.0 if v_scale is None else v_scale.float().reshape(())
    starts = cu_seqlens_q.tolist()
    for row, context_len in enumerate(context_lens.tolist()):
        first, last = starts[row], starts[row + 1]
        if context_len == 0 or last == first:
            continue
        k = gather_context(k_cache, block_tables[row], context_len).float() * k_mult
        v = gather_context(v_cache, block_tables[row], context_len).float() * v_mult
        mask = attention_mask(last - first, context_len, sliding_window).to(q.device)
        out[first:last] = dense_attention(q[first:last], k, v, mask, scale=scale, logit_softcap=logit_softcap,
                                          sinks=sinks)
    return out.to(q.dtype)


def naive_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, max_seqlen_k, *,
                    scale, sliding_window=None, logit_softcap=0.0, sinks=None, k_scale=None, v_scale=None):
    """The same op one query token and head at a time, over an explicit list of keys, in float64.

    Arguments as in :func:`paged_attention`. Slow; for checking it on tiny shapes.
    """
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    k_mult = 1.0 if k_scale is None else float(k_scale.reshape(()))
    v_mult = 1.0 if v_scale is None else float(v_scale.reshape(()))
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    starts = cu_seqlens_q.tolist()
    tables = block_tables.tolist()
    for row, context_len in enumerate(context_lens.tolist()):
        q_len = starts[row + 1] - starts[row]
        for i in range(q_len):
            t = starts[row] + i
            pos = context_len - q_len + i
            keys = [j for j in range(context_len) if j <= pos and (sliding_window is None or j > pos - sliding_window)]
            for head in range(q.shape[1]):
                kv_head = head // group
                logits, values = [], []
                for j in keys:
                    block, offset = tables[row][j // block_size], j % block_size
                    k = k_cache[block, offset, kv_head].double() * k_mult
                    s = scale * float(torch.dot(q[t, head].double(), k))
                    if logit_softcap > 0:
                        s = logit_softcap * math.tanh(s / logit_softcap)
                    logits.append(s)
                    values.append(v_cache[block, offset, kv_head].double() * v_mult)
                sink = None if sinks is None else float(sinks[head])
                if not logits:
                    continue  # nothing to attend to: zeros (a sink alone carries no value)
                top = max(logits + ([sink] if sink is not None else []))
                weights = [math.exp(s - top) for s in logits]
                denominator = sum(weights) + (math.exp(sink - top) if sink is not None else 0.0)
                out[t, head] = sum(w * v for w, v in zip(weights, values)) / denominator
    return out.to(q.dtype)
