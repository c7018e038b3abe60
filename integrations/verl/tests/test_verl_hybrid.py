"""kvrunner in verl's hybrid layout, launched and synced through verl's own code on a
local Ray cluster on the CPU: verl's RayResourcePool and RayWorkerGroup place the
trainer workers, verl's LLMServerManager starts one kvrunner replica beside each
(``KvrunnerReplica.init_hybrid``), verl's CheckpointEngineManager puts them to sleep
and runs the naive weight sync, in which each trainer's ServerAdapter pushes its
weights to the replica beside it over shared-memory IPC buckets; verl's client then
generates the trainer's own greedy tokens. At TP=1 that is two replicas, each fed
by its own trainer; at TP=2 one replica over both trainers' places, fed by the
first (the second iterates its stream). A colocated replica (a reward model's
layout) starts beside verl's own CheckpointEngineWorker group and keeps its weights
across a sleep.

What verl cannot run on the CPU, the trainer's engine, is replaced by a
transformers model in a verl Worker (see verl_trainer.py for why)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import ray

os.environ["VERL_USE_EXTERNAL_MODULES"] = "kvrunner_verl.register"  # before verl is imported

from verl.checkpoint_engine import CheckpointEngineManager  # noqa: E402
from verl.single_controller.ray import (  # noqa: E402
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402
from verl.workers.rollout.replica import RolloutMode, get_rollout_replica_class  # noqa: E402
from verl_config import GREEDY, PROMPT, compose_trainer_config, in_process  # noqa: E402
from verl_trainer import HybridTrainerWorker  # noqa: E402

from kvrunner.models.tiny import write_tiny_checkpoint  # noqa: E402

TRAINERS = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("verl-hybrid") / "a", seed=5))


@pytest.fixture(scope="module", params=[1, 2], ids=lambda tp: f"tp{tp}")
def tp(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def config(checkpoint, tp):
    return compose_trainer_config(checkpoint, "actor_rollout_ref.hybrid_engine=True",
                                  tensor_parallel_size=tp)


@pytest.fixture(scope="module")
def cluster():
    # the trainer workers import verl_trainer from this directory
    here = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def trainers(cluster, config, checkpoint, tp):
    pool = RayResourcePool([TRAINERS], use_gpu=False, max_colocate_count=1)
    worker = RayClassWithInitArgs(cls=ray.remote(HybridTrainerWorker),
                                  config=config.actor_rollout_ref, checkpoint=checkpoint)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker,
                           name_prefix=f"hybrid_trainer_tp{tp}", use_gpu=False)
    yield group
    for worker in group.workers:
        ray.kill(worker)
    for pg in pool.get_placement_groups():
        ray.util.remove_placement_group(pg)


@pytest.fixture(scope="module")
def manager(trainers, config):
    manager = LLMServerManager.create(config=config, worker_group=trainers)
    yield manager
    for replica in manager.get_replicas():  # the next layout reuses the server names
        for actor in [*replica.servers, *replica._ranks]:
            ray.kill(actor)


def test_verl_starts_a_kvrunner_replica_beside_each_trainer_worker_in_hybrid_mode(
    manager, trainers, checkpoint, tp
) -> None:
    replicas = manager.get_replicas()
    assert len(replicas) == TRAINERS // tp
    for k, replica in enumerate(replicas):
        assert replica.rollout_mode == RolloutMode.HYBRID
        assert replica.workers == trainers.workers[k * tp : (k + 1) * tp]
        assert len(replica._ranks) == tp - 1
        assert replica.server_address == f"kvrunner://kvrunner_server_{k}_0"
    nodes = ray.get([w.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
                     for w in trainers.workers])
    assert ray.get([r.servers[0].node_id.remote() for r in replicas]) == nodes[::tp]

    async def run():
        client = manager.get_client()
        return await asyncio.gather(*(client.generate(
            f"before-{i}", prompt_ids=PROMPT, sampling_params=dict(GREEDY)) for i in range(4)))

    expected = in_process(checkpoint)
    assert all(out.token_ids == expected for out in asyncio.run(run()))


def test_verl_s_naive_sync_pushes_each_trainer_s_weights_over_shared_memory_ipc(
    manager, trainers, config, checkpoint
) -> None:
    checkpoints = CheckpointEngineManager(
        config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine),
        actor_wg=trainers, replicas=manager.get_replicas())
    assert checkpoints.backend == "naive"
    checkpoints.sleep_replicas()  # hybrid: the KV pool and the weights are let go
    trainers.train_step(seed=11, scale=0.5)
    expected = trainers.greedy(PROMPT, 6)[0]
    assert expected != in_process(checkpoint)  # the step changed what the policy says
    checkpoints.update_weights(global_steps=7)

    async def run():
        client = manager.get_client()
        return await asyncio.gather(*(client.generate(
            f"after-{i}", prompt_ids=PROMPT, sampling_params=dict(GREEDY)) for i in range(8)))

    for out in asyncio.run(run()):
        assert out.token_ids == expected and out.stop_reason == "completed"
        assert out.extra_fields["global_steps"] == 7
    tensors = trainers.num_tensors()[0]
    for replica in manager.get_replicas():
        assert ray.get(replica.servers[0].last_weight_update.remote()) == {
            "path": "shared_memory", "loaded": tensors, "global_steps": 7}


def test_a_colocated_replica_runs_beside_verl_s_workers_and_keeps_its_weights_asleep(
    cluster, checkpoint
) -> None:
    config = compose_trainer_config(checkpoint)
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=2)  # a shared pool
    replica = get_rollout_replica_class("kvrunner")(
        replica_rank=0, config=config.actor_rollout_ref.rollout,
        model_config=config.actor_rollout_ref.model, gpus_per_node=1, is_reward_model=True)
    asyncio.run(replica.init_colocated(pool))  # as verl's reward and teacher managers do
    assert replica.rollout_mode == RolloutMode.COLOCATED
    assert replica.server_address == "kvrunner://kvrunner_server_reward_0_0"
    assert len(replica.workers) == 1  # verl's CheckpointEngineWorker, on the pool

    def generate(request_id: str) -> list[int]:
        out = ray.get(replica.server_handle.generate.remote(PROMPT, dict(GREEDY), request_id))
        return out.token_ids

    expected = in_process(checkpoint)
    assert generate("colocated-0") == expected
    asyncio.run(replica.sleep())  # colocated: KV pool and weights freed, weights kept on host
    asyncio.run(replica.wake_up())
    assert generate("colocated-1") == expected
