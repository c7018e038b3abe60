"""Helpers the paged ops share: the torch paths' block-table gather and dequantization,
and the unit-stride rows the Triton launches take.

No Triton import here: the plain-torch paths use it too."""

from __future__ import annotations

import torch

from kvrunner_paged.kv_format import FP8_DTYPE


def gather_positions(
    cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Rows of ``cache`` at logical ``positions`` of the sequences whose blocks are ``table``.

    ``cache``: ``[num_blocks, block_size, heads, dim]``; ``table``: ``[..., max_blocks]``;
    ``positions``: ``[..., n]`` -> ``[..., n, heads, dim]``.
    """
    block_size = cache.shape[1]
    blocks = torch.gather(table.long(), -1, positions // block_size)
    return cache[blocks, positions % block_size]


def unit_last_dim(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where its last dim is contiguous (what the kernels address), else a
    contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def dequantized(
    rows: torch.Tensor, scales: torch.Tensor | None, row: int, dtype: torch.dtype
) -> torch.Tensor:
    """Pool rows (``[..., kv_heads, dim]``) in ``dtype``: from an FP8 pool each KV
    head's values times its scale (row ``row`` of the layer's scale table, ``K_SCALE``
    or ``V_SCALE``; 1.0 without a table) in float32 first; from any other pool as
    they are."""
    if rows.dtype != FP8_DTYPE or scales is None:
        return rows.to(dtype)
    return (rows.float() * scales[row][:, None]).to(dtype)
