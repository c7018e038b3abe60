"""KV computed under old weights is never reused after an update, when the engine
salts the prefix cache by weight version.

The path where stale reuse happens: an update that keeps the prefix cache
(``reset_prefix_cache=False``, SGLang's ``flush_cache: false``, the setting prime-rl
runs with). Unsalted, a request after the update takes the old weights' KV of its
prompt from the cache, and its tokens' logprobs are not the new weights'; salted by
version, it computes its prompt afresh and its logprobs equal a run on an empty cache.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvrunner import LLM, SamplingParams
from kvrunner.async_llm import AsyncLLM
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.outputs import RequestOutput

SETTINGS = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=64,
    block_size=4,
    capture_sizes=(1, 2, 4),
    cpu_cache_bytes=2 << 20,
)
PROMPT = list(range(5, 18))  # 13 tokens: three full blocks can be cached
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("stale")
    return write_tiny_checkpoint(root / "a", seed=0), write_tiny_checkpoint(root / "b", seed=1)


def _after_unflushed_update(checkpoints, salted: bool):
    """The prompt's output after an update that kept the cache, and the same prompt's
    output computed from an empty cache under the new weights."""
    with LLM(
        model=str(checkpoints[0]), salt_prefix_cache_by_weight_version=salted, **SETTINGS
    ) as llm:
        (before,) = llm.generate([PROMPT], GREEDY)
        llm.load_weights(checkpoints[1], weight_version="b", reset_prefix_cache=False)
        (after,) = llm.generate([PROMPT], GREEDY)
        llm.reset_prefix_cache()
        (fresh,) = llm.generate([PROMPT], GREEDY)
    return before, after, fresh


def test_unsalted_an_update_that_keeps_the_cache_reuses_the_old_weights_kv(checkpoints):
    before, after, fresh = _after_unflushed_update(checkpoints, salted=False)
    assert before.weight_version == 0 and after.weight_version == "b"
    assert after.num_cached_tokens == 12  # the old weights' three blocks
    assert fresh.num_cached_tokens == 0
    assert after.logprobs != pytest.approx(fresh.logprobs, abs=1e-4)  # stale


def test_salted_by_version_no_request_reuses_the_old_weights_kv(checkpoints):
    before, after, fresh = _after_unflushed_update(checkpoints, salted=True)
    assert after.weight_version == "b" and after.weight_versions == (("b", 0),)
    assert after.num_cached_tokens == 0
    assert after.token_ids == fresh.token_ids
    assert after.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)


def test_equal_salts_share_and_different_salts_do_not(checkpoints):
    with LLM(model=str(checkpoints[0]), **SETTINGS) as llm:
        (first,) = llm.generate([PROMPT], GREEDY, cache_salt="tenant-a")
        same, other, unsalted = llm.generate(
            [PROMPT] * 3, GREEDY, cache_salt=["tenant-a", "tenant-b", None]
        )
    assert [o.num_cached_tokens for o in (first, same, other, unsalted)] == [0, 12, 0, 0]
    assert same.token_ids == first.token_ids == other.token_ids == unsalted.token_ids


def test_a_request_parked_across_an_unflushed_update_leaves_no_reusable_blocks(checkpoints):
    """SGLang's in-place pause: a request parked with its KV continues under the new
    weights; the blocks it fills then attend to the old weights' KV. Salted by
    version, they are published under the version it was admitted with, so a later
    request repeating its whole text computes afresh."""
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    async def run(salted: bool) -> tuple[RequestOutput, RequestOutput, RequestOutput]:
        async with AsyncLLM(
            model=str(checkpoints[0]), **SETTINGS, salt_prefix_cache_by_weight_version=salted
        ) as llm:
            stream = llm.generate_stream(PROMPT[:6], long)
            made = 0
            async for delta in stream:  # a few tokens under the old weights
                made += len(delta.token_ids)
                if made >= 2:
                    break
            parked = asyncio.create_task(stream.__anext__())  # leaving it would abort it
            await llm.pause("keep")
            await llm.load_weights(checkpoints[1], weight_version="b", reset_prefix_cache=False)
            await llm.resume()
            rollout = ([await parked] + [d async for d in stream])[-1].output
            again = rollout.prompt_token_ids + rollout.token_ids
            later = await llm.generate(again, GREEDY)
            await llm.reset_prefix_cache()
            fresh = await llm.generate(again, GREEDY)
            return rollout, later, fresh

    rollout, later, fresh = asyncio.run(run(salted=True))
    (old, _), (new, first_new) = rollout.weight_versions  # it did span the update
    assert (old, new, rollout.weight_version) == (0, "b", "b") and first_new > 0
    assert later.num_cached_tokens == 0
    assert later.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)
    _, stale, fresh = asyncio.run(run(salted=False))
    assert stale.num_cached_tokens > 0
    assert stale.logprobs != pytest.approx(fresh.logprobs, abs=1e-4)
