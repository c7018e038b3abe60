"""Engine replicas on Ray (the ``kvrunner[ray]`` extra): :class:`RolloutFleet`.

Each replica is a Ray actor holding an ``AsyncLLM`` on the resources of its
placement-group bundles, with its tensor-parallel ranks as actors beside it. A
trainer pushes weights through Ray's object store or over one weight-update group
of its rank 0 and every replica rank (:class:`FleetBroadcaster` on its side).
"""

from kvrunner.ray.errors import (
    FleetCallError,
    NoReplicaError,
    PartialPushError,
    ReplicaError,
    WeightGroupError,
)
from kvrunner.ray.fleet import RolloutFleet
from kvrunner.ray.rank_actor import EngineRank
from kvrunner.ray.replica import Replica
from kvrunner.ray.replica_actor import EngineReplica
from kvrunner.ray.replica_start import start_replica
from kvrunner.ray.weight_group import FleetBroadcaster, FleetWeightGroup

__all__ = [
    "EngineRank",
    "EngineReplica",
    "FleetBroadcaster",
    "FleetCallError",
    "FleetWeightGroup",
    "NoReplicaError",
    "PartialPushError",
    "Replica",
    "ReplicaError",
    "RolloutFleet",
    "WeightGroupError",
    "start_replica",
]
