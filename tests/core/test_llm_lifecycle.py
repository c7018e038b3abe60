"""``LLM.shutdown()`` releases what the LLM holds, and says so when used after."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvrunner import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_shutdown_releases_the_runner_and_its_pools() -> None:
    llm = LLM("tiny-qwen3", max_num_seqs=2, max_model_len=64, enforce_eager=True)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
    runner = weakref.ref(llm.runner)
    pool = weakref.ref(next(iter(llm.runner.pools.values())))
    llm.shutdown()
    gc.collect()
    assert runner() is None, "the runner outlived shutdown()"
    assert pool() is None, "a cache pool outlived shutdown()"


def test_an_llm_used_after_shutdown_says_it_was_shut_down() -> None:
    with LLM("tiny-qwen3", max_num_seqs=2, max_model_len=64, enforce_eager=True) as llm:
        pass
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.generate([[1, 2, 3]], GREEDY)
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.recapture()
    llm.shutdown()  # idempotent
