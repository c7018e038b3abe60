"""The naive store: the oracle every store entry is tested against, a loop over rows."""

from __future__ import annotations

import torch


def naive_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write row ``t`` of ``k``/``v`` to slot ``slot_mapping[t]``; skip slots < 0."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = k[t]
        v_cache[block, offset] = v[t]
