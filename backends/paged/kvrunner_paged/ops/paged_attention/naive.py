"""The naive paged attention: the oracle every paged-attention entry is tested against.

Written for obviousness, not speed: Python loops over sequences and key positions, an
explicit masked softmax in float32, no fused tricks. Nothing in production calls it;
the torch paths and the Triton kernels must agree with it. It takes plain tensors (the
shapes of :mod:`.inputs`), not the inputs record, so it checks that record's entries
without sharing any of their code.
"""

from __future__ import annotations

import torch


def gather_sequence_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: list[int], context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence in position order: ``[context_len, kv_heads, dim]``."""
    block_size = k_cache.shape[1]
    keys, values = [], []
    for pos in range(context_len):
        block = block_table[pos // block_size]
        keys.append(k_cache[block, pos % block_size])
        values.append(v_cache[block, pos % block_size])
    if not keys:
        empty = k_cache.new_zeros((0, *k_cache.shape[2:]))
        return empty, empty.clone()
    return torch.stack(keys), torch.stack(values)


def naive_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged keys, in float32.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; they
    sit at the *last* ``q_len`` positions of its ``context_lens[i]`` cached tokens, and
    query ``j`` attends to keys at positions ``<= context_len - q_len + j``. Rows of
    ``q`` not owned by any sequence, and sequences with no keys, come out as zeros.
    The keys attended are the cached ones times ``k_scale`` in float32 (one number, or
    one per KV head), the values likewise times ``v_scale`` (an FP8 pool's dequantized
    values; 1.0 for any other).

    :returns: ``[num_tokens, num_heads, head_dim]`` float32.
    """
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for i, ctx_len in enumerate(context_lens.tolist()):
        q_lo, q_hi = starts[i], starts[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0 or ctx_len == 0:
            continue
        keys, values = gather_sequence_kv(k_cache, v_cache, block_tables[i].tolist(), ctx_len)
        k_per_head = torch.as_tensor(k_scale, dtype=torch.float32).reshape(-1, 1)
        v_per_head = torch.as_tensor(v_scale, dtype=torch.float32).reshape(-1, 1)
        keys = (keys.float() * k_per_head).repeat_interleave(group, dim=1)  # [ctx, heads, dim]
        values = (values.float() * v_per_head).repeat_interleave(group, dim=1)
        queries = q[q_lo:q_hi].float()  # [q_len, heads, dim]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
        key_pos = torch.arange(ctx_len)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, values)
    return out
