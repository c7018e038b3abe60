"""Releasing is verified: a backend that allocates must have ``release_cache``, and a
sleep checks that the pools' storage is really gone and reports what it measured.
"""

from __future__ import annotations

import pytest
from mutants import NoReleaseCache, ReleaseKeepsMemory

from kvrunner import LLM, SamplingParams
from kvrunner.plugin_api import PLUGIN_API_VERSION, BackendContext, BackendError
from kvrunner.plugin_host.plugins import register_backend, unregister_backend

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def keeps_memory():
    register_backend("mutant-release-keeps-memory", ReleaseKeepsMemory)
    yield "mutant-release-keeps-memory"
    unregister_backend("mutant-release-keeps-memory")


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_a_sleep_frees_and_reports_every_byte_of_a_correct_backends_pools(start) -> None:
    llm = start("paged")
    before = tokens(llm)
    llm.sleep()
    info = llm.cache_info()
    assert info.kv_cache == "released" and info.last_freed_bytes == info.pool_bytes > 0
    llm.wake_up()
    assert tokens(llm) == before


def test_a_release_that_keeps_memory_fails_the_sleep_naming_the_backend(
    start, keeps_memory
) -> None:
    llm = start(keeps_memory)
    before = tokens(llm)
    with pytest.raises(BackendError, match=rf"backend '{keeps_memory}': release_cache kept "
                                           r"[0-9.]+ MiB of its pools alive \(kv\.0, kv\.1\)"):
        llm.sleep()
    info = llm.cache_info()
    # measured, not declared: nothing of the pools came back
    assert info.kv_cache == "released" and info.last_freed_bytes == 0
    llm.wake_up()  # the engine is asleep as the error says, and wakes as usual
    assert tokens(llm) == before


def test_a_factory_whose_backend_has_no_release_cache_is_refused_at_start(start) -> None:
    def factory(context: BackendContext) -> NoReleaseCache:
        return NoReleaseCache(context)

    factory.plugin_api_version = PLUGIN_API_VERSION
    factory.layer_types = NoReleaseCache.layer_types
    factory.cache_rows = NoReleaseCache.cache_rows
    register_backend("mutant-no-release-factory", factory)  # a function: checked per instance
    try:
        with pytest.raises(BackendError, match="'mutant-no-release-factory'.*release_cache"):
            start("mutant-no-release-factory")
    finally:
        unregister_backend("mutant-no-release-factory")
