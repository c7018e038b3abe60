"""Decode attention in plain torch (no Triton import: the CPU path): the contract of
:mod:`.decode` but for ``new_kv`` (store first, then attend), as one padded
``scaled_dot_product_attention`` over a block-table gather.

Everything per-step is read from the tensors themselves, never from host-side copies,
so a metadata object built for capture still sees the values filled in place later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrunner_paged.kv_format import K_SCALE, V_SCALE
from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs
from kvrunner_paged.ops.utils import dequantized, gather_positions


def paged_decode_attention_torch(*, inputs: PagedAttentionInputs) -> torch.Tensor:
    """One query per row over that row's paged keys: ``[rows, num_heads, head_dim]`` in
    q's dtype; rows with no keys give zeros."""
    x = inputs
    rows = x.sequences(varlen=False)
    q = x.q
    lens = x.context_lens[:rows].long()
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
    # In q's dtype first (an FP8 pool's values times their head's scale), so the zeroing
    # runs in a dtype every device has.
    table = x.block_tables[:rows]
    keys = dequantized(gather_positions(x.k_cache, table, positions), x.scales, K_SCALE,
                       q.dtype).where(keep, 0)
    values = dequantized(gather_positions(x.v_cache, table, positions), x.scales, V_SCALE,
                         q.dtype).where(keep, 0)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [rows, heads, 1, dim]
        keys.transpose(1, 2),  # [rows, kv_heads, width, dim]
        values.transpose(1, 2),
        attn_mask=valid[:, None, None, :],  # [rows, 1, 1, width]
        scale=x.scale,
        enable_gqa=True,
    ).squeeze(2)
    # A row with every key masked is NaN out of SDPA; such rows are defined as zero.
    return torch.where((lens > 0)[:, None, None], out, torch.zeros((), dtype=q.dtype))
