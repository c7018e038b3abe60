"""``RolloutFleet``: engine replicas on a Ray cluster, driven as one rollout engine.

::

    ray.init()
    fleet = RolloutFleet(num_replicas=4, tensor_parallel_size=2, model="/ckpt")
    out = await fleet.generate(prompt_ids, SamplingParams(max_tokens=256), request_id="traj-7")
    await fleet.pause("keep")
    await fleet.update_weights(state_dict, weight_version=12)
    await fleet.resume()
    await fleet.shutdown()

Placement: one placement group of ``num_replicas * tensor_parallel_size`` bundles
(each ``num_cpus_per_rank`` CPUs and, on a GPU cluster, one GPU); replica ``r``
takes bundles ``r * tp`` to ``r * tp + tp - 1``, its rank ``k`` on bundle
``r * tp + k``. Rank 0 is an :class:`~kvrunner.ray.replica_actor.EngineReplica`
(the replica's ``AsyncLLM``), ranks > 0 are
:class:`~kvrunner.ray.rank_actor.EngineRank` actors; they meet through a store
rank 0 serves, with no torchrun.

Routing (:mod:`kvrunner.ray.router`): a request id goes back to the replica it was
last served on (multi-turn rollouts keep their prefix cache), a new one to the
least loaded replica; ``generate(..., replica=i)`` pins it.

Failures: a replica whose actor dies, or whose tensor-parallel group fails,
is marked dead; every request that was on it fails with a
:class:`~kvrunner.ray.errors.ReplicaError` naming it, and the fleet keeps serving
on the others. Requests are not retried on another replica: a retry would start
the rollout again from its prompt, perhaps under other weights, and hand back tokens
the caller did not ask to have redrawn; the caller (the RL framework) decides.

Weights, two ways:

- :meth:`RolloutFleet.update_weights` puts the tensors into Ray's object store once
  and every replica's rank 0 loads them from there (each rank takes its shard).
- A weight-update group (:mod:`kvrunner.ray.weight_group`): the trainer's rank 0 and
  every rank of every replica in one process group
  (:meth:`RolloutFleet.init_weights_update_group`); a push is one broadcast per
  tensor that every replica rank receives (:meth:`RolloutFleet.update_weights_from_distributed`).

A push that fails on any replica (either way) leaves the fleet refusing to generate
(:class:`~kvrunner.ray.errors.PartialPushError`) until a push reaches every live
replica: the replicas may hold different weights, and none is served silently.
A group push that fails also ends the group on every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from kvrunner.config import ConfigError
from kvrunner.distributed.errors import CollectiveError, WorkerError
from kvrunner.ray.errors import (
    FleetCallError,
    NoReplicaError,
    PartialPushError,
    ReplicaError,
    WeightGroupError,
)
from kvrunner.ray.rank_actor import EngineRank
from kvrunner.ray.rank_setup import RankSpec
from kvrunner.ray.replica import Replica
from kvrunner.ray.replica_actor import EngineReplica
from kvrunner.ray.replica_start import start_replica
from kvrunner.ray.router import ReplicaRouter
from kvrunner.ray.weight_group import FleetBroadcaster, FleetWeightGroup, plan_group

if TYPE_CHECKING:
    import torch

    from kvrunner.async_llm import Prompt
    from kvrunner.outputs import RequestOutput
    from kvrunner.sampling_params import SamplingParams

#: concurrent calls one replica actor takes (requests and control calls together)
MAX_CONCURRENCY = 100_000


class RolloutFleet:
    """``num_replicas`` engine replicas of ``tensor_parallel_size`` ranks each, on the
    Ray cluster this process is connected to (``ray.init()`` is called if it is not).

    Built synchronously: returns once every replica has loaded its model and can
    serve. From a running event loop, build it with ``await asyncio.to_thread(...)``.

    :param model: the checkpoint directory every rank loads (visible on every node),
        or an embedded default.
    :param num_gpus_per_rank: GPUs in each bundle; unset: 1 when the cluster has GPUs,
        else 0 (ranks on the CPU, gloo).
    :param num_cpus_per_rank: CPUs in each bundle (and torch's threads on the CPU).
    :param placement_strategy: the placement group's strategy (``"PACK"``,
        ``"SPREAD"``, ``"STRICT_PACK"`` ...).
    :param startup_timeout_s: how long to wait for the bundles and the replicas.
    :param config: flat engine overrides, as ``LLM(**config)`` takes them.
    """

    def __init__(
        self,
        num_replicas: int = 1,
        tensor_parallel_size: int = 1,
        model: str | None = None,
        *,
        num_gpus_per_rank: float | None = None,
        num_cpus_per_rank: float = 1,
        placement_strategy: str = "PACK",
        sticky_capacity: int = 100_000,
        startup_timeout_s: float = 3600.0,
        **config: Any,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group

        for name, value in (("num_replicas", num_replicas),
                            ("tensor_parallel_size", tensor_parallel_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"RolloutFleet: {name} must be an integer >= 1, got {value!r}")
        if "tensor_parallel_size" in config:
            raise ConfigError("RolloutFleet: pass tensor_parallel_size as its own argument")
        if not ray.is_initialized():
            ray.init()
        if num_gpus_per_rank is None:
            num_gpus_per_rank = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        self.num_replicas = num_replicas
        self.tensor_parallel_size = tensor_parallel_size
        self.spec = RankSpec(model=model, config=dict(config),
                             tensor_parallel_size=tensor_parallel_size,
                             cpu_threads=max(1, int(num_cpus_per_rank)))
        bundle = {"CPU": num_cpus_per_rank}
        if num_gpus_per_rank:
            bundle["GPU"] = num_gpus_per_rank
        self._router = ReplicaRouter(num_replicas, sticky_capacity=sticky_capacity)
        self._num_updates = 0
        self._on_gpus = bool(num_gpus_per_rank)
        #: the weight-update group every replica rank is in (None: none)
        self.weight_group: FleetWeightGroup | None = None
        #: why the last push failed part way over the fleet (None: the last push was whole)
        self.push_failure: str | None = None
        #: the version of the last weight push every live replica took
        self.weight_version: str | int = 0
        self.replicas: list[Replica] = []
        self._pg = placement_group([dict(bundle)] * (num_replicas * tensor_parallel_size),
                                   strategy=placement_strategy)
        try:
            try:
                ray.get(self._pg.ready(), timeout=startup_timeout_s)
            except ray.exceptions.GetTimeoutError:
                count = num_replicas * tensor_parallel_size
                raise ConfigError(
                    f"RolloutFleet: the cluster did not provide {count}"
                    f" bundles of {bundle} ({placement_strategy}) within {startup_timeout_s} s; "
                    f"it has {ray.available_resources()} free"
                ) from None
            self.replicas = [self._place(r, bundle) for r in range(num_replicas)]
            self._start_all(startup_timeout_s)
        except BaseException:
            self._release()
            raise

    # -- start-up ------------------------------------------------------------------------

    def _place(self, index: int, bundle: dict[str, float]) -> Replica:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def on_bundle(k: int) -> dict[str, Any]:
            return dict(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg,
                    placement_group_bundle_index=index * self.tensor_parallel_size + k,
                ),
            )

        actor = ray.remote(EngineReplica).options(
            max_concurrency=MAX_CONCURRENCY, **on_bundle(0)
        ).remote(self.spec, index)
        ranks = [ray.remote(EngineRank).options(**on_bundle(k)).remote(self.spec, k)
                 for k in range(1, self.tensor_parallel_size)]
        return Replica(index=index, actor=actor, ranks=ranks)

    def _start_all(self, timeout_s: float) -> None:
        import ray

        ray.get([start_replica(r.actor, r.ranks) for r in self.replicas], timeout=timeout_s)

    # -- requests ------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        replica: int | None = None,
    ) -> RequestOutput:
        """Generate on one replica: ``replica`` if given, else the one ``request_id``
        was last served on, else the least loaded. Cancelling the awaiting task
        aborts the request there.

        Raises :class:`ReplicaError` if that replica dies or fails meanwhile (its
        other requests fail too; the fleet serves on without it),
        :class:`PartialPushError` after a weight push that failed part way, and what
        ``AsyncLLM.generate`` raises (``RequestError`` ...) as itself.
        """
        request_id = request_id or uuid.uuid4().hex
        if self.push_failure is not None:
            raise PartialPushError(f"cannot serve request {request_id!r}: {self.push_failure}; "
                                   f"generation is refused until a push reaches every live "
                                   f"replica {self.live_replicas}")
        index = self._route(request_id, replica)
        actor = self.replicas[index].actor
        try:
            return await self._ask(index, f"serving request {request_id!r}",
                                   actor.generate.remote(prompt, params, request_id))
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):  # a dead replica has nothing to abort
                actor.abort.remote(request_id)
            raise
        finally:
            self._router.finished(index)

    def _route(self, request_id: str, replica: int | None) -> int:
        if replica is None:
            return self._router.pick(request_id)
        if not isinstance(replica, int) or not 0 <= replica < self.num_replicas:
            raise ConfigError(f"replica must be in [0, {self.num_replicas}), got {replica!r}")
        if not self.replicas[replica].alive:
            raise ReplicaError(f"replica {replica} is dead: {self.replicas[replica].error}",
                               replica=replica)
        return self._router.pin(request_id, replica)

    async def abort(self, request_id: str) -> bool:
        """Abort ``request_id`` on the replica it was sent to; False if it is not live
        (or its replica is dead)."""
        index = self._router.replica_of(request_id)
        if index is None or not self.replicas[index].alive:
            return False
        return await self._ask(index, f"aborting {request_id!r}",
                               self.replicas[index].actor.abort.remote(request_id))

    async def abort_all(self) -> int:
        """Abort every live request on every replica; returns how many."""
        return sum((await self._on_all("abort_all", lambda a: a.abort_all.remote())).values())

    # -- control, on every live replica ---------------------------------------------------

    async def pause(self, mode: Literal["abort", "keep", "wait"] = "abort") -> None:
        """``AsyncLLM.pause(mode)`` on every replica (see there)."""
        await self._on_all("pause", lambda a: a.pause.remote(mode))

    async def resume(self) -> None:
        """``AsyncLLM.resume()`` on every replica."""
        await self._on_all("resume", lambda a: a.resume.remote())

    async def wait_for_requests_to_drain(self, timeout: float | None = None) -> None:
        """Return once no request is live on any replica."""
        await self._on_all("wait_for_requests_to_drain",
                           lambda a: a.wait_for_requests_to_drain.remote(timeout))

    async def sleep(self, level: int = 1, **kwargs: Any) -> dict[int, float]:
        """``AsyncLLM.sleep(level, **kwargs)`` on every replica; seconds by replica."""
        return await self._on_all("sleep", lambda a: a.sleep.remote(level, kwargs))

    async def wake_up(self, tags: Iterable[str] | str | None = None) -> dict[int, float]:
        """``AsyncLLM.wake_up(tags)`` on every replica; seconds by replica."""
        tags = list(tags) if tags is not None and not isinstance(tags, str) else tags
        return await self._on_all("wake_up", lambda a: a.wake_up.remote(tags))

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        weight_version: str | int | None = None,
        **kwargs: Any,
    ) -> dict[int, int]:
        """Push ``(name, tensor)`` pairs (full tensors, HF names) to every replica, as
        ``AsyncLLM.update_weights`` takes them (pause first, or no requests). The
        tensors go into Ray's object store once. Every replica then serves
        ``weight_version`` (unset: the count of fleet pushes, 1, 2, ...). Returns the
        tensors loaded by replica."""
        import ray

        pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        version = self._num_updates + 1 if weight_version is None else weight_version
        ref = ray.put(pairs)
        loaded = await self._pushed(version, self._on_all(
            "update_weights", lambda a: a.update_weights.remote(ref, version, kwargs)))
        return loaded

    # -- the weight-update group ------------------------------------------------------------

    def weight_group_plan(
        self, master_address: str, master_port: int, *, backend: str | None = None,
        group_name: str = "kvrunner_weights", timeout_s: float = 300.0,
    ) -> FleetWeightGroup:
        """The weight-update group of the trainer's rank 0 and every rank of every live
        replica (nothing joins yet): trainer rank 0, then replica by replica its
        tensor-parallel ranks. Hand it to the trainer's process, which makes its rank
        0 with ``plan.broadcaster(device)``. ``backend``: unset, NCCL on GPUs, gloo on
        the CPU."""
        if backend is None:
            backend = "nccl" if self._on_gpus else "gloo"
        live = self.live_replicas
        if not live:
            raise NoReplicaError("weight_group_plan: every replica of the fleet has died")
        return plan_group({r: self.tensor_parallel_size for r in live},
                          master_address=master_address, master_port=master_port,
                          backend=backend, group_name=group_name, timeout_s=timeout_s)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, *, backend: str | None = None,
        group_name: str = "kvrunner_weights", timeout_s: float = 300.0,
    ) -> FleetWeightGroup:
        """Join every rank of every live replica, all at once, to the group
        :meth:`weight_group_plan` describes for the same arguments; returns once the
        whole group has formed, the trainer's rank 0 included (it joins meanwhile with
        ``plan.broadcaster(device).connect()``, from any process). Raises
        :class:`WeightGroupError` if the fleet is in a group already, and
        :class:`FleetCallError` if a replica could not join (the group is then ended
        on every replica)."""
        if self.weight_group is not None:
            raise WeightGroupError("the fleet is in a weight-update group already: "
                                   "destroy_weights_update_group first")
        plan = self.weight_group_plan(master_address, master_port, backend=backend,
                                      group_name=group_name, timeout_s=timeout_s)
        options = dict(backend=plan.backend, group_name=group_name, timeout_s=timeout_s)
        try:
            await self._on_each("init_weights_update_group", plan.replicas, lambda r: (
                r.actor.init_weights_update_group.remote(
                    master_address, master_port, plan.offsets[r.index], plan.world_size,
                    options)))
        except BaseException:
            await self._leave_group(plan.replicas)
            raise
        self.weight_group = plan
        return plan

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
        weight_version: str | int | None = None,
    ) -> dict[int, int]:
        """Every replica of the group receives one push over it (one broadcast per
        tensor from the trainer's rank 0, which runs
        ``FleetBroadcaster.broadcast(weights)`` meanwhile, with ``names, dtypes, shapes
        = FleetBroadcaster.spec(weights)``); each rank keeps its shard. Pause first,
        or no requests, as for :meth:`update_weights`; every replica then serves
        ``weight_version``. Returns the tensors loaded by replica.

        Raises :class:`WeightGroupError`, sending nothing, if there is no group or a
        replica of it has died since it was built (build it again over the live
        replicas). If the push fails on any replica (a replica dies mid-push: a
        :class:`ReplicaError` naming it; the trainer dies: each replica's
        ``WeightSyncError``), it raises :class:`FleetCallError` naming each replica,
        ends the group on every replica, and the fleet refuses to generate
        (:class:`PartialPushError`) until a push reaches every live replica."""
        plan = self._group_to_push_over()
        version = self._num_updates + 1 if weight_version is None else weight_version
        names, dtypes, shapes = list(names), list(dtypes), [list(s) for s in shapes]
        try:
            return await self._pushed(version, self._on_each(
                "update_weights_from_distributed", plan.replicas, lambda r: (
                    r.actor.update_weights_from_distributed.remote(names, dtypes, shapes,
                                                                   version))))
        except FleetCallError:
            # a broken broadcast leaves the group unusable on every member
            await self.destroy_weights_update_group()
            raise

    def _group_to_push_over(self) -> FleetWeightGroup:
        plan = self.weight_group
        if plan is None:
            raise WeightGroupError("no weight-update group: call init_weights_update_group "
                                   "first (with the trainer's rank 0 connecting meanwhile)")
        dead = [r for r in plan.replicas if not self.replicas[r].alive]
        if dead:
            raise WeightGroupError(
                f"the weight-update group spans replica(s) {dead}, dead since it was built "
                f"({'; '.join(str(self.replicas[r].error) for r in dead)}): "
                f"destroy_weights_update_group, then init_weights_update_group over the "
                f"live replicas {self.live_replicas}")
        return plan

    async def push_over_group(
        self, sender: FleetBroadcaster, weights: Iterable[tuple[str, torch.Tensor]], *,
        weight_version: str | int | None = None,
    ) -> dict[int, int]:
        """One push when the trainer's rank 0 lives in this process: ``sender``
        broadcasts (on a thread) while every replica receives. Returns the tensors
        loaded by replica; fails as :meth:`update_weights_from_distributed` (or with
        the sender's ``WeightSyncError`` if only the trainer's side failed)."""
        self._group_to_push_over()  # refused before the sender starts broadcasting
        pairs = list(weights)
        receiving = asyncio.ensure_future(self.update_weights_from_distributed(
            *sender.spec(pairs), weight_version=weight_version))
        sending = asyncio.ensure_future(asyncio.to_thread(sender.broadcast, pairs))
        await asyncio.wait([receiving, sending])
        if receiving.exception() is None and sending.exception() is not None:
            raise sending.exception()
        sending.exception()  # the replicas' failure says more; the sender's is retrieved
        return receiving.result()

    async def destroy_weights_update_group(self) -> None:
        """Leave the weight-update group on every live replica of it (idempotent); the
        trainer's rank 0 leaves with ``FleetBroadcaster.close()``."""
        plan, self.weight_group = self.weight_group, None
        if plan is not None:
            await self._leave_group(plan.replicas)

    async def _leave_group(self, replicas: list[int]) -> None:
        live = [self.replicas[r] for r in replicas if self.replicas[r].alive]
        with contextlib.suppress(Exception):  # a replica that dies now has left it
            await asyncio.gather(*(r.actor.destroy_weights_update_group.remote() for r in live),
                                 return_exceptions=True)

    async def weights_checksum(self) -> dict[int, dict[str, str]]:
        """``AsyncLLM.weights_checksum()`` of each live replica, by replica: per-tensor
        digests under HF names, shards merged (equal to the trainer's
        ``kvrunner.weight_sync.checksum.tensor_digests`` after a whole push)."""
        return await self._on_all("weights_checksum", lambda a: a.weights_checksum.remote())

    async def _pushed(self, version: str | int,
                      push: Awaitable[dict[int, int]]) -> dict[int, int]:
        """Run a push to every live replica: whole, the fleet serves ``version``;
        failed on any, the fleet refuses to generate until a whole push."""
        try:
            loaded = await push
        except (FleetCallError, NoReplicaError) as e:
            self.push_failure = f"the weight push of version {version!r} failed: {e}"
            raise
        self.push_failure = None
        self._num_updates += 1
        self.weight_version = version
        return loaded

    async def reset_prefix_cache(self) -> dict[int, int]:
        """Forget every cached prefix on every replica; blocks uncached by replica."""
        return await self._on_all("reset_prefix_cache", lambda a: a.reset_prefix_cache.remote())

    async def weight_versions(self) -> dict[int, str | int]:
        """The weight version each live replica serves, by replica."""
        return await self._on_all("weight_version", lambda a: a.weight_version.remote())

    async def cache_info(self) -> dict[int, Any]:
        """``AsyncLLM.cache_info()`` of each live replica, by replica."""
        return await self._on_all("cache_info", lambda a: a.cache_info.remote())

    @property
    def live_replicas(self) -> list[int]:
        """The indices of the replicas still serving."""
        return [r.index for r in self.replicas if r.alive]

    # -- lifetime ------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Abort every request, release every replica's model, end its actors and the
        placement group. Idempotent."""
        await self.destroy_weights_update_group()
        live = [r for r in self.replicas if r.alive]
        with contextlib.suppress(Exception):  # a replica that dies now is ended below
            await asyncio.gather(*(r.actor.shutdown.remote() for r in live),
                                 return_exceptions=True)
        for r in live:
            r.end("the fleet was shut down")
            self._router.mark_dead(r.index)
        self._release()

    async def __aenter__(self) -> RolloutFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def _release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for replica in self.replicas:
            replica.kill()
        if self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None

    # -- how calls reach replicas ---------------------------------------------------------

    async def _ask(self, index: int, doing: str, ref: Awaitable[Any]) -> Any:
        """Await one replica's answer; a dead or failed replica becomes a ReplicaError
        (and is marked dead); an error its engine raised is raised as itself."""
        import ray

        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            raise await self._dead(index, doing, e) from e
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else e
            # its tensor-parallel group failed: the replica cannot serve again
            if isinstance(cause, WorkerError | CollectiveError):
                raise await self._dead(index, doing, cause) from cause
            raise cause from None

    async def _on_all(self, what: str, call: Callable[[Any], Awaitable[Any]]) -> dict[int, Any]:
        return await self._on_each(what, self.live_replicas, lambda r: call(r.actor))

    async def _on_each(self, what: str, indices: list[int],
                       call: Callable[[Replica], Awaitable[Any]]) -> dict[int, Any]:
        """``call`` on each of the replicas ``indices`` (alive) at once; answers by
        replica, or a FleetCallError naming each that failed."""
        live = [self.replicas[i] for i in indices]
        if not live:
            raise NoReplicaError(f"{what}: every replica of the fleet has died")
        answers = await asyncio.gather(
            *(self._ask(r.index, what, call(r)) for r in live), return_exceptions=True)
        results = {r.index: a for r, a in zip(live, answers, strict=True)
                   if not isinstance(a, BaseException)}
        failures = {r.index: a for r, a in zip(live, answers, strict=True)
                    if isinstance(a, BaseException)}
        if failures:
            raise FleetCallError(what, failures, results)
        return results

    async def _dead(self, index: int, doing: str, cause: BaseException) -> ReplicaError:
        """Replica ``index`` failed: it stops getting requests, and the error says why
        (see :class:`~kvrunner.ray.replica.Replica`)."""
        replica = self.replicas[index]
        if replica.alive:
            self._router.mark_dead(index)
        error = await replica.fail(cause)
        return ReplicaError(f"replica {index} died or failed while {doing}: {error}; "
                            f"the fleet serves on replicas {self.live_replicas}",
                            replica=index)
