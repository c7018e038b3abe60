"""A fleet's weight-update group: one process group of the trainer's rank 0 and every
rank of every replica, so one broadcast per tensor reaches the whole fleet.

Ranks: the trainer is rank 0; replica ``r``'s tensor-parallel rank ``k`` is
``offset[r] + k``, the offsets following the replicas in order (replica 0's ranks
first, from rank 1). World size: 1 + the replicas' tensor-parallel sizes summed.

:class:`FleetWeightGroup` is plain data (picklable): the fleet's driver builds it
(``RolloutFleet.weight_group_plan``) and hands it to the trainer's process, which
makes its :class:`FleetBroadcaster` from it; that process may be the driver, a Ray
actor or a process the fleet knows nothing of.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import attrs

from kvrunner.weight_sync.broadcaster import WeightBroadcaster
from kvrunner.weight_sync.errors import WeightSyncError

if TYPE_CHECKING:
    import torch


@attrs.frozen(kw_only=True)
class FleetWeightGroup:
    """Who is which rank of a fleet's weight-update group, and where it meets.

    :ivar master_address: the host of the trainer's rank 0 (it serves the store).
    :ivar master_port: the store's port.
    :ivar backend: ``"nccl"`` or ``"gloo"``.
    :ivar group_name: the store prefix (so one store may hold several groups).
    :ivar timeout_s: how long a join or a broadcast waits for its peers.
    :ivar offsets: replica index -> the group rank of its tensor-parallel rank 0.
    :ivar sizes: replica index -> its tensor-parallel size.
    """

    master_address: str
    master_port: int
    backend: str
    group_name: str
    timeout_s: float
    offsets: dict[int, int]
    sizes: dict[int, int]

    @property
    def world_size(self) -> int:
        """The trainer's rank 0 and every replica rank."""
        return 1 + sum(self.sizes.values())

    @property
    def replicas(self) -> list[int]:
        """The replicas in the group, in rank order."""
        return list(self.offsets)

    def broadcaster(self, device: torch.device | str = "cpu") -> FleetBroadcaster:
        """The trainer's rank 0 of this group, in the calling process (``device``: where
        its tensors are broadcast from; a CUDA device for NCCL)."""
        return FleetBroadcaster(self, device=device)


def plan_group(sizes: dict[int, int], *, master_address: str, master_port: int, backend: str,
               group_name: str, timeout_s: float) -> FleetWeightGroup:
    """The group of the trainer and the replicas of ``sizes`` (replica index -> its
    tensor-parallel size), ranks assigned in replica order after the trainer's 0."""
    offsets, next_rank = {}, 1
    for replica in sorted(sizes):
        offsets[replica] = next_rank
        next_rank += sizes[replica]
    return FleetWeightGroup(master_address=master_address, master_port=master_port,
                            backend=backend, group_name=group_name, timeout_s=timeout_s,
                            offsets=offsets, sizes={r: sizes[r] for r in sorted(sizes)})


class FleetBroadcaster:
    """The trainer's rank 0 of a :class:`FleetWeightGroup` (it serves the group's
    store): :meth:`connect` while the fleet runs ``init_weights_update_group``, then
    one :meth:`broadcast` per push while the fleet runs
    ``update_weights_from_distributed(*FleetBroadcaster.spec(weights))``.

    A broadcast that fails (a replica died, a peer went silent past the timeout)
    releases the group here at once, so every replica still receiving fails
    promptly instead of waiting out the timeout, and raises
    :class:`~kvrunner.weight_sync.WeightSyncError`. The group is then gone on both
    sides: build a new one (over the replicas still alive) for the next push.
    """

    def __init__(self, plan: FleetWeightGroup, *, device: torch.device | str = "cpu") -> None:
        self.plan = plan
        self._sender = WeightBroadcaster(plan.master_address, plan.master_port,
                                         world_size=plan.world_size, backend=plan.backend,
                                         group_name=plan.group_name, timeout_s=plan.timeout_s,
                                         device=device)

    @property
    def connected(self) -> bool:
        """Whether this rank is in a live group."""
        return self._sender.group is not None

    def connect(self) -> None:
        """Join as rank 0; returns once every replica rank has joined too."""
        if self.connected:
            raise WeightSyncError("the trainer's rank 0 is connected already")
        self._sender.connect()

    spec = staticmethod(WeightBroadcaster.spec)

    def broadcast(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast every tensor, in order, to every replica rank; returns how many."""
        if not self.connected:
            raise WeightSyncError("the trainer's rank 0 is not in a weight-update group "
                                  "(connect first; a failed broadcast releases the group)")
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for pair in weights:  # lazily: a trainer may gather each tensor as it goes
                yield pair
                count += 1

        failure = None
        try:
            self._sender.broadcast(counted())
        except WeightSyncError as e:
            failure = str(e)
        if failure is not None:
            # Out of the except block, so no traceback holds the group: destroying it
            # closes its connections, and every peer's pending receive fails.
            self.close()
            raise WeightSyncError(f"the push to the fleet's group failed: {failure}; "
                                  f"the group is released")
        return count

    def close(self) -> None:
        """Leave the group (idempotent)."""
        self._sender.close()
