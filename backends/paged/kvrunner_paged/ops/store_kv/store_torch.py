"""The store in plain torch (no Triton import: the CPU path): the contract of
:mod:`.store`, one ``index_put_`` a cache."""

from __future__ import annotations

import torch

from kvrunner_paged.kv_format import is_fp8, quantize_fp8


def store_kv_torch(*, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """Write ``k[t]``/``v[t]`` to slot ``slot_mapping[t]`` of the caches; skip slots < 0.

    :param k: ``[num_tokens, num_kv_heads, head_dim]`` (``v`` likewise).
    :param k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous over
        its first two dims so a slot is a row of the flattened view.
    :param slot_mapping: ``[>= num_tokens]`` int; only the first ``num_tokens`` are read.
    :param k_scale: into an FP8 cache a key goes as ``k / k_scale`` quantized
        (:func:`~kvrunner_paged.kv_format.quantize_fp8`); ``v_scale`` likewise. Other
        caches take the rows as they are.
    """
    slots = slot_mapping[: k.shape[0]].long()
    rows = slots >= 0
    index = (slots[rows],)
    for rows_in, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        picked = rows_in[rows]
        stored = quantize_fp8(picked, 1.0 / scale) if is_fp8(cache) else picked.to(cache.dtype)
        cache.view(-1, *cache.shape[2:]).index_put_(index, stored)
