"""Per-request recurrent-state slots (linear-attention / GDN state rows).

A recurrent backend keeps one fixed-size state per running request, indexed by a
slot id. Unlike KV blocks a state cannot be shared or cached: it is the running
summary of one request's whole history.
"""

from __future__ import annotations

import heapq


class NoFreeStateSlotError(RuntimeError):
    """Every state slot is held by a running sequence."""


class StateSlotPool:
    """``num_slots`` slot ids, ``0 .. num_slots - 1``, each held by at most one request."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # A min-heap hands out the lowest free id, keeping live slots dense at the front.
        self._free = list(range(num_slots))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeStateSlotError(f"all {self.num_slots} state slots are in use")
        slot = heapq.heappop(self._free)
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._held:
            raise ValueError(f"state slot {slot} is not held")
        self._held.remove(slot)
        heapq.heappush(self._free, slot)
