"""How many KV blocks the cache pools get.

The count is derived once, from the memory budget and the active backends' cache
specs, and then kept: later allocations (a wake) reuse the saved number, they never
derive it again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrunner import process_heap
from kvrunner.config import CacheConfig, ConfigError
from kvrunner.plugin_api.step_data import CacheSpec


class CacheSizingError(ConfigError, RuntimeError):
    """The memory budget cannot hold the pools the configuration asks for."""


def release_unreachable_memory(device: torch.device) -> None:
    """Return to the device what only unreachable objects still hold.

    An engine dropped without ``shutdown()`` (or a runner just released) keeps its
    pool and graphs until Python breaks their reference cycles; until then the pool
    counts as this process's memory and a new engine's budget shrinks, or is gone.
    """
    process_heap.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cache_budget_bytes(cache: CacheConfig, device: torch.device, *, peak_bytes: int = 0,
                       held_before: int = 0) -> int:
    """Bytes the cache pools may take on ``device``.

    CUDA: as vLLM counts it, ``gpu_memory_utilization`` of the card's total is this
    engine's share, less what the engine itself holds (what this process allocated
    since ``held_before``: weights, buffers) and the profiled activation peak above
    that; capped by what the device has free now (after the peak), so memory another
    process or another engine of this process holds is never promised twice.
    CPU: the configured byte budget.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        allocated = torch.cuda.memory_allocated(device)
        return budget_from_memory(
            total=total, free=free, reserved=reserved, allocated=allocated,
            held_before=held_before, utilization=cache.gpu_memory_utilization,
            peak_bytes=peak_bytes)
    return cache.cpu_cache_bytes


def budget_from_memory(*, total: int, free: int, reserved: int, allocated: int,
                       held_before: int, utilization: float, peak_bytes: int) -> int:
    """The CUDA budget of :func:`cache_budget_bytes` from the device's figures:
    ``total`` and ``free`` as the driver reports them, this process's ``reserved``
    (torch's cache, of which ``reserved - allocated`` is reusable) and ``allocated``
    bytes, ``held_before`` of them allocated before this engine started."""
    share = int(total * utilization) - max(0, allocated - held_before) - peak_bytes
    available = free + max(0, reserved - allocated) - peak_bytes
    return min(share, available)


def num_blocks_for_budget(
    specs: Sequence[CacheSpec], *, budget_bytes: int, num_slots: int, min_blocks: int
) -> int:
    """Blocks that fit after every backend's per-slot state is set aside."""
    per_block = sum(s.bytes_per_block for s in specs)
    per_slot = sum(s.bytes_per_slot for s in specs)
    remaining = budget_bytes - per_slot * num_slots
    if per_block == 0:
        # No backend keeps per-block cache; blocks are only bookkeeping then.
        num_blocks = min_blocks
    else:
        num_blocks = remaining // per_block
    if remaining < 0 or num_blocks < min_blocks:
        raise CacheSizingError(
            f"cache budget of {budget_bytes / 2**20:.1f} MiB holds {max(num_blocks, 0)} KV blocks "
            f"({per_block} B each) after {num_slots} state slots ({per_slot} B each); "
            f"need at least {min_blocks} to serve one max_model_len sequence: raise "
            f"gpu_memory_utilization / cpu_cache_bytes or lower max_model_len / max_num_seqs"
        )
    return int(num_blocks)
