"""Tensor-parallel layers: every rank's shard, combined as the collectives would
combine them, reproduces the unsharded layer. The collectives are simulated in
one process: each rank returns its local partial and the test sums/concatenates.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.layers.embedding import LMHead, VocabEmbedding
from kvrunner.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
)

F32 = dict(dtype=torch.float32, device="cpu")


def rank(r: int, size: int) -> TPGroup:
    """A rank whose collectives return the local tensor (the test combines ranks)."""
    return TPGroup(rank=r, size=size, all_reduce=lambda t: t, all_gather=lambda t: t)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_column_then_row_parallel_equals_dense(size: int) -> None:
    w1, w2, x = randn(16, 8, seed=1), randn(8, 16, seed=2), randn(5, 8, seed=3)
    partials = []
    for r in range(size):
        col = ColumnParallelLinear(8, 16, tp=rank(r, size), **F32)
        row = RowParallelLinear(16, 8, tp=rank(r, size), **F32)
        col.weight.weight_loader(col.weight, w1)
        row.weight.weight_loader(row.weight, w2)
        partials.append(row(col(x)))
    torch.testing.assert_close(sum(partials), x @ w1.T @ w2.T)


@given(st.sampled_from([(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 1, 4), (6, 6, 3)]))
def test_qkv_shards_hold_the_right_heads(shape) -> None:
    heads, kv_heads, size = shape
    d, hidden = 4, 8
    wq, wk, wv = (randn(n * d, hidden, seed=s) for s, n in enumerate((heads, kv_heads, kv_heads)))
    x = randn(3, hidden, seed=9)
    for r in range(size):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, tp=rank(r, size), **F32)
        for shard, w in zip("qkv", (wq, wk, wv), strict=True):
            layer.weight.weight_loader(layer.weight, w, shard)
        q, k, v = layer.split(layer(x))
        hq = heads // size
        kv_index = r * kv_heads // size  # replicated when kv_heads < size
        nkv = max(kv_heads // size, 1)
        torch.testing.assert_close(q, (x @ wq.T)[:, r * hq * d : (r + 1) * hq * d])
        torch.testing.assert_close(k, (x @ wk.T)[:, kv_index * d : (kv_index + nkv) * d])
        torch.testing.assert_close(v, (x @ wv.T)[:, kv_index * d : (kv_index + nkv) * d])


@pytest.mark.parametrize("size", [1, 2])
def test_merged_gate_up_is_rank_local(size: int) -> None:
    gate, up, x = randn(12, 8, seed=1), randn(12, 8, seed=2), randn(2, 8, seed=3)
    for r in range(size):
        layer = MergedColumnParallelLinear(8, [12, 12], tp=rank(r, size), **F32)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        g, u = layer(x).chunk(2, dim=-1)
        n = 12 // size
        torch.testing.assert_close(g, (x @ gate.T)[:, r * n : (r + 1) * n])
        torch.testing.assert_close(u, (x @ up.T)[:, r * n : (r + 1) * n])


@pytest.mark.parametrize("size", [1, 2, 4])
def test_vocab_parallel_embedding_and_head_with_padding(size: int) -> None:
    vocab, hidden = 10, 6  # 10 rows over 4 ranks: the last rank is mostly padding
    table, h = randn(vocab, hidden, seed=1), randn(3, hidden, seed=2)
    ids = torch.tensor([0, 9, 4, 5, 2])
    looked_up, logits = [], []
    for r in range(size):
        emb = VocabEmbedding(vocab, hidden, tp=rank(r, size), **F32)
        emb.weight.weight_loader(emb.weight, table)
        head = LMHead(vocab, hidden, tp=rank(r, size), tied_to=emb, **F32)
        looked_up.append(emb(ids))
        logits.append(head(h))  # this rank's columns (the fake gather is the identity)
    torch.testing.assert_close(sum(looked_up), table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], h @ table.T)


def test_bad_splits_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        QKVParallelLinear(8, 4, 4, 2, tp=rank(0, 3), **F32)
    layer = ColumnParallelLinear(8, 16, **F32)
    with pytest.raises(ValueError, match="expected 16 along dim 0"):
        layer.weight.weight_loader(layer.weight, torch.zeros(15, 8))
    with pytest.raises(ValueError, match="needs all_reduce"):
        TPGroup(rank=0, size=2)
