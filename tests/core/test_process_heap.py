"""A process kvrunner owns freezes its started heap, and nothing the engine releases
through the collector is kept alive by the freeze: a sleep still frees every byte of
its pools, and a cycle that became garbage after the freeze is still collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from kvrunner import LLM, SamplingParams, process_heap

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


@pytest.fixture
def thawed_after() -> Iterator[None]:
    """The test may freeze this process's heap: the next tests get it back unfrozen."""
    yield
    gc.unfreeze()


class _Cycle:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.me = self


def test_freezing_takes_every_live_object_out_of_the_collectors_walks(thawed_after) -> None:
    alive = _Cycle(torch.zeros(4))
    frozen = process_heap.freeze_started_heap()
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is alive for o in gc.get_objects()), "a live object was left walked"


def test_a_frozen_cycle_that_becomes_garbage_is_freed_by_collect(thawed_after) -> None:
    tensor = torch.zeros(1024)
    ref = weakref.ref(tensor)
    cycle = _Cycle(tensor)
    process_heap.freeze_started_heap()
    del cycle, tensor
    gc.collect()
    assert ref() is not None, "the plain collector reached a frozen object"
    process_heap.collect()
    assert ref() is None, "collect() left frozen garbage alive"
    assert gc.get_freeze_count() > 0, "collect() left the heap thawed"


def test_collect_leaves_an_unfrozen_heap_unfrozen() -> None:
    assert gc.get_freeze_count() == 0
    process_heap.collect()
    assert gc.get_freeze_count() == 0


def test_a_sleep_after_the_freeze_frees_every_byte_of_the_pools(thawed_after) -> None:
    with LLM("tiny-qwen3", max_num_seqs=2, max_model_len=64, enforce_eager=True) as llm:
        before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        # What a captured CUDA graph is to a pool: a cycle of objects, made at start-up,
        # that keeps a view of it; the engine drops it before a sleep releases the pool.
        holder = _Cycle(next(iter(llm.runner.cache.pools.values()))[:1])
        process_heap.freeze_started_heap()  # as kvrunner serve does once its engine is up
        del holder
        llm.sleep()
        info = llm.cache_info()
        assert info.kv_cache == "released" and info.last_freed_bytes == info.pool_bytes > 0
        llm.wake_up()
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == before


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleep_walks_the_whole_heap_once(level: int) -> None:
    """A full collection walks every object of the process, which in a trainer's
    process (colocated with the engine) takes up to seconds: a sleep runs one, and
    the check that every pool was released reads what that one left."""
    with LLM("tiny-qwen3", max_num_seqs=2, max_model_len=64, enforce_eager=True) as llm:
        before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        full: list[int] = []

        def count(phase: str, info: dict) -> None:
            if phase == "start" and info["generation"] == 2:
                full.append(1)

        gc.callbacks.append(count)
        automatic = gc.isenabled()
        gc.disable()  # only the collections the sleep asks for
        try:
            llm.sleep(level)
        finally:
            gc.callbacks.remove(count)
            if automatic:
                gc.enable()
        assert len(full) == 1
        info = llm.cache_info()
        assert info.kv_cache == "released" and info.last_freed_bytes >= info.pool_bytes > 0
        llm.wake_up()
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == before
