"""kvrunner selected by name in verl 0.9 and driven through verl's own classes on a
local Ray cluster: verl's LLMServerManager launches two replicas, verl's client
generates through verl's load balancer, a push goes through the ServerAdapter, and
an abort mid-rollout is resumed by verl's FullyAsyncLLMServerClient (a partial
rollout across a weight update)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import ray
import torch

os.environ["VERL_USE_EXTERNAL_MODULES"] = "kvrunner_verl.register"  # before verl is imported

from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.llm_server import (  # noqa: E402
    FullyAsyncLLMServerClient,
    LLMServerManager,
)
from verl_config import GREEDY, PROMPT, compose_trainer_config, in_process  # noqa: E402

from kvrunner.models.loader import iter_safetensors  # noqa: E402
from kvrunner.models.tiny import write_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("verl-ckpt")
    return (str(write_tiny_checkpoint(root / "a", seed=5)),
            str(write_tiny_checkpoint(root / "b", seed=6)))


@pytest.fixture(scope="module")
def config(checkpoints):
    return compose_trainer_config(checkpoints[0], "actor_rollout_ref.hybrid_engine=False",
                                  "actor_rollout_ref.rollout.n_gpus_per_node=2",
                                  "actor_rollout_ref.rollout.nnodes=1")


@pytest.fixture(scope="module")
def manager(config):
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    manager = asyncio.run(_create(config))
    yield manager
    ray.shutdown()


async def _create(config):
    return await LLMServerManager.create(config)


def test_verl_launches_kvrunner_replicas_by_name_and_generates_through_its_client(
    manager, checkpoints
) -> None:
    assert len(manager.get_replicas()) == 2
    client = manager.get_client()
    expected = in_process(checkpoints[0])

    async def run():
        return await asyncio.gather(*(client.generate(
            f"traj-{i}", prompt_ids=PROMPT, sampling_params=dict(GREEDY)) for i in range(4)))

    outs = asyncio.run(run())
    for out in outs:
        assert out.token_ids == expected and out.stop_reason == "completed"
        assert len(out.log_probs) == 6 and all(lp <= 0 for lp in out.log_probs)


async def push(manager, config, checkpoint: str, global_steps: int) -> None:
    """Every replica takes ``checkpoint`` through verl's server adapter for kvrunner, as
    verl's trainer pushes a step's weights."""
    adapter_cls = get_rollout_class("kvrunner", "async")
    for replica in manager.get_replicas():
        adapter = adapter_cls(config=config.actor_rollout_ref.rollout,
                              model_config=config.actor_rollout_ref.model,
                              device_mesh=None, replica_rank=replica.replica_rank)
        await adapter.update_weights(iter(iter_safetensors(Path(checkpoint), torch.float32)),
                                     global_steps=global_steps)


def test_a_push_through_the_server_adapter_then_verl_sees_the_new_weights_and_steps(
    manager, config, checkpoints
) -> None:
    served, pushed = checkpoints
    expected = in_process(pushed)
    assert expected != in_process(served)

    async def run():
        await push(manager, config, pushed, global_steps=3)
        client = manager.get_client()
        return await asyncio.gather(*(client.generate(
            f"after-{i}", prompt_ids=PROMPT, sampling_params=dict(GREEDY)) for i in range(4)))

    for out in asyncio.run(run()):
        assert out.token_ids == expected
        assert out.extra_fields["global_steps"] == 3


async def in_an_engine(replicas, timeout_s: float = 30.0) -> None:
    """Return once some replica's engine holds a request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await asyncio.gather(*(r.servers[0].engine_stats.remote() for r in replicas))
        if any(s.num_running + s.num_waiting for s in stats):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"no replica received the request within {timeout_s} s")


def test_an_abort_mid_rollout_is_resumed_by_verl_s_client_across_a_weight_update(
    manager, config, checkpoints
) -> None:
    long = {"temperature": 0.0, "max_tokens": 300, "ignore_eos": True}

    async def run():
        await push(manager, config, checkpoints[0], global_steps=3)
        client = manager.get_client(FullyAsyncLLMServerClient)
        task = asyncio.ensure_future(client.generate("partial", prompt_ids=PROMPT,
                                                     sampling_params=dict(long)))
        replicas = manager.get_replicas()
        await in_an_engine(replicas)
        aborted = await asyncio.gather(*(r.abort_all_requests() for r in replicas))
        assert sum(a["aborted_count"] for a in aborted) == 1, (aborted, task.done())
        await push(manager, config, checkpoints[0], global_steps=4)
        await asyncio.gather(*(r.resume_generation() for r in replicas))
        return await task

    out = asyncio.run(run())
    assert len(out.token_ids) == 300
    assert out.extra_fields["min_global_steps"] == 3 and out.extra_fields["max_global_steps"] == 4
