"""The pool's size: one frozen record, produced once at start-up by the group's agreement.

Each rank derives how many KV blocks *it* can hold (its free memory, its shard's
bytes per block) and the activation peak its profile measured. The engine has one
block manager for all ranks, so block ``b`` must exist on every rank: the group uses
the smallest count. That agreed :class:`PoolSize` is the only pool size there is:
:class:`~kvrunner.runner.pools.cache_pools.CachePools` allocates it at start-up and
at every wake, the wake's preflight reserves its activation peak, and the rank's
reports and ``cache_info()`` read it. Nothing re-derives it.

A rank whose own derivation raised still takes part in the exchange (with ``-1``),
so no peer is left waiting in the collective; every rank then raises at once, the
failing rank with its own error and the others with :class:`PeerRankError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from kvrunner.distributed.errors import PeerRankError
from kvrunner.distributed.group import DistGroup

#: what a rank contributes when it could not derive a count
FAILED = -1


@attrs.frozen(kw_only=True)
class OwnSize:
    """What one rank's sizing derived, before the group agrees."""

    #: KV blocks this rank alone could hold
    num_blocks: int
    #: the activation peak its start-up profile measured (0 when none ran)
    activation_peak_bytes: int = 0


@attrs.frozen(kw_only=True)
class PoolSize:
    """The group's one pool size, on one rank."""

    #: KV blocks every rank allocates, and the engine's block manager holds
    num_blocks: int
    #: state slots every rank allocates (``max_num_seqs`` plus one scratch slot)
    num_slots: int
    #: KV blocks this rank alone could have held (at least ``num_blocks``)
    own_num_blocks: int
    #: this rank's profiled activation peak: a wake of the pools leaves room for it
    activation_peak_bytes: int = 0

    def bytes_by_backend(self, specs: dict) -> dict[str, int]:
        """Each backend's pool bytes at this size, from its ``cache_spec``."""
        return {name: s.bytes_per_block * self.num_blocks + s.bytes_per_slot * self.num_slots
                for name, s in specs.items()}


def agree_pool_size(derive: Callable[[], OwnSize], group: DistGroup | None, *,
                    num_slots: int) -> PoolSize:
    """The group's pool size: this rank's derivation, and the group's minimum count.

    :param derive: this rank's sizing (may raise, e.g. ``CacheSizingError``).
    :param group: the tensor-parallel group; ``None`` for a single rank.
    :param num_slots: the state slots every rank allocates (fixed by the config).
    """
    try:
        own = derive()
    except Exception:
        if group is not None and group.size > 1:
            group.gather_ints(FAILED)  # let the peers through the exchange first
        raise
    if own.num_blocks < 0:
        raise ValueError(f"pool sizing derived a negative block count ({own.num_blocks})")
    agreed = own.num_blocks
    if group is not None and group.size > 1:
        counts = group.gather_ints(own.num_blocks)
        failed = [r for r, c in enumerate(counts) if c == FAILED]
        if failed:
            raise PeerRankError(
                f"rank(s) {failed} could not size their cache pools, so no pool size can be "
                f"agreed (see that rank's error); this rank could hold {own.num_blocks} blocks"
            )
        agreed = min(counts)
    return PoolSize(num_blocks=agreed, num_slots=num_slots, own_num_blocks=own.num_blocks,
                    activation_peak_bytes=own.activation_peak_bytes)
