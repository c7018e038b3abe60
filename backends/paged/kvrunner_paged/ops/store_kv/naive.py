"""The naive store: the oracle every store entry is tested against, a loop over rows."""

from __future__ import annotations

import torch

#: e4m3's largest finite magnitude, written out here so the oracle shares no code
E4M3_MAX = 448.0


def naive_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Write row ``t`` of ``k``/``v`` to slot ``slot_mapping[t]``; skip slots < 0.

    Into a ``float8_e4m3fn`` cache a row goes as ``x * (1 / scale)`` in float32, clamped
    to ``±448`` and rounded to e4m3, with ``scale`` one number or one per KV head (the
    reciprocal rounded to float32 once); into any other cache as it is (cast to its
    dtype).
    """
    block_size = k_cache.shape[1]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for cache, rows, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
            row = rows[t]
            if fp8:
                inverse = 1.0 / torch.as_tensor(scale, dtype=torch.float32)
                if inverse.dim() == 1:  # one per KV head: row is [kv_heads, dim]
                    inverse = inverse[:, None]
                row = torch.clamp(row.to(torch.float32) * inverse, -E4M3_MAX, E4M3_MAX)
            cache[block, offset] = row.to(cache.dtype)
