"""The store in plain torch (no Triton import: the CPU path): the contract of
:mod:`.store`, one ``index_put_`` a cache."""

from __future__ import annotations

import torch


def store_kv_torch(*, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
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
