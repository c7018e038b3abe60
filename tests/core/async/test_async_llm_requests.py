"""AsyncLLM's requests: the tokens of the synchronous LLM, streams that add up to the
output, aborts and cancellations that end a request once and free what it held."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from async_reference import SETTINGS

from kvrunner import LLM, AsyncLLM, EngineClosedError, RequestError, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [3, 4], [20, 21, 22]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def seeded(k: int) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=100 + k, logprobs=0)


def assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    assert (got.logprobs is None) == (want.logprobs is None)
    if want.logprobs is not None:  # batch composition moves CPU float rounding only
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert (got.top_logprobs is None) == (want.top_logprobs is None)
    if want.top_logprobs:
        assert [set(t) for t in got.top_logprobs] == [set(t) for t in want.top_logprobs]


def assert_idle(engine: AsyncLLM) -> None:
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.blocks_used) == (0, 0, 0)
    assert stats.state_slots_used == 0


async def running(engine: AsyncLLM) -> None:
    """Until the engine runs some request."""
    while engine.stats().num_running == 0:
        await asyncio.sleep(0.001)


async def settled(engine: AsyncLLM) -> None:
    await engine.wait_for_requests_to_drain(timeout=30)
    await engine.cache_info()  # one more command: the stats are published after it


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_concurrent_calls_equal_llm_generate(llm: LLM, kind: str) -> None:
    params = [GREEDY] * len(PROMPTS) if kind == "greedy" else [seeded(k) for k in range(5)]
    want = llm.generate(PROMPTS, params)

    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            pairs = enumerate(zip(PROMPTS, params, strict=True))
            got = await asyncio.gather(
                *(engine.generate(p, sp, request_id=f"r{k}") for k, (p, sp) in pairs)
            )
            await settled(engine)
            assert_idle(engine)
            return got

    got = asyncio.run(run())
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w)
        assert g.request_id == f"r{k}" and g.weight_version == 0
        assert g.weight_versions == ((0, 0),)


def test_unseeded_draws_follow_the_engine_request_number(checkpoints) -> None:
    """Unseeded requests are keyed by the engine's request number: a fresh AsyncLLM
    given the requests in the same order draws what a fresh LLM does."""
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    reference = LLM(checkpoints[0], **SETTINGS)
    want = reference.generate(PROMPTS, params)
    reference.shutdown()

    async def run():
        async with AsyncLLM(checkpoints[0], **SETTINGS) as engine:
            return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))

    got = asyncio.run(run())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # ... and the number, not the batch, decides: a different order draws differently
    assert len({tuple(o.token_ids) for o in got}) > 1


def test_a_stream_adds_up_to_its_output(llm: LLM) -> None:
    want = llm.generate(["Hello there", [7, 8, 9]], GREEDY)

    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            streams = []
            for prompt in ["Hello there", [7, 8, 9]]:
                streams.append([d async for d in engine.generate_stream(prompt, GREEDY)])
            return streams

    for deltas, ref in zip(asyncio.run(run()), want, strict=True):
        assert all(d.finish_reason is None and d.output is None for d in deltas[:-1])
        last = deltas[-1]
        assert last.finish_reason == "length" and last.output is not None
        assert len(deltas) > 1  # it streamed: tokens came before the end
        assert sum((d.token_ids for d in deltas), []) == last.output.token_ids
        assert sum((d.logprobs for d in deltas), []) == last.output.logprobs
        assert sum((d.top_logprobs for d in deltas), []) == last.output.top_logprobs
        assert "".join(d.text for d in deltas) == last.output.text
        assert_same(last.output, ref)


def test_abort_ends_a_request_once_with_the_tokens_it_had(llm: LLM) -> None:
    (full,) = llm.generate([PROMPTS[0]], LONG)

    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            seen, aborted = [], False
            async for delta in engine.generate_stream(PROMPTS[0], LONG, request_id="long"):
                seen.append(delta)
                if sum(len(d.token_ids) for d in seen) >= 3 and not aborted:
                    # deltas already posted still arrive, then the final one
                    assert await engine.abort("long") is True
                    aborted = True
            assert await engine.abort("long") is False  # ended: nothing to abort
            assert await engine.abort("never-was") is False
            await settled(engine)
            assert_idle(engine)
            assert engine.stats().num_aborted >= 1
            return seen

    seen = asyncio.run(run())
    last = seen[-1]
    assert last.finish_reason == "abort" and last.output.finish_reason == "abort"
    assert [d.finish_reason for d in seen].count("abort") == 1
    n = len(last.output.token_ids)
    assert 3 <= n < len(full.token_ids)
    assert last.output.token_ids == full.token_ids[:n]


def test_abort_of_a_queued_request_and_abort_all(llm: LLM) -> None:
    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            tasks = [asyncio.create_task(engine.generate(PROMPTS[k % 5], LONG, f"q{k}"))
                     for k in range(10)]  # more than the 4 seats: some queue
            await asyncio.sleep(0)
            while engine.stats().generated_tokens_total == 0:
                await asyncio.sleep(0.001)
            assert await engine.abort("q9") is True  # queued behind the seats
            n = await engine.abort_all()
            outs = await asyncio.gather(*tasks)
            await settled(engine)
            assert_idle(engine)
            return n, outs

    n, outs = asyncio.run(run())
    assert n == 9
    assert all(o.finish_reason == "abort" for o in outs)
    assert outs[9].token_ids == []


def test_cancelling_the_awaiting_task_aborts_its_request(llm: LLM) -> None:
    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            task = asyncio.create_task(engine.generate(PROMPTS[1], LONG, "c"))
            await running(engine)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await settled(engine)
            assert_idle(engine)
            assert engine.stats().num_aborted == 1
            assert await engine.abort("c") is False
            # a stream left early is aborted as well
            async with contextlib.aclosing(engine.generate_stream(PROMPTS[1], LONG, "s")) as it:
                async for _ in it:
                    break
            await settled(engine)
            assert_idle(engine)
            assert engine.stats().num_aborted == 2

    asyncio.run(run())


def test_bad_requests_are_refused_before_anything_is_queued(llm: LLM) -> None:
    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            task = asyncio.create_task(engine.generate(PROMPTS[0], LONG, "dup"))
            await running(engine)
            with pytest.raises(RequestError, match="'dup'.*live"):
                await engine.generate(PROMPTS[1], GREEDY, "dup")
            with pytest.raises(RequestError, match="outside the vocabulary"):
                await engine.generate([10**9], GREEDY)
            with pytest.raises(RequestError, match="empty"):
                await engine.generate([], GREEDY)
            with pytest.raises(RequestError, match="SamplingParams"):
                await engine.generate([1, 2], {"max_tokens": 3})
            with pytest.raises(RequestError, match="request_id"):
                await engine.generate([1, 2], GREEDY, request_id=7)
            out = await task  # the refusals left the live request alone
            assert out.finish_reason == "length" and len(out.token_ids) == LONG.max_tokens

    asyncio.run(run())


def test_shutdown_aborts_live_requests_and_refuses_later_calls(llm: LLM) -> None:
    async def run():
        engine = AsyncLLM.from_llm(llm)
        task = asyncio.create_task(engine.generate(PROMPTS[0], LONG))
        await running(engine)
        await engine.shutdown()
        out = await task
        assert out.finish_reason == "abort"
        await engine.shutdown()  # idempotent
        with pytest.raises(EngineClosedError):
            await engine.generate(PROMPTS[0], GREEDY)

    asyncio.run(run())
    # the LLM it wrapped is idle and serves synchronously again
    assert not llm.engine.has_unfinished()
    assert llm.generate([PROMPTS[0]], GREEDY)[0].finish_reason == "length"


def test_a_group_equals_llm_generate_with_n_and_generate_refuses_n(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.9, seed=7, n=3, logprobs=0)
    want = llm.generate([PROMPTS[2]], params)

    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            with pytest.raises(RequestError, match="generate_group"):
                await engine.generate(PROMPTS[2], params)
            got = await engine.generate_group(PROMPTS[2], params, request_id="g")
            await settled(engine)
            assert_idle(engine)
            return got

    got = asyncio.run(run())
    assert [o.request_id for o in got] == ["g-0", "g-1", "g-2"]
    assert [o.sample_index for o in got] == [0, 1, 2]
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    assert len({tuple(o.token_ids) for o in got}) > 1  # the samples differ
