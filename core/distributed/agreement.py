"""One pool size for the whole group: every rank's own count, agreed to the minimum.

Each rank derives how many KV blocks *it* can hold (its free memory, its shard's
bytes per block). The engine has one block manager for all ranks, so block ``b``
must exist on every rank: the group uses the smallest count. A rank whose own
derivation raised still takes part in the exchange (with ``-1``), so no peer is
left waiting in the collective; every rank then raises at once, the failing rank
with its own error and the others with :class:`PeerRankError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvrunner.distributed.errors import PeerRankError
from kvrunner.distributed.group import DistGroup

#: what a rank contributes when it could not derive a count
FAILED = -1


def agree_pool_size(derive: Callable[[], int], group: DistGroup | None) -> tuple[int, int]:
    """``(own, agreed)``: this rank's derived block count and the group's minimum.

    :param derive: this rank's sizing (may raise, e.g. ``CacheSizingError``).
    :param group: the tensor-parallel group; ``None`` for a single rank.
    """
    try:
        own = derive()
    except Exception:
        if group is not None and group.size > 1:
            group.gather_ints(FAILED)  # let the peers through the exchange first
        raise
    if own < 0:
        raise ValueError(f"pool sizing derived a negative block count ({own})")
    if group is None or group.size == 1:
        return own, own
    counts = group.gather_ints(own)
    failed = [r for r, c in enumerate(counts) if c == FAILED]
    if failed:
        raise PeerRankError(
            f"rank(s) {failed} could not size their cache pools, so no pool size can be "
            f"agreed (see that rank's error); this rank could hold {own} blocks"
        )
    return own, min(counts)
