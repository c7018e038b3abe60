"""Helpers the paged ops share: the torch paths' block-table gather and the unit-stride
rows the Triton launches take.

No Triton import here: the plain-torch paths use it too."""

from __future__ import annotations

import torch


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
