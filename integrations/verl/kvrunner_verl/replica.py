"""verl's ``RolloutReplica`` for kvrunner: one replica's actors on a placement group
of its own (standalone rollout: CPUs, and a GPU per rank on a GPU cluster)."""

from __future__ import annotations

from typing import Any

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from kvrunner.ray.rank_actor import EngineRank
from kvrunner.ray.rank_setup import RankSpec
from kvrunner.ray.replica_start import start_replica
from kvrunner_verl.server import KvrunnerServer


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica ``replica_rank``'s server (the adapter finds it)."""
    return f"kvrunner_server_{replica_rank}_0"


def engine_spec(config: Any, model_config: Any) -> RankSpec:
    """The engine every rank of a replica builds, from verl's rollout and model
    configs; ``engine_kwargs.kvrunner`` adds flat kvrunner overrides."""
    max_len = config.max_model_len or config.prompt_length + config.response_length
    overrides = {
        "max_num_seqs": config.max_num_seqs, "max_model_len": max_len,
        "enforce_eager": config.enforce_eager, "seed": config.seed,
        **dict((config.engine_kwargs or {}).get("kvrunner", None) or {}),
    }
    path = getattr(model_config, "local_path", None) or model_config.path
    return RankSpec(model=str(path), config=overrides,
                    tensor_parallel_size=config.tensor_model_parallel_size)


class KvrunnerReplica(RolloutReplica):
    """A kvrunner replica of ``tensor_model_parallel_size`` ranks.

    Standalone only: the ranks take bundles of their own. A hybrid or colocated
    layout (sharing the trainer's processes or bundles) is refused.
    """

    async def init_hybrid(self, worker_group: Any) -> None:
        raise NotImplementedError("kvrunner-verl runs standalone rollout replicas only; "
                                  "set actor_rollout_ref.hybrid_engine=False")

    async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
        await self.init_hybrid(worker_group)

    async def init_colocated(self, resource_pool: Any) -> None:
        await self.init_hybrid(None)

    async def init_standalone(self) -> None:
        """Place the replica's ranks on a placement group of its own and start them."""
        from ray.util.placement_group import placement_group

        self.rollout_mode = RolloutMode.STANDALONE
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
        self._pg = placement_group([dict(bundle)] * self.world_size, strategy="PACK")
        await self._pg.ready()
        await self.launch_servers()

    async def launch_servers(self) -> None:
        """Start rank 0's server and ranks > 0 on the replica's bundles."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = engine_spec(self.config, self.model_config)
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0

        def on_bundle(k: int) -> dict[str, Any]:
            return dict(num_cpus=1, num_gpus=gpus, scheduling_strategy=(
                PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                 placement_group_bundle_index=k)))

        server = ray.remote(KvrunnerServer).options(
            name=server_name(self.replica_rank), max_concurrency=self.max_concurrency,
            **on_bundle(0),
        ).remote(spec, self.replica_rank, default_max_tokens=self.config.response_length,
                 free_cache_engine=self.config.free_cache_engine)
        self._ranks = [ray.remote(EngineRank).options(**on_bundle(k)).remote(spec, k)
                       for k in range(1, self.world_size)]
        await start_replica(server, self._ranks)
        self.servers = [server]
        self._server_handle = server
        # no HTTP front: verl's load balancer keys servers by this name
        self._server_address = f"kvrunner://{server_name(self.replica_rank)}"

    async def sleep(self) -> None:
        """Drain, then free the KV pool."""
        await self.servers[0].wait_for_requests_to_drain.remote()
        await self.servers[0].sleep.remote()

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return await self.servers[0].abort_all_requests.remote(reject_request=reject_request)

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        return await self.servers[0].abort_request.remote(request_id)
