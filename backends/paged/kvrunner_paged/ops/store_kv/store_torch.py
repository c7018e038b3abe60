"""The store in plain torch (no Triton import: the CPU path): the contract of
:mod:`.store`, one ``index_put_`` a cache."""

from __future__ import annotations

import torch

from kvrunner_paged.kv_format import K_INV, V_INV, is_fp8, quantize_fp8, scale_table


def store_kv_torch(*, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   scales: torch.Tensor | None = None) -> None:
    """Write ``k[t]``/``v[t]`` to slot ``slot_mapping[t]`` of the caches; skip slots < 0.

    :param k: ``[num_tokens, num_kv_heads, head_dim]`` (``v`` likewise).
    :param k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous over
        its first two dims so a slot is a row of the flattened view.
    :param slot_mapping: ``[>= num_tokens]`` int; only the first ``num_tokens`` are read.
    :param scales: the layer's ``[4, num_kv_heads]`` scale table
        (:func:`~kvrunner_paged.kv_format.scale_table`; None: 1.0): into an FP8 cache a
        key goes as ``k / k_scale`` per KV head, quantized by multiplying by the table's
        reciprocal (:func:`~kvrunner_paged.kv_format.quantize_fp8`); values likewise.
        Other caches take the rows as they are.
    """
    slots = slot_mapping[: k.shape[0]].long()
    rows = slots >= 0
    index = (slots[rows],)
    if is_fp8(k_cache) and scales is None:
        scales = scale_table(1.0, 1.0, k_cache.shape[2], k_cache.device)
    for rows_in, cache, inverse in ((k, k_cache, K_INV), (v, v_cache, V_INV)):
        picked = rows_in[rows]
        stored = (quantize_fp8(picked, scales[inverse]) if is_fp8(cache)
                  else picked.to(cache.dtype))
        cache.view(-1, *cache.shape[2:]).index_put_(index, stored)
