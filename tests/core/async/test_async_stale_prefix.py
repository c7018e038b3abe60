"""KV of old weights never reaches a later request through the prefix cache: a request
parked across a weight update keeps computing on its old-weight KV, and no block of
it is published once the weights changed."""

from __future__ import annotations

import asyncio

import pytest
from async_reference import weights_of

from kvrunner import LLM, AsyncLLM, SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # two full blocks of 4, one begun
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
NEXT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def test_a_request_parked_across_an_update_publishes_none_of_its_blocks(
    llm: LLM, checkpoints
) -> None:
    new_weights = weights_of(checkpoints[1])

    async def run():
        async with AsyncLLM.from_llm(llm) as engine:
            stream = engine.generate_stream(PROMPT, LONG)
            made = 0
            async for delta in stream:  # a few tokens under the old weights
                made += len(delta.token_ids)
                if made >= 2:
                    break
            # (leaving the loop would abort it: park it first, from another task)
            parked = asyncio.create_task(stream.__anext__())
            await engine.pause("keep")
            await engine.update_weights(new_weights, weight_version="new")
            await engine.resume()
            deltas = [await parked] + [d async for d in stream]
            rollout = deltas[-1].output
            (old, _), (new, _) = rollout.weight_versions  # it did span the update
            assert (old, new) == (0, "new")
            # Everything the rollout's tokens could share is now in its blocks. A first
            # request on them computes its prompt on the new weights (nothing of the
            # prompt's head is cached) and publishes it; a second one then finds the
            # whole prompt in the cache, the blocks the rollout filled after the
            # update included, unless they were never published.
            shared = rollout.prompt_token_ids + rollout.token_ids
            cold = await engine.generate(shared, NEXT)
            hits_before = llm.engine.block_manager.prefix_hit_tokens
            warm = await engine.generate(shared, NEXT)
            hits = llm.engine.block_manager.prefix_hit_tokens - hits_before
            await engine.reset_prefix_cache()
            fresh = await engine.generate(shared, NEXT)  # nothing cached at all
            return cold, warm, fresh, hits, len(shared)

    cold, warm, fresh, hits, n = asyncio.run(run())
    assert hits == (n - 1) // 4 * 4  # the warm request read every full block it could
    assert cold.token_ids == fresh.token_ids
    assert warm.token_ids == fresh.token_ids
    assert warm.logprobs == pytest.approx(fresh.logprobs, abs=1e-4)
