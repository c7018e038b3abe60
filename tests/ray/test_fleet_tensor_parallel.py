"""One replica of two ranks on gloo, each rank a Ray actor on its own bundle (no
torchrun): it gives a single in-process rank's tokens, takes a push (each rank its
shard) through Ray's object store and over a weight-update group from a trainer's
process (both ranks in the group; then transformers' tokens and the trainer's
checksum), and a rank killed mid-rollout fails the replica's requests naming the
replica, with the group's error naming the rank."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import ray
from fleet_cases import GREEDY, PROMPTS, SEEDED, SMALL, checkpoint_tensors, push_over_group

from kvrunner import SamplingParams
from kvrunner.ray import NoReplicaError, ReplicaError, RolloutFleet


@pytest.fixture(scope="module")
def fleet(ray_cluster, checkpoints) -> Iterator[RolloutFleet]:
    fleet = RolloutFleet(1, 2, checkpoints[0], **SMALL)
    yield fleet
    asyncio.run(fleet.shutdown())


async def tokens(fleet: RolloutFleet) -> list[list[int]]:
    outs = await asyncio.gather(*(fleet.generate(p, GREEDY) for p in PROMPTS))
    seeded = await asyncio.gather(*(fleet.generate(p, SEEDED) for p in PROMPTS))
    return [o.token_ids for o in outs] + [o.token_ids for o in seeded]


def test_a_tp2_replica_on_ray_gives_one_rank_s_tokens_before_and_after_a_push(
    fleet, checkpoints, in_process
) -> None:
    served, pushed = checkpoints

    async def run() -> None:
        info = (await fleet.cache_info())[0]
        assert [r.rank for r in info.ranks] == [0, 1]
        assert await tokens(fleet) == in_process[served]
        await fleet.update_weights(checkpoint_tensors(pushed), weight_version=7)
        assert await fleet.weight_versions() == {0: 7}
        assert await tokens(fleet) == in_process[pushed]

    asyncio.run(run())


def test_both_ranks_join_one_group_with_the_trainer_and_a_push_over_it_lands_whole(
    fleet, checkpoints, trainer, transformers_greedy
) -> None:
    served, pushed = checkpoints

    async def run() -> None:
        await fleet.update_weights(checkpoint_tensors(served))
        plan = fleet.weight_group_plan("127.0.0.1", 1234)
        assert (plan.world_size, plan.offsets) == (3, {0: 1})
        loaded, digests = await push_over_group(fleet, trainer, pushed, version="g",
                                                order_seed=9)
        assert loaded == {0: len(digests)}
        assert (await tokens(fleet))[:len(PROMPTS)] == transformers_greedy[pushed]
        assert await fleet.weights_checksum() == {0: digests}

    asyncio.run(run())


def test_rank_1_killed_mid_rollout_fails_the_replica_s_requests_naming_it(fleet) -> None:
    async def run() -> None:
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        tasks = [asyncio.ensure_future(fleet.generate(PROMPTS[0], long, f"tp-{i}"))
                 for i in range(2)]
        await asyncio.sleep(0.5)
        ray.kill(fleet.replicas[0].ranks[0], no_restart=True)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            assert isinstance(result, ReplicaError), result
            assert result.replica == 0 and "replica 0 died or failed" in str(result)
            assert "rank(s) [1] are gone" in str(result), result
        assert fleet.live_replicas == []
        with pytest.raises(NoReplicaError):
            await fleet.generate(PROMPTS[0], GREEDY)

    asyncio.run(run())
