"""AsyncLLM over a tensor-parallel engine (2 ranks on gloo, spawned by the LLM): the
engine thread drives the rank group unchanged, tokens equal the synchronous TP=1
engine's, and a pause(keep) across a weight update works behind it too."""

from __future__ import annotations

import asyncio

from async_reference import SETTINGS, assert_matches, weights_of

from kvrunner import LLM, AsyncLLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def test_tp2_behind_asyncllm_equals_the_synchronous_tp1_engine(llm: LLM, checkpoints) -> None:
    want = llm.generate(PROMPTS, GREEDY)

    async def run():
        async with AsyncLLM(checkpoints[0], tensor_parallel_size=2, **SETTINGS) as engine:
            assert len((await engine.cache_info()).ranks) == 2  # two rank processes
            outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
            await engine.pause("keep")
            await engine.update_weights(weights_of(checkpoints[0]), weight_version="same")
            await engine.resume()
            again = await engine.generate(PROMPTS[0], GREEDY)
            return outs, again

    outs, again = asyncio.run(run())
    for got, ref in zip(outs, want, strict=True):
        assert_matches(got, ref)
    assert again.weight_version == "same"
    assert_matches(again, want[0])
