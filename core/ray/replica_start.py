"""How one replica's rank actors meet and start (rank 0 serves the store).

Rank 0 is any actor with ``node_address``, ``open_store(host)`` and
``start(loopback=...)`` (an :class:`~kvrunner.ray.replica_actor.EngineReplica`, or
an actor that holds one); ranks > 0 are
:class:`~kvrunner.ray.rank_actor.EngineRank` actors.
"""

from __future__ import annotations

from typing import Any


def start_replica(rank0: Any, ranks: list[Any]) -> Any:
    """Join the ranks into one group and start loading; returns the ref of rank 0's
    ``start`` (its answer once the replica serves).

    When every rank is on rank 0's node the group stays on loopback; otherwise it
    meets at rank 0's node address.
    """
    import ray

    loopback = True
    if ranks:
        nodes = ray.get([rank0.node_address.remote()]
                        + [rank.node_address.remote() for rank in ranks])
        loopback = len(set(nodes)) == 1
        host = "127.0.0.1" if loopback else nodes[0]
        port = ray.get(rank0.open_store.remote(host))
        # ranks > 0 return once their serving thread runs; rank 0 once all joined
        ray.get([rank.start.remote(host, port, loopback=loopback) for rank in ranks])
    return rank0.start.remote(loopback=loopback)
