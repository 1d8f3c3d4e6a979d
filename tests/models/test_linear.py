"""Parallel linears and embeddings: each rank's weight_loader takes exactly its rows/columns.

Expected pieces are cut with ``torch.chunk`` / head index lists written out here, never with
the sharding helpers under test.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_core.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_core.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

TP_SIZES = st.sampled_from([1, 2, 4, 8])
SETTINGS = settings(max_examples=25, deadline=None)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@SETTINGS
@given(tp_size=TP_SIZES, out_per_rank=st.integers(1, 6), in_size=st.integers(1, 9), bias=st.booleans())
def test_column_parallel_rows(tp_size, out_per_rank, in_size, bias):
    out_size = out_per_rank * tp_size
    w = torch.randn(out_size, in_size, generator=_gen(0))
    b = torch.randn(out_size, generator=_gen(1))
    pieces_w, pieces_b = [], []
    for rank in range(tp_size):
        layer = ColumnParallelLinear(in_size, out_size, bias, tp_rank=rank, tp_size=tp_size)
        layer.weight.weight_loader(layer.weight, w)
        assert torch.equal(layer.weight, w.chunk(tp_size, dim=0)[rank])
        pieces_w.append(layer.weight.clone())
        if bias:
            layer.bias.weight_loader(layer.bias, b)
            pieces_b.append(layer.bias.clone())
            x = torch.randn(3, in_size, generator=_gen(2))
            torch.testing.assert_close(layer(x), (x @ w.T + b).chunk(tp_size, dim=-1)[rank])
    assert torch.equal(torch.cat(pieces_w), w)
    if bias:
        assert torch.equal(torch.cat(pieces_b), b)


@SETTINGS
@given(tp_size=TP_SIZES, in_per_rank=st.integers(1, 6), out_size=st.integers(1, 9), bias=st.booleans())
def test_row_parallel_columns_and_partial_sums(tp_size, in_per_rank, out_size, bias):
    in_size = in_per_rank * tp_size
    w = torch.randn(out_size, in_size, generator=_gen(0), dtype=torch.float64)
    b = torch.randn(out_size, generator=_gen(1), dtype=torch.float64)
    x = torch.randn(5, in_size, generator=_gen(2), dtype=torch.float64)
    total = torch.zeros(5, out_size, dtype=torch.float64)
    pieces = []
    for rank in range(tp_size):
        layer = RowParallelLinear(in_size, out_size, bias, reduce_results=False, tp_rank=rank,
                                  tp_size=tp_size, dtype=torch.float64)
        layer.weight.weight_loader(layer.weight, w)
        if bias:
            layer.bias.weight_loader(layer.bias, b)
            assert torch.equal(layer.bias, b)  # bias replicated on every rank
        assert torch.equal(layer.weight, w.chunk(tp_size, dim=1)[rank])
        pieces.append(layer.weight.clone())
        total += layer(x.chunk(tp_size, dim=1)[rank])  # what all_reduce would sum
    assert torch.equal(torch.cat(pieces, dim=1), w)
    # Summed partial products equal the full layer, with the bias counted once.
    torch.testing.assert_close(total, x @ w.T + (b if bias else 0))


@SETTINGS
@given(tp_size=TP_SIZES, sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3), in_size=st.integers(1, 7))
def test_merged_column_parallel_separate_and_fused_loads(tp_size, sizes, in_size):
    output_sizes = [s * tp_size for s in sizes]
    parts = [torch.randn(o, in_size, generator=_gen(i)) for i, o in enumerate(output_sizes)]
    for rank in range(tp_size):
        expected = torch.cat([p.chunk(tp_size, dim=0)[rank] for p in parts])
        separate = MergedColumnParallelLinear(in_size, output_sizes, tp_rank=rank, tp_size=tp_size)
        for shard_id, p in enumerate(parts):
            separate.weight.weight_loader(separate.weight, p, shard_id)
        assert torch.equal(separate.weight, expected)
        fused = MergedColumnParallelLinear(in_size, output_sizes, tp_rank=rank, tp_size=tp_size)
        fused.weight.weight_loader(fused.weight, torch.cat(parts))
        assert torch.equal(fused.weight, expected)


def test_merged_gate_up_output_layout():
    # Rank output is [gate_r | up_r]; with tp 1 that is x @ [Wg; Wu].T
    wg, wu = torch.randn(4, 3, generator=_gen(0)), torch.randn(4, 3, generator=_gen(1))
    layer = MergedColumnParallelLinear(3, [4, 4])
    layer.weight.weight_loader(layer.weight, wg, 0)
    layer.weight.weight_loader(layer.weight, wu, 1)
    x = torch.randn(2, 3, generator=_gen(2))
    gate, up = layer(x).split([4, 4], dim=-1)
    torch.testing.assert_close(gate, x @ wg.T)
    torch.testing.assert_close(up, x @ wu.T)


@st.composite
def qkv_shapes(draw):
    tp_size = draw(TP_SIZES)
    num_kv_heads = draw(st.sampled_from([k for k in (1, 2, 4, 8, 16) if k % tp_size == 0 or tp_size % k == 0]))
    group = draw(st.sampled_from([1, 2, 4]))
    num_heads = num_kv_heads * group
    if num_heads % tp_size:
        num_heads = tp_size * group
        num_kv_heads = num_heads // group
    return num_heads, num_kv_heads, draw(st.sampled_from([2, 4])), tp_size, draw(st.booleans())


def _head_rows(w, heads, head_dim):
    return torch.cat([w[h * head_dim:(h + 1) * head_dim] for h in heads])


@SETTINGS
@given(shape=qkv_shapes())
def test_qkv_parallel_heads_per_rank(shape):
    num_heads, num_kv_heads, head_dim, tp_size, bias = shape
    hidden = 5
    wq = torch.randn(num_heads * head_dim, hidden, generator=_gen(0))
    wk = torch.randn(num_kv_heads * head_dim, hidden, generator=_gen(1))
    wv = torch.randn(num_kv_heads * head_dim, hidden, generator=_gen(2))
    bq, bk, bv = (torch.randn(t.shape[0], generator=_gen(3 + i)) for i, t in enumerate((wq, wk, wv)))
    heads_per_rank = num_heads // tp_size
    group = num_heads // num_kv_heads
    x = torch.randn(3, hidden, generator=_gen(9))
    all_q = []
    for rank in range(tp_size):
        layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias, tp_rank=rank, tp_size=tp_size)
        q_heads = list(range(rank * heads_per_rank, (rank + 1) * heads_per_rank))
        kv_heads = sorted({h // group for h in q_heads})  # the KV heads those query heads read
        assert (layer.num_heads, layer.num_kv_heads) == (len(q_heads), len(kv_heads))
        params = [(layer.weight, (wq, wk, wv))] + ([(layer.bias, (bq, bk, bv))] if bias else [])
        for param, (q, k, v) in params:
            for sid, t in zip("qkv", (q, k, v)):
                param.weight_loader(param, t, sid)
            expected = torch.cat([_head_rows(q, q_heads, head_dim), _head_rows(k, kv_heads, head_dim),
                                  _head_rows(v, kv_heads, head_dim)])
            assert torch.equal(param, expected)
            fused = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias,
                                      tp_rank=rank, tp_size=tp_size)
            fp = fused.weight if param.dim() == 2 else fused.bias
            fp.weight_loader(fp, torch.cat([q, k, v]))
            assert torch.equal(fp, expected)
        out_q, out_k, _ = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        full_k = x @ wk.T + (bk if bias else 0)
        torch.testing.assert_close(out_k, _head_rows(full_k.T, kv_heads, head_dim).T)
        all_q.append(out_q)
    torch.testing.assert_close(torch.cat(all_q, dim=-1), x @ wq.T + (bq if bias else 0))


def test_replicated_linear_loads_whole_tensor_and_casts_dtype():
    layer = ReplicatedLinear(3, 2, bias=True, dtype=torch.bfloat16)
    w = torch.randn(2, 3, generator=_gen(0))
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, torch.ones(2))
    assert layer.weight.dtype == torch.bfloat16 and not layer.weight.requires_grad
    assert torch.equal(layer.weight, w.to(torch.bfloat16))
    x = torch.randn(4, 3, generator=_gen(1)).to(torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, w.to(torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)))


@pytest.mark.parametrize(
    "make,loaded,shard_id,match",
    [
        (lambda: ReplicatedLinear(3, 2), torch.zeros(3, 2), None, r"ReplicatedLinear.weight.*\(3, 2\).*\(2, 3\)"),
        (lambda: ColumnParallelLinear(3, 4, tp_rank=1, tp_size=2), torch.zeros(2, 3), None,
         r"ColumnParallelLinear.weight.*\(2, 3\).*\(4, 3\)"),
        (lambda: RowParallelLinear(4, 3, tp_rank=0, tp_size=2), torch.zeros(3, 2), None,
         r"RowParallelLinear.weight.*\(3, 2\).*\(3, 4\)"),
        (lambda: MergedColumnParallelLinear(3, [2, 4]), torch.zeros(2, 3), 1,
         r"MergedColumnParallelLinear.weight\[shard 1\].*\(2, 3\).*\(4, 3\)"),
        (lambda: QKVParallelLinear(6, 2, 4, 2), torch.zeros(8, 6), "k", r"QKVParallelLinear.weight\[k\].*\(8, 6\).*\(4, 6\)"),
        (lambda: QKVParallelLinear(6, 2, 4, 2), torch.zeros(4, 6), "x", "shard_id must be 'q', 'k' or 'v'"),
        (lambda: MergedColumnParallelLinear(3, [2, 4]), torch.zeros(2, 3), 2, r"shard_id must be an index"),
        (lambda: ColumnParallelLinear(3, 4), torch.zeros(4, 3), "q", "not fused"),
    ],
)
def test_weight_loader_refuses_bad_input(make, loaded, shard_id, match):
    layer = make()
    with pytest.raises(ValueError, match=match):
        if shard_id is None:
            layer.weight.weight_loader(layer.weight, loaded)
        else:
            layer.weight.weight_loader(layer.weight, loaded, shard_id)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ColumnParallelLinear(4, 6, tp_size=4),
        lambda: RowParallelLinear(6, 4, tp_size=4),
        lambda: MergedColumnParallelLinear(4, [4, 6], tp_size=4),
        lambda: QKVParallelLinear(8, 2, 6, 6, tp_size=4),
        lambda: ColumnParallelLinear(0, 4),
        lambda: MergedColumnParallelLinear(4, []),
    ],
)
def test_constructors_refuse_uneven_or_empty_sizes(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("make, match", [
    (lambda: ColumnParallelLinear(4, 6, tp_size=4, prefix="model.layers.3.x"), r"model\.layers\.3\.x: output_size=6"),
    (lambda: RowParallelLinear(6, 4, tp_size=4, prefix="model.layers.3.x"), r"model\.layers\.3\.x: input_size=6"),
    (lambda: MergedColumnParallelLinear(4, [4, 6], tp_size=4, prefix="model.layers.3.x"),
     r"model\.layers\.3\.x: output_sizes\[1\]=6"),
    (lambda: QKVParallelLinear(8, 2, 6, 6, tp_size=4), r"num_heads \(num_attention_heads\)=6"),
])
def test_an_uneven_split_is_refused_naming_the_layer_and_the_size(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@SETTINGS
@given(tp_size=TP_SIZES, vocab=st.integers(1, 30))
def test_vocab_parallel_embedding_shards_and_masked_sum(tp_size, vocab):
    dim = 3
    table = torch.randn(vocab, dim, generator=_gen(0))
    ids = torch.arange(vocab).flip(0)
    rows_per_rank = -(-vocab // tp_size)  # ceil(vocab / tp_size)
    padded = torch.cat([table, torch.zeros(rows_per_rank * tp_size - vocab, dim)])
    total = torch.zeros(vocab, dim)
    for rank in range(tp_size):
        # reduce_results=False: each rank's masked partial, summed below instead of by the collective
        emb = VocabParallelEmbedding(vocab, dim, tp_rank=rank, tp_size=tp_size, reduce_results=False)
        emb.weight.weight_loader(emb.weight, table)
        assert torch.equal(emb.weight, padded.chunk(tp_size, dim=0)[rank])
        total += emb(ids)
    assert torch.equal(total, table[ids])  # each id found on exactly one rank


@SETTINGS
@given(tp_size=TP_SIZES, vocab=st.integers(1, 30))
def test_lm_head_rank_logits_are_its_vocab_columns(tp_size, vocab):
    dim = 4
    table = torch.randn(vocab, dim, generator=_gen(0))
    hidden = torch.randn(2, dim, generator=_gen(1))
    rows_per_rank = -(-vocab // tp_size)
    full = torch.cat([hidden @ table.T, torch.zeros(2, rows_per_rank * tp_size - vocab)], dim=-1)
    for rank in range(tp_size):
        head = ParallelLMHead(vocab, dim, tp_rank=rank, tp_size=tp_size)
        head.weight.weight_loader(head.weight, table)
        # The per-rank product before the all-gather: this rank's contiguous columns.
        torch.testing.assert_close(F.linear(hidden, head.weight), full.chunk(tp_size, dim=-1)[rank])


def test_lm_head_tp1_tied_and_bias():
    table = torch.randn(7, 4, generator=_gen(0))
    emb = VocabParallelEmbedding(7, 4)
    emb.weight.weight_loader(emb.weight, table)
    head = ParallelLMHead(7, 4, bias=True).tie_to(emb)
    assert head.weight is emb.weight
    head.bias.weight_loader(head.bias, torch.arange(7.0))
    hidden = torch.randn(3, 4, generator=_gen(1))
    torch.testing.assert_close(head(hidden), hidden @ table.T + torch.arange(7.0))
    with pytest.raises(ValueError, match="cannot tie"):
        ParallelLMHead(8, 4).tie_to(emb)
    with pytest.raises(ValueError, match=r"\(5, 4\).*\(7, 4\)"):
        emb.weight.weight_loader(emb.weight, torch.zeros(5, 4))


# --- real collectives: two gloo processes ------------------------------------------------


def _two_rank_worker(rank, init_file, result_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        w_row, b_row = torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
        table = torch.randn(5, 4, generator=g)  # vocab 5 over 2 ranks: padded to 6
        x = torch.randn(2, 4, generator=g)
        group = dist.new_group([0, 1])  # the layers reduce over the group they are given
        row = RowParallelLinear(4, 3, bias=True, tp_rank=rank, tp_size=2, tp_group=group)
        row.weight.weight_loader(row.weight, w_row)
        row.bias.weight_loader(row.bias, b_row)
        emb = VocabParallelEmbedding(5, 4, tp_rank=rank, tp_size=2, tp_group=group)
        emb.weight.weight_loader(emb.weight, table)
        head = ParallelLMHead(5, 4, tp_rank=rank, tp_size=2, tp_group=group).tie_to(emb)
        ids = torch.tensor([4, 0, 2, 3])
        out = {"row": row(x.chunk(2, dim=1)[rank]), "emb": emb(ids), "logits": head(x)}
        torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_real_ranks_reduce_and_gather():
    with tempfile.TemporaryDirectory() as tmp:
        # fork: the children reuse the imported torch instead of importing it again
        mp.start_processes(_two_rank_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=True,
                           start_method="fork")
        outs = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    w_row, b_row = torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    table = torch.randn(5, 4, generator=g)
    x = torch.randn(2, 4, generator=g)
    for out in outs:  # every rank ends with the full result
        torch.testing.assert_close(out["row"], x @ w_row.T + b_row)
        torch.testing.assert_close(out["emb"], table[torch.tensor([4, 0, 2, 3])])
        torch.testing.assert_close(out["logits"], x @ table.T)
