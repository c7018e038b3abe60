"""Routing replay (R3) through verl's own classes: with verl's
``enable_rollout_routing_replay`` a kvrunner replica launched by verl's
LLMServerManager records every token's routed experts, and verl's client gets them on
``TokenOutput.routed_experts`` as the ``[prompt + output - 1, layers, top_k]`` array
verl's agent loop aligns to the sequence (what its vLLM server hands on): the
in-process engine's routes for the same greedy request."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import ray

os.environ["VERL_USE_EXTERNAL_MODULES"] = "kvrunner_verl.register"  # before verl is imported

from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402
from verl_config import ENGINE, GREEDY, PROMPT, compose_trainer_config  # noqa: E402

from kvrunner import LLM, SamplingParams  # noqa: E402
from kvrunner.models.tiny import write_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("verl-moe") / "m",
                                     kind="qwen3-moe", seed=5))


def test_verl_s_client_gets_each_rollout_s_routed_experts(checkpoint) -> None:
    config = compose_trainer_config(checkpoint, "actor_rollout_ref.hybrid_engine=False",
                                    "actor_rollout_ref.rollout.n_gpus_per_node=1",
                                    "actor_rollout_ref.rollout.nnodes=1",
                                    "actor_rollout_ref.rollout.enable_rollout_routing_replay=True")
    with LLM(checkpoint, **ENGINE, enable_return_routed_experts=True) as llm:
        want = llm.generate([PROMPT], SamplingParams(
            max_tokens=GREEDY["max_tokens"], temperature=0.0, ignore_eos=True,
            return_routed_experts=True))[0]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        async def run():
            manager = await LLMServerManager.create(config)
            return await manager.get_client().generate(
                "traj-r3", prompt_ids=PROMPT, sampling_params=dict(GREEDY))

        out = asyncio.run(run())
    finally:
        ray.shutdown()
    assert out.token_ids == want.token_ids
    routes = out.routed_experts
    assert isinstance(routes, np.ndarray)
    assert routes.shape == (len(PROMPT) + len(out.token_ids) - 1, *want.routed_experts.shape[1:])
    np.testing.assert_array_equal(routes, want.routed_experts)
