"""Two replicas of one rank each on a local Ray cluster: requests spread over both
and follow their id, a push reaches every replica (each then gives an in-process
engine's tokens for the pushed weights), a push from a trainer's process over one
weight-update group reaches both (each then gives transformers' tokens and the
trainer's checksum), control calls reach every replica, a replica killed
mid-rollout fails only its own requests, naming it, and one killed mid-push fails
the push naming it and leaves the fleet refusing to serve until a full push."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import ray
import torch
from fleet_cases import (
    GREEDY,
    PROMPTS,
    SEEDED,
    SMALL,
    checkpoint_tensors,
    join_group,
    push_over_group,
)

from kvrunner import SamplingParams
from kvrunner.ray import (
    FleetCallError,
    PartialPushError,
    ReplicaError,
    RolloutFleet,
    WeightGroupError,
)
from kvrunner.weight_sync import WeightSyncError
from kvrunner.weight_sync.checksum import tensor_digests

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def fleet(ray_cluster, checkpoints) -> Iterator[RolloutFleet]:
    fleet = RolloutFleet(2, 1, checkpoints[0], **SMALL)
    yield fleet
    asyncio.run(fleet.shutdown())


async def replica_tokens(fleet: RolloutFleet, replica: int) -> list[list[int]]:
    outs = await asyncio.gather(*(fleet.generate(p, GREEDY, replica=replica) for p in PROMPTS))
    seeded = await asyncio.gather(*(fleet.generate(p, SEEDED, replica=replica) for p in PROMPTS))
    return [o.token_ids for o in outs] + [o.token_ids for o in seeded]


def test_concurrent_requests_spread_over_both_replicas_and_an_id_sticks_to_its_replica(
    fleet, checkpoints, in_process
) -> None:
    async def run() -> None:
        ids = [f"spread-{i}" for i in range(4)]
        outs = await asyncio.gather(*(fleet.generate(PROMPTS[0], GREEDY, rid) for rid in ids))
        assert [o.token_ids for o in outs] == [in_process[checkpoints[0]][0]] * 4
        where = [fleet._router.replica_of(rid) for rid in ids]
        assert sorted(where) == [0, 0, 1, 1]
        # the next turn of spread-0 goes where it went, though both are idle again
        turn = await fleet.generate(PROMPTS[0] + outs[0].token_ids, GREEDY, "spread-0")
        assert fleet._router.replica_of("spread-0") == where[0]
        assert len(turn.token_ids) == GREEDY.max_tokens

    asyncio.run(run())


def test_abort_by_id_ends_the_request_on_its_replica_with_the_tokens_it_had(fleet) -> None:
    async def run() -> None:
        task = asyncio.ensure_future(fleet.generate(PROMPTS[1], LONG, "to-abort"))
        await asyncio.sleep(0.5)
        assert await fleet.abort("to-abort")
        out = await task
        assert out.finish_reason == "abort"
        assert 0 < len(out.token_ids) < LONG.max_tokens
        assert not await fleet.abort("to-abort")  # ended: nothing live under that id
        assert not await fleet.abort("never-sent")

    asyncio.run(run())


def test_a_push_reaches_every_replica_which_then_gives_the_in_process_tokens(
    fleet, checkpoints, in_process
) -> None:
    served, pushed = checkpoints
    assert in_process[served] != in_process[pushed]  # the push must change the tokens

    async def run() -> None:
        assert [await replica_tokens(fleet, r) for r in (0, 1)] == [in_process[served]] * 2
        loaded = await fleet.update_weights(checkpoint_tensors(pushed), weight_version="b")
        assert set(loaded) == {0, 1} and loaded[0] == loaded[1] > 0
        assert await fleet.weight_versions() == {0: "b", 1: "b"}
        assert fleet.weight_version == "b"
        assert [await replica_tokens(fleet, r) for r in (0, 1)] == [in_process[pushed]] * 2
        out = await fleet.generate(PROMPTS[0], GREEDY)
        assert out.weight_version == "b"
        # sleep and wake on every replica keep what each serves
        await fleet.sleep(1)
        assert not any(i.ranks[0].kv_resident for i in (await fleet.cache_info()).values())
        await fleet.wake_up()
        assert [await replica_tokens(fleet, r) for r in (0, 1)] == [in_process[pushed]] * 2
        await fleet.update_weights(checkpoint_tensors(served))
        assert await fleet.weight_versions() == {0: 2, 1: 2}  # the fleet counts its pushes

    asyncio.run(run())


def test_pause_keep_parks_rollouts_on_every_replica_across_a_push(fleet, checkpoints) -> None:
    async def run() -> None:
        tasks = [asyncio.ensure_future(fleet.generate(PROMPTS[2], LONG, f"kept-{r}", replica=r))
                 for r in (0, 1)]
        await asyncio.sleep(0.5)
        await fleet.pause("keep")
        await fleet.update_weights(checkpoint_tensors(checkpoints[0]), weight_version="again")
        await fleet.resume()
        outs = await asyncio.gather(*tasks)
        for out in outs:
            assert out.finish_reason == "length" and len(out.token_ids) == LONG.max_tokens
            assert len(out.weight_versions) == 2 and out.weight_versions[-1][0] == "again"

    asyncio.run(run())


def test_a_push_over_one_group_from_a_trainer_process_gives_each_replica_transformers_tokens(
    fleet, checkpoints, trainer, transformers_greedy
) -> None:
    served, pushed = checkpoints
    assert transformers_greedy[served] != transformers_greedy[pushed]

    async def run() -> None:
        plan = fleet.weight_group_plan("127.0.0.1", 1234)
        assert (plan.world_size, plan.offsets) == (3, {0: 1, 1: 2})
        loaded, digests = await push_over_group(fleet, trainer, pushed, version="g1",
                                                order_seed=4)
        assert loaded == {0: len(digests), 1: len(digests)}
        assert await fleet.weight_versions() == {0: "g1", 1: "g1"}
        for r in (0, 1):
            assert (await replica_tokens(fleet, r))[:len(PROMPTS)] == transformers_greedy[pushed]
        checksums = await fleet.weights_checksum()
        assert checksums == {0: digests, 1: digests}
        assert digests != tensor_digests(dict(checkpoint_tensors(served)), torch.float32)

    asyncio.run(run())


def test_without_a_group_a_distributed_push_is_refused_and_the_fleet_serves_on(
    fleet, checkpoints, transformers_greedy
) -> None:
    async def run() -> None:
        assert fleet.weight_group is None  # the last push's group was destroyed
        with pytest.raises(WeightGroupError, match="no weight-update group"):
            await fleet.update_weights_from_distributed(["lm_head.weight"], ["float32"],
                                                        [[1, 1]])
        out = await fleet.generate(PROMPTS[0], GREEDY)
        assert out.token_ids == transformers_greedy[checkpoints[1]][0]

    asyncio.run(run())


def test_a_replica_killed_mid_push_fails_the_push_naming_it_and_the_fleet_refuses_until_a_full_push(
    ray_cluster, checkpoints, trainer, transformers_greedy
) -> None:
    served, pushed = checkpoints
    fleet = RolloutFleet(2, 1, served, **SMALL)

    async def run() -> None:
        names, dtypes, shapes, digests = await join_group(fleet, trainer, pushed)
        sent = trainer.broadcast.remote(hold_after=5)
        push = asyncio.ensure_future(
            fleet.update_weights_from_distributed(names, dtypes, shapes, weight_version=1))
        assert await trainer.held.remote()
        ray.kill(fleet.replicas[1].actor, no_restart=True)
        trainer.go.remote()
        started = time.monotonic()
        with pytest.raises(FleetCallError) as failed:
            await push
        assert time.monotonic() - started < 20  # the survivor is not left to time out
        assert isinstance(failed.value.failures[1], ReplicaError)
        assert failed.value.failures[1].replica == 1 and "replica 1 died" in str(failed.value)
        assert isinstance(failed.value.failures[0], WeightSyncError)
        kind, message = await sent
        assert kind == "failed" and "group is released" in message
        assert fleet.live_replicas == [0] and fleet.weight_group is None
        assert (await fleet.cache_info())[0].weights == "partial"
        with pytest.raises(PartialPushError, match="version 1"):
            await fleet.generate(PROMPTS[0], GREEDY)
        # a full push, over a group built again on the survivor, serves again
        loaded, digests = await push_over_group(fleet, trainer, pushed, version=2)
        assert loaded == {0: len(names)}
        assert [(await fleet.generate(p, GREEDY)).token_ids for p in PROMPTS] == \
            transformers_greedy[pushed]
        assert await fleet.weights_checksum() == {0: digests}
        await fleet.shutdown()

    asyncio.run(run())


def test_a_replica_killed_mid_rollout_fails_its_requests_naming_it_and_the_rest_serve_on(
    ray_cluster, checkpoints, in_process
) -> None:
    fleet = RolloutFleet(2, 1, checkpoints[0], **SMALL)

    async def run() -> None:
        ids = [f"kill-{i}" for i in range(4)]
        tasks = [asyncio.ensure_future(fleet.generate(PROMPTS[0], LONG, rid)) for rid in ids]
        await asyncio.sleep(0.2)
        where = {rid: fleet._router.replica_of(rid) for rid in ids}
        assert sorted(where.values()) == [0, 0, 1, 1]
        started = time.monotonic()
        ray.kill(fleet.replicas[1].actor, no_restart=True)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - started < 30
        for rid, result in zip(ids, results, strict=True):
            if where[rid] == 1:
                assert isinstance(result, ReplicaError), result
                assert result.replica == 1
                assert "replica 1 died" in str(result) and rid in str(result)
            else:
                assert not isinstance(result, BaseException), result
                assert len(result.token_ids) == LONG.max_tokens
        assert fleet.live_replicas == [0]
        # new requests, and the dead replica's ids, are served by the survivor
        again = await asyncio.gather(*(fleet.generate(PROMPTS[0], GREEDY, rid) for rid in ids))
        assert [o.token_ids for o in again] == [in_process[checkpoints[0]][0]] * 4
        assert {fleet._router.replica_of(rid) for rid in ids} == {0}
        with pytest.raises(ReplicaError, match="replica 1 is dead"):
            await fleet.generate(PROMPTS[0], GREEDY, replica=1)
        assert await fleet.weight_versions() == {0: 0}  # control calls skip the dead one
        await fleet.shutdown()

    asyncio.run(run())
