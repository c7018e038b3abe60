"""The fleet on GPUs: each rank on its bundle's card (NCCL between ranks), the same
greedy tokens as an in-process engine on one card, before and after a push."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch
from fleet_cases import PROMPTS, checkpoint_tensors

from kvrunner import LLM, SamplingParams
from kvrunner.ray import RolloutFleet

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
GPU = dict(dtype="float32", max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.1)


@pytest.fixture(scope="module")
def gpu_cluster():
    ray.init(num_cpus=8, num_gpus=torch.cuda.device_count(), include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


def one_by_one(generate) -> list[list[int]]:
    return [generate(p) for p in PROMPTS]  # single requests: bf16 is not batch invariant


@pytest.mark.parametrize(("replicas", "tp"), [(1, 1), (2, 1), (1, 2)])
def test_fleet_ranks_on_their_bundles_gpus_give_the_in_process_tokens(
    gpu_cluster, checkpoints, replicas, tp
) -> None:
    if replicas * tp > torch.cuda.device_count():
        pytest.skip(f"needs {replicas * tp} GPUs, this host has {torch.cuda.device_count()}")
    served, pushed = checkpoints
    expected = {}
    for path in checkpoints:
        with LLM(path, **GPU) as llm:
            expected[path] = one_by_one(lambda p: llm.generate([p], GREEDY)[0].token_ids)
    fleet = RolloutFleet(replicas, tp, served, num_gpus_per_rank=1, **GPU)

    async def run() -> None:
        async def tokens(replica: int) -> list[list[int]]:
            return [(await fleet.generate(p, GREEDY, replica=replica)).token_ids
                    for p in PROMPTS]

        info = await fleet.cache_info()
        assert all(r.device.startswith("cuda") for i in info.values() for r in i.ranks)
        assert [await tokens(r) for r in range(replicas)] == [expected[served]] * replicas
        await fleet.update_weights(checkpoint_tensors(pushed), weight_version=1)
        assert [await tokens(r) for r in range(replicas)] == [expected[pushed]] * replicas
        await fleet.shutdown()

    asyncio.run(run())
