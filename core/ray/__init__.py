"""Engine replicas on Ray (the ``kvrunner[ray]`` extra): :class:`RolloutFleet`.

Each replica is a Ray actor holding an ``AsyncLLM`` on the resources of its
placement-group bundles, with its tensor-parallel ranks as actors beside it.
"""

from kvrunner.ray.errors import FleetCallError, NoReplicaError, ReplicaError
from kvrunner.ray.fleet import Replica, RolloutFleet
from kvrunner.ray.rank_actor import EngineRank
from kvrunner.ray.replica_actor import EngineReplica
from kvrunner.ray.replica_start import start_replica

__all__ = [
    "EngineRank",
    "EngineReplica",
    "FleetCallError",
    "NoReplicaError",
    "Replica",
    "ReplicaError",
    "RolloutFleet",
    "start_replica",
]
