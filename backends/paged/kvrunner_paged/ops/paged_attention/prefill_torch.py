"""Prefill (and mixed) attention in plain torch (no Triton import: the CPU path): the
contract of :mod:`.prefill`, one ``scaled_dot_product_attention`` a sequence over a
block-table gather (a host loop)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrunner_paged.kv_format import K_SCALE, V_SCALE
from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs
from kvrunner_paged.ops.utils import dequantized, gather_positions


def paged_prefill_attention_torch(*, inputs: PagedAttentionInputs) -> torch.Tensor:
    """Causal varlen attention with a cached prefix, one sequence at a time:
    ``[T, num_heads, head_dim]`` in q's dtype, rows owned by no sequence 0. A decode
    sequence is simply one with ``q_len == 1``."""
    x = inputs
    x.sequences(varlen=True)
    q = x.q
    out = torch.zeros_like(q)
    for i, q_lo, q_hi, ctx_len in x.sequence_rows():
        q_len = q_hi - q_lo
        positions = torch.arange(ctx_len, device=q.device)
        # an FP8 pool's values times their head's scale, in q's dtype
        keys = dequantized(gather_positions(x.k_cache, x.block_tables[i], positions),
                           x.scales, K_SCALE, q.dtype).transpose(0, 1)
        values = dequantized(gather_positions(x.v_cache, x.block_tables[i], positions),
                             x.scales, V_SCALE, q.dtype).transpose(0, 1)
        query_pos = positions[ctx_len - q_len :, None]
        mask = positions[None, :] <= query_pos  # [q_len, ctx]
        out[q_lo:q_hi] = F.scaled_dot_product_attention(
            q[q_lo:q_hi].transpose(0, 1),  # [heads, q_len, dim]
            keys,  # [kv_heads, ctx, dim]
            values,
            attn_mask=mask,
            scale=x.scale,
            enable_gqa=True,
        ).transpose(0, 1)
    return out
