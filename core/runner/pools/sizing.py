"""How many KV blocks the cache pools get.

The count is derived once, from the memory budget and the active backends' cache
specs, and then kept: later allocations (a wake) reuse the saved number, they never
derive it again.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch

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
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cache_budget_bytes(cache: CacheConfig, device: torch.device, *, peak_bytes: int = 0) -> int:
    """Bytes the cache pools may take on ``device``.

    CUDA: ``gpu_memory_utilization`` of the card's total, less what this process
    already holds (weights, buffers) and the profiled activation peak above that.
    CPU: the configured byte budget.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free - torch.cuda.memory_reserved(device)
        ours = torch.cuda.memory_allocated(device)
        return int(total * cache.gpu_memory_utilization) - used_by_others - ours - peak_bytes
    return cache.cpu_cache_bytes


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
