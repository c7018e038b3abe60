"""``LLM.shutdown()`` releases what the LLM holds, and says so when used after."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from kvrunner import LLM, ConcurrentUseError, SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_shutdown_releases_the_runner_and_its_pools() -> None:
    llm = LLM("tiny-qwen3", max_num_seqs=2, max_model_len=64, enforce_eager=True)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
    runner = weakref.ref(llm.runner)
    pool = weakref.ref(next(iter(llm.runner.cache.pools.values())))
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


def test_shutdown_from_another_thread_while_generate_runs_is_refused_clearly() -> None:
    llm = LLM("tiny-qwen3", max_num_seqs=2, max_model_len=64, enforce_eager=True)
    inside, release = threading.Event(), threading.Event()
    submit = llm.executor.submit

    def held_submit(step):  # the real step, held inside the call until released
        inside.set()
        release.wait(30)
        return submit(step)

    llm.executor.submit = held_submit
    results: list = []
    worker = threading.Thread(target=lambda: results.append(llm.generate([[1, 2]], GREEDY)))
    try:
        worker.start()
        assert inside.wait(30)
        with pytest.raises(ConcurrentUseError, match="LLM.shutdown was called while another"):
            llm.shutdown()
    finally:
        release.set()
        worker.join(30)
        del llm.executor.submit
    assert len(results[0][0].token_ids) == 3  # the generate finished undisturbed
    llm.shutdown()
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.generate([[1, 2]], GREEDY)


def test_generate_from_another_thread_while_shutdown_runs_is_refused_clearly() -> None:
    llm = LLM("tiny-qwen3", max_num_seqs=2, max_model_len=64, enforce_eager=True)
    inside, release = threading.Event(), threading.Event()
    shutdown = llm.executor.shutdown

    def held_shutdown():  # the real shutdown, held until released
        inside.set()
        release.wait(30)
        shutdown()

    llm.executor.shutdown = held_shutdown
    worker = threading.Thread(target=llm.shutdown)
    try:
        worker.start()
        assert inside.wait(30)
        with pytest.raises(ConcurrentUseError, match="LLM.generate was called while another"):
            llm.generate([[1, 2]], GREEDY)
    finally:
        release.set()
        worker.join(30)
    assert llm.runner is None
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.generate([[1, 2]], GREEDY)
