"""The plain-torch path: what the backend runs when Triton is off (CPU production).

Same contracts as the Triton launchers (:mod:`.store_kv`, :mod:`.decode`,
:mod:`.prefill`) but built from torch ops: ``index_put_`` for the store, a
block-table gather plus ``scaled_dot_product_attention`` for attention. Everything
per-step is read from the tensors themselves, never from host-side copies, so a
metadata object built for capture still sees the values filled in place later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k[t]``/``v[t]`` to slot ``slot_mapping[t]`` of the caches; skip slots < 0.

    :param k: ``[num_tokens, num_kv_heads, head_dim]`` (``v`` likewise).
    :param k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous over
        its first two dims so a slot is a row of the flattened view.
    :param slot_mapping: ``[>= num_tokens]`` int; only the first ``num_tokens`` are read.
    """
    slots = slot_mapping[: k.shape[0]].long()
    rows = slots >= 0
    index = (slots[rows],)
    flat = (-1, *k_cache.shape[2:])
    k_cache.view(flat).index_put_(index, k[rows].to(k_cache.dtype))
    v_cache.view(flat).index_put_(index, v[rows].to(v_cache.dtype))


def _gather(cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of ``cache`` at logical ``positions`` of the sequences whose blocks are ``table``.

    ``table``: ``[..., max_blocks]``; ``positions``: ``[..., n]`` -> ``[..., n, heads, dim]``.
    """
    block_size = cache.shape[1]
    blocks = torch.gather(table.long(), -1, positions // block_size)
    return cache[blocks, positions % block_size]


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per row over that row's paged keys; rows with no keys give zeros.

    :param q: ``[num_rows, num_heads, head_dim]``; row ``i`` is sequence ``i``'s token.
    :param block_tables: ``[>= num_rows, max_blocks_per_seq]``.
    :param context_lens: ``[>= num_rows]``; padded rows hold 0.
    """
    rows = q.shape[0]
    lens = context_lens[:rows].long()
    width = int(lens.max()) if rows else 0
    if width == 0:
        return torch.zeros_like(q)
    positions = torch.arange(width, device=q.device).expand(rows, width)
    # Positions past a row's length read block-table entries that are in range (the
    # table is sized for max_model_len) but hold stale or unwritten slots. A masked
    # score still multiplies its value (0 * NaN = NaN), so those rows are zeroed, not
    # just masked: whatever sits outside a sequence's context cannot reach its output.
    valid = positions < lens[:, None]  # [rows, width]
    keep = valid[:, :, None, None]
    keys = _gather(k_cache, block_tables[:rows], positions).where(keep, 0)
    values = _gather(v_cache, block_tables[:rows], positions).where(keep, 0)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [rows, heads, 1, dim]
        keys.transpose(1, 2).to(q.dtype),  # [rows, kv_heads, width, dim]
        values.transpose(1, 2).to(q.dtype),
        attn_mask=valid[:, None, None, :],  # [rows, 1, 1, width]
        scale=scale,
        enable_gqa=True,
    ).squeeze(2)
    # A row with every key masked is NaN out of SDPA; such rows are defined as zero.
    return torch.where((lens > 0)[:, None, None], out, torch.zeros((), dtype=q.dtype))


def paged_prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_seqs: int,
) -> torch.Tensor:
    """Causal varlen attention with a cached prefix, one sequence at a time.

    Sequence ``i``'s queries (rows ``query_start_loc[i]:query_start_loc[i+1]``) are its
    last ``q_len`` positions out of ``context_lens[i]``; query ``j`` sees keys at
    positions ``<= context_len - q_len + j``. Rows of ``q`` owned by no sequence are 0.
    Handles mixed batches: a decode sequence is simply one with ``q_len == 1``.
    """
    out = torch.zeros_like(q)
    starts = query_start_loc[: num_seqs + 1].tolist()
    lens = context_lens[:num_seqs].tolist()
    for i in range(num_seqs):
        q_lo, q_hi, ctx_len = starts[i], starts[i + 1], lens[i]
        q_len = q_hi - q_lo
        if q_len == 0 or ctx_len == 0:
            continue
        positions = torch.arange(ctx_len, device=q.device)
        keys = _gather(k_cache, block_tables[i], positions).transpose(0, 1)  # [kvh, ctx, dim]
        values = _gather(v_cache, block_tables[i], positions).transpose(0, 1)
        query_pos = positions[ctx_len - q_len :, None]
        mask = positions[None, :] <= query_pos  # [q_len, ctx]
        out[q_lo:q_hi] = F.scaled_dot_product_attention(
            q[q_lo:q_hi].transpose(0, 1),  # [heads, q_len, dim]
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)
    return out
