"""Imported by verl (``VERL_USE_EXTERNAL_MODULES=kvrunner_verl.register``): registers
the rollout name ``kvrunner`` in verl's replica registry and its server adapter in
verl's rollout registry."""

from __future__ import annotations

from verl.workers.rollout import base as _rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

NAME = "kvrunner"


def _load_replica() -> type:
    from kvrunner_verl.replica import KvrunnerReplica

    return KvrunnerReplica


RolloutReplicaRegistry.register(NAME, _load_replica)
# verl resolves (name, mode) to a dotted class path, imported when first used
_rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = "kvrunner_verl.server_adapter.ServerAdapter"
