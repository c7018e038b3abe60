"""A rank's cache pools: every backend's KV blocks and state slots.

Every ``allocate_cache`` call of the core goes through here, at a
:class:`~kvrunner.runner.pools.pool_size.PoolSize`. After start-up that is always the
group's agreed size, at start-up and after each wake: the engine's block manager and
every other rank were built on exactly it, so a wake allocates it again or fails.
The one other allocation is the start-up profile's minimal pool
(:meth:`CachePools.profile`), released before the pool is sized.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kvrunner.plugin_host.backend_manager import BackendManager
from kvrunner.runner.pools.pool_release import PoolRelease
from kvrunner.runner.pools.pool_size import PoolSize


class CachePools:
    """The pools the backends allocated (backend -> pool) at ``size``, and whether they are."""

    def __init__(self, backends: BackendManager, size: PoolSize) -> None:
        self.backends = backends
        self.size = size
        self.pools: dict[str, Any] = {}
        self.resident = False
        self.allocate()

    @classmethod
    @contextlib.contextmanager
    def profile(cls, backends: BackendManager, *, num_blocks: int, num_slots: int
                ) -> Iterator[CachePools]:
        """A temporary pool of ``num_blocks`` for the start-up profile, released on exit
        (before the pool is sized, so its memory counts as free again)."""
        pools = cls(backends, PoolSize(num_blocks=num_blocks, num_slots=num_slots,
                                       own_num_blocks=num_blocks))
        try:
            yield pools
        finally:
            pools.release()

    def bytes_by_backend(self) -> dict[str, int]:
        """Each backend's pool bytes at the size (resident or not)."""
        return self.size.bytes_by_backend(self.backends.cache_specs())

    def allocate(self) -> None:
        """Allocate every backend's pools at the size (never re-derived)."""
        self.pools = self.backends.allocate_cache(
            num_blocks=self.size.num_blocks, num_slots=self.size.num_slots
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
