"""A rank's cache pools: every backend's KV blocks and state slots, at the group's one
size, allocated at start-up and after a wake, released at a sleep.

The counts never change after start-up: the engine's block manager and every other
rank were built on exactly these, so a wake allocates them again or fails.
"""

from __future__ import annotations

from typing import Any

from kvrunner.backend_manager import BackendManager
from kvrunner.runner.pool_release import PoolRelease


class CachePools:
    """The pools the backends allocated (backend -> pool), and whether they are."""

    def __init__(self, backends: BackendManager, *, num_blocks: int, num_slots: int) -> None:
        self.backends = backends
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.pools: dict[str, Any] = {}
        self.resident = False
        self.allocate()

    def bytes_by_backend(self) -> dict[str, int]:
        """Each backend's pool bytes at the saved counts (resident or not)."""
        return {
            name: s.bytes_per_block * self.num_blocks + s.bytes_per_slot * self.num_slots
            for name, s in self.backends.cache_specs().items()
        }

    def allocate(self) -> None:
        """Allocate every backend's pools at the saved counts (never re-derived)."""
        self.pools = self.backends.allocate_cache(
            num_blocks=self.num_blocks, num_slots=self.num_slots
        )
        self.resident = True

    def release(self) -> PoolRelease:
        """Release every backend's pools; the returned record measures what went
        (and says which backend kept its storage)."""
        release = PoolRelease(self.pools)
        if self.pools or self.resident:
            self.backends.release_cache()
        self.pools = {}
        self.resident = False
        return release
