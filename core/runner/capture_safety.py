"""The two capture-safety mechanisms: blanking write targets, and the audit.

A capture runs the model for real (a warmup forward, then the captured one), so every
kernel that writes cache does write — wherever its index buffers point. Blanking
sets every declared write target to its PAD value first, so those writes are
skipped. The audit proves it: every pool is snapshotted before and compared after;
a backend that writes through a buffer it did not declare is caught here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvrunner.contract import CacheWriteTarget


class CaptureAuditError(RuntimeError):
    """A capture changed a cache/state pool: some write target was not blanked."""


def blank_write_targets(targets: Sequence[CacheWriteTarget]) -> None:
    """Fill every declared write target with its PAD value, in place."""
    for target in targets:
        target.buffer.fill_(target.pad_value)


class PoolSnapshot:
    """A byte copy of every pool, to compare against after a capture."""

    def __init__(self, pools: Mapping[str, torch.Tensor]) -> None:
        self._pools = dict(pools)
        self._copies = {name: _bytes_of(t).clone() for name, t in pools.items()}

    def changed_pools(self) -> list[str]:
        return [
            name
            for name, pool in self._pools.items()
            if not torch.equal(_bytes_of(pool), self._copies[name])
        ]

    def require_unchanged(self, *, batch_size: int, blanked: Sequence[CacheWriteTarget]) -> None:
        changed = self.changed_pools()
        if changed:
            names = ", ".join(t.qualified_name for t in blanked) or "none"
            raise CaptureAuditError(
                f"capture of batch size {batch_size} wrote into cache pool(s) {changed}; "
                f"write targets blanked before it: {names}. A kernel writes through a buffer "
                f"its backend does not declare in cache_write_targets (or blanking is off)."
            )


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    # Compare raw bytes, so NaN == NaN and -0.0 != 0.0 as in memory.
    return t.detach().contiguous().view(torch.uint8)
