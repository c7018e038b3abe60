"""Deterministic mode's attention in plain torch (no Triton import: the CPU path): every
token attended in one fixed order.

The default torch paths attend a decode batch as one padded SDPA call (its width is
the batch's longest context, so a row's sums change with its neighbours) and a
prefill one sequence at a time through SDPA, a different reduction again. Here every
query, in prefill or in decode, is attended the same way: its sequence's keys from
position 0 in tiles of :data:`KEY_TILE`, each tile folded into a running max, sum and
accumulator (an online softmax) in float32. Every reduction is over the last
dimension of a tensor whose shape per query is fixed (head dim, tile width), and a
tile past a query's own position is an exact no-op for it (its scores are -inf:
``alpha`` is 1 and it adds zeros), so a token's output depends on its own query and
its sequence's keys alone: not on the other queries of its chunk, the chunk size,
the other sequences of the step, or whether its prefix was cached.
"""

from __future__ import annotations

import torch

from kvrunner_paged.kv_format import K_SCALE, V_SCALE
from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs
from kvrunner_paged.ops.utils import dequantized, gather_positions

#: keys per step of the online softmax: the split-KV size, fixed in keys
KEY_TILE = 32


def fixed_order_attention_torch(*, inputs: PagedAttentionInputs) -> torch.Tensor:
    """Causal varlen attention over the paged pool, as
    :func:`~kvrunner_paged.ops.paged_attention.prefill_torch.paged_prefill_attention_torch`
    computes it (decode rows are sequences of one query), in the fixed order above:
    ``[T, num_heads, head_dim]`` in q's dtype, rows owned by no sequence 0. The pool
    must already hold this step's keys and values."""
    x = inputs
    x.sequences(varlen=True)
    q = x.q
    out = torch.zeros_like(q)
    heads, kv_heads = q.shape[1], x.k_cache.shape[2]
    group = heads // kv_heads
    tile = torch.arange(KEY_TILE, device=q.device)
    for i, lo, hi, ctx in x.sequence_rows():
        q_len = hi - lo
        width = -(-ctx // KEY_TILE) * KEY_TILE
        positions = torch.arange(width, device=q.device)
        inside = (positions < ctx)[:, None, None]
        read = positions.clamp(max=ctx - 1)  # never past the context: no stale slot
        # float32, an FP8 pool's values times their head's scale
        keys = dequantized(gather_positions(x.k_cache, x.block_tables[i], read), x.scales,
                           K_SCALE, torch.float32).where(inside, 0.0)
        values = dequantized(gather_positions(x.v_cache, x.block_tables[i], read), x.scales,
                             V_SCALE, torch.float32).where(inside, 0.0)
        # [heads, width, dim] and [heads, dim, width]: every sum below is over the last dim
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1).contiguous()
        values = values.repeat_interleave(group, dim=1).permute(1, 2, 0).contiguous()
        query = q[lo:hi].float()  # [q_len, heads, dim]
        query_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        m = torch.full((q_len, heads), float("-inf"), device=q.device)
        total = torch.zeros((q_len, heads), device=q.device)
        acc = torch.zeros((q_len, heads, q.shape[2]), device=q.device)
        for start in range(0, ctx, KEY_TILE):
            k_tile = keys[:, start : start + KEY_TILE]  # [heads, tile, dim]
            scores = (query[:, :, None, :] * k_tile[None]).sum(-1) * x.scale
            seen = (start + tile)[None, :] <= query_pos[:, None]  # [q_len, tile]
            scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
            m_new = torch.maximum(m, scores.amax(-1))
            # Tile 0 holds position 0, seen by every query: m_new is finite from it on.
            alpha = torch.exp(m - m_new)
            p = torch.exp(scores - m_new[..., None])
            total = total * alpha + p.sum(-1)
            v_tile = values[:, :, start : start + KEY_TILE]  # [heads, dim, tile]
            acc = acc * alpha[..., None] + (p[:, :, None, :] * v_tile[None]).sum(-1)
            m = m_new
        out[lo:hi] = (acc / total[..., None]).to(q.dtype)
    return out
