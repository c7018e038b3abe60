"""Token-to-expert assignments sorted by expert and padded to whole blocks.

The grouped GEMM kernels tile the sorted assignments in blocks of ``block_m`` rows,
every block belonging to one expert, so each expert's row count is padded up to a
multiple of ``block_m``. Everything here is torch ops on device tensors with shapes
fixed by ``(num_assignments, num_experts, block_m)`` alone: no host sync and no
data-dependent shape, so the whole layer is capturable in a CUDA graph and one
captured size serves any routing. The price is a grid sized for the worst case;
blocks past the real padded total exit at once.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class ExpertBlocks:
    """Assignments sorted by expert, padded to blocks of ``block_m``.

    ``sorted_ids[j]`` is a flat assignment index ``token * top_k + slot`` or, for
    padding, ``num_assignments`` (one past the last, so kernels mask it).
    ``block_expert[b]`` is the expert of block ``b``; blocks past ``total_padded``
    hold ``num_experts`` (no expert). ``total_padded`` is a 1-element tensor.
    """

    sorted_ids: torch.Tensor  # [max_padded] int32
    block_expert: torch.Tensor  # [max_padded // block_m] int32
    total_padded: torch.Tensor  # [1] int32
    block_m: int
    num_assignments: int


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """The most rows ``num_assignments`` can occupy once each expert's rows are padded:
    at most ``min(experts, assignments)`` experts are used, each wasting < ``block_m``."""
    rows = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort ``topk_ids`` (``[T, top_k]``, expert per assignment) into expert blocks."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, device = flat.numel(), flat.device
    max_padded = max_padded_rows(n, num_experts, block_m)
    # scatter_add into a fixed-size count (bincount's output size would depend on the data).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    # A stable sort keeps each expert's assignments in token order (deterministic output).
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(n, device=device) - start[sorted_experts]
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=device)
    sorted_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    # Block b belongs to the first expert whose padded range ends after b's start;
    # past the last range that is num_experts, which the kernels skip.
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    total = padded_end[-1:].to(torch.int32) if num_experts else torch.zeros(1, dtype=torch.int32,
                                                                            device=device)
    return ExpertBlocks(sorted_ids, block_expert, total, block_m, n)
