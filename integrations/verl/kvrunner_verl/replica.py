"""verl's ``RolloutReplica`` for kvrunner, in verl's three layouts.

* **hybrid** (``init_hybrid``, verl's default for on-policy RL): the replica's rank
  ``k`` runs beside the trainer worker ``k`` of its slice of the worker group, on
  that worker's node and GPU. The trainer-side ``ServerAdapter`` pushes the
  weights to it by IPC buckets.
* **colocated** (``init_colocated``: a reward or teacher model beside the trainer):
  verl starts a worker group of its own ``CheckpointEngineWorker`` on the trainer's
  resource pool, and the ranks run beside those workers as in hybrid.
* **standalone** (``init_standalone``): the ranks take bundles of a placement group
  of their own (a GPU each on a GPU cluster).

Rank 0 is a :class:`~kvrunner_verl.server.KvrunnerServer` actor named
``kvrunner_server_<replica>_0``; ranks > 0 are ``kvrunner.ray.EngineRank`` actors.
There is no HTTP front: verl's load balancer keys the servers by
``kvrunner://<name>``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from kvrunner.ray.rank_actor import EngineRank
from kvrunner.ray.rank_setup import RankSpec
from kvrunner.ray.replica_start import start_replica
from kvrunner_verl.server import KvrunnerServer

#: Ray's own setting of CUDA_VISIBLE_DEVICES is turned off for a rank beside a trainer
#: worker: the rank takes no GPU of Ray's and is given the worker's card instead
_NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def server_name(replica_rank: int, role: str = "", suffix: str = "") -> str:
    """The Ray actor name of replica ``replica_rank``'s server: the policy's
    ``kvrunner_server_<replica>_0`` (the adapter finds it by this); a reward or
    teacher model's with its ``role`` and verl's name suffix in it."""
    return f"kvrunner_server_{role + '_' if role else ''}{replica_rank}_0{suffix}"


def engine_spec(config: Any, model_config: Any) -> RankSpec:
    """The engine every rank of a replica builds, from verl's rollout and model
    configs; ``engine_kwargs.kvrunner`` adds flat kvrunner overrides. verl's
    ``enable_rollout_routing_replay`` (R3) records every token's routed experts."""
    max_len = config.max_model_len or config.prompt_length + config.response_length
    overrides = {
        "max_num_seqs": config.max_num_seqs, "max_model_len": max_len,
        "enforce_eager": config.enforce_eager, "seed": config.seed,
        **({"enable_return_routed_experts": True} if routing_replay(config) else {}),
        **dict((config.engine_kwargs or {}).get("kvrunner", None) or {}),
    }
    path = getattr(model_config, "local_path", None) or model_config.path
    return RankSpec(model=str(path), config=overrides,
                    tensor_parallel_size=config.tensor_model_parallel_size)


def routing_replay(config: Any) -> bool:
    """Whether verl's rollout config asks for each rollout's routed experts (R3)."""
    return bool(getattr(config, "enable_rollout_routing_replay", False))


def _cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def _placement_of_this_worker(_worker: Any) -> tuple[str, str | None]:
    """(node id, GPU id or None): run inside a trainer worker by ``__ray_call__``."""
    context = ray.get_runtime_context()
    gpus = context.get_accelerator_ids().get("GPU") or []
    return context.get_node_id(), (str(gpus[0]) if gpus else None)


class KvrunnerReplica(RolloutReplica):
    """A kvrunner replica of ``tensor_model_parallel_size`` ranks (see the module
    docstring for where they run in each layout)."""

    def rollout_worker_use_gpu(self) -> bool:
        """Whether verl's colocated worker group takes GPUs: only on a GPU cluster
        (on the CPU the resource pool has none)."""
        return _cluster_has_gpus()

    async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
        """verl's hybrid start for engines that need the pool too: kvrunner places
        its ranks by the workers alone, as in :meth:`init_hybrid`."""
        await self.init_hybrid(worker_group)

    async def init_standalone(self) -> None:
        """Place the replica's ranks on a placement group of its own and start them."""
        from ray.util.placement_group import placement_group

        self.rollout_mode = RolloutMode.STANDALONE
        bundle = {"CPU": 1, **({"GPU": 1} if _cluster_has_gpus() else {})}
        self._pg = placement_group([dict(bundle)] * self.world_size, strategy="PACK")
        await self._pg.ready()
        await self.launch_servers()

    def _standalone_options(self, k: int) -> dict[str, Any]:
        """Rank ``k`` on bundle ``k`` of the replica's own placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return dict(num_cpus=1, num_gpus=1 if _cluster_has_gpus() else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=k))

    async def _beside_workers_options(self) -> list[dict[str, Any]]:
        """Rank ``k`` beside worker ``k``: on its node, seeing only its GPU (as
        ``cuda:0``), taking no Ray resources (they are the worker's)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if len(self.workers) != self.world_size:
            raise ValueError(f"replica {self.replica_rank} needs {self.world_size} trainer "
                             f"workers, the worker group gave {len(self.workers)}")
        placements = await asyncio.gather(*(w.__ray_call__.remote(_placement_of_this_worker)
                                           for w in self.workers))
        options = []
        for node_id, gpu in placements:
            env = {_NOSET: "1", "CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}
            options.append(dict(
                num_cpus=0, num_gpus=0, runtime_env={"env_vars": env},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)))
        return options

    async def launch_servers(self) -> None:
        """Start rank 0's server and ranks > 0 where the layout puts them."""
        spec = engine_spec(self.config, self.model_config)
        if self.rollout_mode == RolloutMode.STANDALONE:
            options = [self._standalone_options(k) for k in range(self.world_size)]
        else:
            options = await self._beside_workers_options()
        role = "reward" if self.is_reward_model else "teacher" if self.is_teacher_model else ""
        name = server_name(self.replica_rank, role, self.name_suffix)
        server = ray.remote(KvrunnerServer).options(
            name=name, max_concurrency=self.max_concurrency,
            **options[0],
        ).remote(spec, self.replica_rank, default_max_tokens=self.config.response_length,
                 free_cache_engine=self.config.free_cache_engine,
                 mode=self.rollout_mode.value, routing_replay=routing_replay(self.config))
        self._ranks = [ray.remote(EngineRank).options(**options[k]).remote(spec, k)
                       for k in range(1, self.world_size)]
        await start_replica(server, self._ranks)
        self.servers = [server]
        self._server_handle = server
        # no HTTP front: verl's load balancer keys servers by this name
        self._server_address = f"kvrunner://{name}"

    async def sleep(self) -> None:
        """Drain, then free memory as the layout wants (see ``KvrunnerServer.sleep``)."""
        await self.servers[0].wait_for_requests_to_drain.remote()
        await self.servers[0].sleep.remote()

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return await self.servers[0].abort_all_requests.remote(reject_request=reject_request)

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        return await self.servers[0].abort_request.remote(request_id)

