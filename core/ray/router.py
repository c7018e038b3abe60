"""Which replica serves a request: the one its id was last served on, else the
least loaded.

Multi-turn rollouts send every turn of one trajectory under one request id; sending
them to the same replica lets its prefix cache hold the conversation so far. The
id-to-replica map is a bounded LRU, so a long run does not grow it without end.
The least-loaded choice counts requests in flight per replica (as the fleet sees
them) and breaks ties by how many each was ever given, so an idle fleet is filled
round-robin.
"""

from __future__ import annotations

from collections import OrderedDict

from kvrunner.ray.errors import NoReplicaError


class ReplicaRouter:
    """Routing state of a fleet of ``num_replicas`` replicas (no Ray: plain state).

    :param sticky_capacity: how many request ids keep their replica (least recently
        used ones are forgotten first).
    """

    def __init__(self, num_replicas: int, *, sticky_capacity: int = 100_000) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if sticky_capacity < 1:
            raise ValueError(f"sticky_capacity must be at least 1, got {sticky_capacity}")
        self.in_flight = [0] * num_replicas
        self.assigned = [0] * num_replicas
        self.alive = [True] * num_replicas
        self._capacity = sticky_capacity
        self._sticky: OrderedDict[str, int] = OrderedDict()

    def pick(self, request_id: str) -> int:
        """The replica for ``request_id``, counted as in flight there until
        :meth:`finished`: its last replica if that one is alive, else the least loaded.
        Raises :class:`NoReplicaError` when every replica is dead."""
        replica = self._sticky.get(request_id)
        if replica is None or not self.alive[replica]:
            live = self.live
            if not live:
                raise NoReplicaError("every replica of the fleet has died")
            replica = min(live, key=lambda i: (self.in_flight[i], self.assigned[i], i))
        return self.pin(request_id, replica)

    def pin(self, request_id: str, replica: int) -> int:
        """Send ``request_id`` to ``replica`` (alive), counted as :meth:`pick` counts;
        later turns of the id follow it there."""
        if not self.alive[replica]:
            raise NoReplicaError(f"replica {replica} has died")
        self._sticky[request_id] = replica
        self._sticky.move_to_end(request_id)
        if len(self._sticky) > self._capacity:
            self._sticky.popitem(last=False)
        self.in_flight[replica] += 1
        self.assigned[replica] += 1
        return replica

    def finished(self, replica: int) -> None:
        """A request picked for ``replica`` has ended (in any way)."""
        self.in_flight[replica] -= 1

    def replica_of(self, request_id: str) -> int | None:
        """Where ``request_id`` was last sent (None if never, or forgotten)."""
        return self._sticky.get(request_id)

    def mark_dead(self, replica: int) -> None:
        """Route nothing more to ``replica``; ids stuck to it move on their next turn."""
        self.alive[replica] = False

    @property
    def live(self) -> list[int]:
        """The indices of the replicas still alive."""
        return [i for i, ok in enumerate(self.alive) if ok]
