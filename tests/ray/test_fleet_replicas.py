"""Two replicas of one rank each on a local Ray cluster: requests spread over both
and follow their id, a push reaches every replica (each then gives an in-process
engine's tokens for the pushed weights), control calls reach every replica, and a
replica killed mid-rollout fails only its own requests, naming it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import ray
from fleet_cases import GREEDY, PROMPTS, SEEDED, SMALL, checkpoint_tensors

from kvrunner import SamplingParams
from kvrunner.ray import ReplicaError, RolloutFleet

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
