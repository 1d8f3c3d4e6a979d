"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

Legend: V = vocabulary (``num_embeddings``), D = embedding dim, R = tp_size, T = tokens,
N = rows whose logits are wanted.

The vocabulary is padded to a multiple of R and cut into R contiguous ranges
(``sharding.vocab_shard``); rank r holds rows ``[start, start + V_pad / R)``. Padding rows are
zero and never reach the caller: the embedding treats their ids as out of range and the LM
head cuts their logits off.

With R > 1 the ranks combine over ``tp_group`` (the process group of the R ranks, this process its
rank ``tp_rank``), through ``ops.all_reduce`` (embedding) and ``ops.all_gather`` (LM head), never over
``torch.distributed``'s default group (``models.parallel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.models.layers.linear import check_shape, copy_into
from atom_core.models.layers.sharding import check_tp, vocab_shard
from atom_core.models.parallel import check_group, gather_over, reduce_over


class VocabParallelEmbedding(nn.Module):
    """``input_ids [T] int -> [T, D]``; rank r looks up only the ids in its vocabulary range.

    With R > 1 ids outside the range give zero rows and the ranks' outputs are summed over
    ``tp_group`` (exactly one rank holds each id); ``reduce_results=False`` returns this rank's
    masked rows instead (the caller sums, e.g. fused with what follows).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype | None = None, tp_group=None, reduce_results: bool = True) -> None:
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        check_tp(tp_rank, tp_size)
        check_group(tp_group, tp_rank, tp_size, type(self).__name__)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group  # a torch.distributed ProcessGroup of the tp_size ranks, or None
        self.reduce_results = reduce_results
        self.vocab_start, self.rows_per_rank, self.real_rows = vocab_shard(num_embeddings, tp_rank, tp_size)
        weight = torch.empty(self.rows_per_rank, embedding_dim, dtype=dtype or torch.get_default_dtype())
        weight[self.real_rows:] = 0  # padding rows: zero so they contribute nothing
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.label = f"{type(self).__name__}.weight"
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Copy rows ``[start, start + real_rows)`` of the full ``[V, ...]`` checkpoint tensor."""
        if shard_id is not None:
            raise ValueError(f"{param.label} is not fused; got shard_id={shard_id!r}")
        check_shape(param.label, loaded_weight, (self.num_embeddings, *param.shape[1:]))
        if self.real_rows > 0:  # a rank may hold only padding rows (tiny vocab, many ranks)
            copy_into(param.data[: self.real_rows], loaded_weight.narrow(0, self.vocab_start, self.real_rows))
        with torch.no_grad():
            param.data[self.real_rows:] = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int32/int64 in [0, V) -> [T, D] in the weight's dtype."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_range = (local >= 0) & (local < self.real_rows)
        out = F.embedding(torch.where(in_range, local, torch.zeros_like(local)), self.weight)
        out = out.masked_fill(~in_range.unsqueeze(-1), 0)
        if self.reduce_results:
            out = reduce_over(out, self.tp_group, self.tp_size, self)
        return out

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"tp_rank={self.tp_rank}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """``hidden [N, D] -> logits [N, V]``: each rank computes its vocabulary range, then all-gather over
    ``tp_group`` (in group-rank order: rank r's range is ``[r V_pad / R, (r + 1) V_pad / R)``).

    ``tie_to(embedding)`` shares the embedding's weight (tied word embeddings); the shared
    parameter then appears once in ``named_parameters()``, under the embedding's name.
    The optional bias is split like the weight's rows.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, *,
                 tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype | None = None, tp_group=None) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype,
                         tp_group=tp_group)
        if bias:
            b = torch.zeros(self.rows_per_rank, dtype=dtype or torch.get_default_dtype())
            self.bias = nn.Parameter(b, requires_grad=False)
            self.bias.label = f"{type(self).__name__}.bias"
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def tie_to(self, embedding: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share ``embedding.weight`` (same vocabulary, dim and sharding required); returns self."""
        if not isinstance(embedding, VocabParallelEmbedding):
            raise TypeError(f"embedding must be a VocabParallelEmbedding, got {type(embedding).__name__}")
        mine = (self.num_embeddings, self.embedding_dim, self.tp_rank, self.tp_size)
        theirs = (embedding.num_embeddings, embedding.embedding_dim, embedding.tp_rank, embedding.tp_size)
        if mine != theirs:
            raise ValueError(
                f"cannot tie: (num_embeddings, embedding_dim, tp_rank, tp_size) differ: {mine} vs {theirs}"
            )
        self.weight = embedding.weight
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> logits [N, V] in the weight's dtype."""
        logits = F.linear(hidden, self.weight, self.bias)  # [N, V_pad / R]
        if self.tp_size > 1:
            logits = gather_over(logits, self.tp_group, self.tp_size, self, dim=-1)  # [N, V_pad]
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits
