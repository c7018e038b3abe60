"""Pause, resume, sleep and weight updates on a live AsyncLLM: parked requests keep
their KV across an update and say which tokens came from which weights; every call
that could corrupt a request refuses, changing nothing."""

from __future__ import annotations

import asyncio

import pytest
from async_reference import Reference, assert_matches, weights_of

from kvrunner import LLM, AsyncLLM, EngineBusyError, SamplingParams, SleepStateError

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
LONG = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)


def sampled(k: int) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=0.8, seed=k, ignore_eos=True, logprobs=0)


async def until(predicate, timeout: float = 30.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout)


async def idle_stats(engine: AsyncLLM):
    await engine.wait_for_requests_to_drain(timeout=30)
    await engine.cache_info()  # a command: the stats are published before its reply
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.blocks_used, stats.state_slots_used) == (
        0, 0, 0, 0)  # fmt: skip
    return stats


def test_pause_keep_carries_partial_rollouts_across_a_weight_update(
    llm: LLM, checkpoints, reference: Reference
) -> None:
    params = [LONG, sampled(1), sampled(2)]
    new_weights = weights_of(checkpoints[1])

    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            tasks = [asyncio.create_task(engine.generate(p, sp, f"r{k}"))
                     for k, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))]  # fmt: skip
            await until(lambda: engine.stats().generated_tokens_total >= 6)
            await engine.pause("keep")
            stats = engine.stats()
            assert stats.paused and stats.pause_mode == "keep" and stats.num_running == 3
            await asyncio.sleep(0.05)  # parked: no step runs
            assert engine.stats().generated_tokens_total == stats.generated_tokens_total
            assert engine.stats().blocks_used == stats.blocks_used  # KV kept, not freed
            with pytest.raises(EngineBusyError, match="KV would be lost"):
                await engine.sleep(1)
            assert await engine.update_weights(new_weights, weight_version="v1") > 0
            await engine.reset_prefix_cache()  # allowed under the pause; parked KV kept
            await engine.resume()
            outs = await asyncio.gather(*tasks)
            await idle_stats(engine)
            assert engine.stats().weight_version == "v1"
            return outs

    for prompt, sp, out in zip(PROMPTS, params, asyncio.run(run()), strict=True):
        (v0, first), (v1, k) = out.weight_versions  # two spans: parked across the update
        assert (v0, first, v1) == (0, 0, "v1") and 0 < k < len(out.token_ids)
        assert out.weight_version == "v1"
        assert_matches(out, reference.output(prompt, sp, ((0, 0), (1, k))))
        # the update took effect: after k the tokens are not the old weights' ones
        old = reference.output(prompt, sp)
        assert out.token_ids[:k] == old.token_ids[:k] and out.token_ids != old.token_ids


def test_pause_abort_ends_everything_and_holds_later_requests(llm: LLM, reference) -> None:
    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            first = asyncio.create_task(engine.generate(PROMPTS[0], LONG))
            await until(lambda: engine.stats().generated_tokens_total >= 2)
            await engine.pause("abort")
            assert (await first).finish_reason == "abort"
            later = asyncio.create_task(engine.generate(PROMPTS[1], LONG))
            await until(lambda: engine.stats().num_waiting == 1)  # held, not run
            await asyncio.sleep(0.02)
            assert engine.stats().num_running == 0 and not later.done()
            await engine.resume()
            out = await later
            await idle_stats(engine)
            return out

    out = asyncio.run(run())
    assert_matches(out, reference.output(PROMPTS[1], LONG))


def test_pause_wait_lets_running_requests_finish(llm: LLM, reference) -> None:
    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            tasks = [asyncio.create_task(engine.generate(p, LONG)) for p in PROMPTS]
            await until(lambda: engine.stats().num_running > 0)
            await engine.pause("wait")
            assert engine.stats().num_running == 0  # it returned once they had ended
            outs = await asyncio.gather(*tasks)
            await engine.resume()
            await idle_stats(engine)
            return outs

    for prompt, out in zip(PROMPTS, asyncio.run(run()), strict=True):
        assert_matches(out, reference.output(prompt, LONG))


def test_calls_that_would_corrupt_running_requests_refuse(llm: LLM, checkpoints,
                                                           reference) -> None:  # fmt: skip
    weights = weights_of(checkpoints[0])

    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            version = engine.stats().weight_version  # the LLM's: earlier tests updated it
            updates = llm.engine.num_weight_updates
            task = asyncio.create_task(engine.generate(PROMPTS[2], LONG))
            await until(lambda: engine.stats().num_running > 0)
            with pytest.raises(EngineBusyError, match="pause"):
                await engine.update_weights(weights)
            with pytest.raises(EngineBusyError, match="pause"):
                await engine.load_weights(checkpoints[0])
            with pytest.raises(EngineBusyError, match="pause"):
                await engine.reset_prefix_cache()
            with pytest.raises(EngineBusyError, match="KV would be lost"):
                await engine.sleep(1)
            info = await engine.cache_info()  # always allowed
            assert info.kv_cache == "resident"
            out = await task
            assert engine.stats().weight_version == version  # nothing was changed
            assert llm.engine.num_weight_updates == updates
            # idle: an update needs no pause, and its version is the count by default
            await engine.load_weights(checkpoints[0])
            assert engine.stats().weight_version == updates + 1
            return out

    assert_matches(asyncio.run(run()), reference.output(PROMPTS[2], LONG))


def test_sleep_under_a_pause_holds_new_requests_until_woken(llm: LLM, reference) -> None:
    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            with pytest.raises(SleepStateError, match="asleep"):
                await engine.sleep(1)
                await engine.generate(PROMPTS[0], LONG)  # not paused: refused at once
            await engine.wake_up()
            await engine.pause("wait")
            await engine.sleep(1)
            assert engine.stats().sleep_state.startswith("asleep")
            held = asyncio.create_task(engine.generate(PROMPTS[0], LONG))
            await until(lambda: engine.stats().num_waiting == 1)
            with pytest.raises(SleepStateError, match="wake_up"):
                await engine.resume()  # nothing is served asleep; still paused
            assert engine.is_paused
            await engine.wake_up()
            await engine.resume()
            out = await held
            await idle_stats(engine)
            assert engine.stats().sleep_state == "awake"
            return out

    assert_matches(asyncio.run(run()), reference.output(PROMPTS[0], LONG))
