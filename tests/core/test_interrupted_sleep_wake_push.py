"""A Ctrl-C that lands anywhere in a sleep, a wake or a weight push leaves the driver's
record true: what ``cache_info()`` says is resident is what the ranks hold, and the
weight version it names is the weights that answer. The call either happened or did
not; a push cut part way says ``"partial"`` until a whole push.

The interrupt is a real SIGINT, raised as a call into kvrunner's own code starts,
the call chosen by hypothesis (``sys.settrace``); the rank's side runs in this
process, so the call may be the driver's or the rank's.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sigint_at_call import SigintAtCall, run_traced

import kvrunner
from kvrunner import LLM, SamplingParams
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint

PROMPTS = [[3, 17, 29, 101], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 201]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SMALL = dict(max_num_seqs=4, max_model_len=64, block_size=8, num_blocks=64)
#: every function of kvrunner's own code, the rank's included
PACKAGE_DIR = str(Path(kvrunner.__file__).parent)


def interrupted(call: Callable[[], object], trace: SigintAtCall) -> bool:
    """Run ``call`` under ``trace``; whether it raised KeyboardInterrupt."""
    return run_traced(call, trace)[0]


def tokens(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


Served = tuple[LLM, dict[str, dict[str, torch.Tensor]], dict[str, list[list[int]]]]


@pytest.fixture(scope="module", params=["qwen3", "qwen3-next"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Served]:
    """One engine for every example (each must leave it serving), serving weights "a";
    two sets of weights, "a" and "b", as a trainer pushes them; what each answers."""
    root = tmp_path_factory.mktemp(request.param)
    paths = {v: write_tiny_checkpoint(root / v, kind=request.param, seed=seed)
             for v, seed in (("a", 0), ("b", 1))}
    weights = {v: dict(iter_safetensors(Path(p), torch.float32)) for v, p in paths.items()}
    with LLM(str(paths["a"]), **SMALL) as llm:
        answers = {"a": tokens(llm)}
        llm.update_weights(weights["b"].items(), weight_version="b")
        answers["b"] = tokens(llm)
        assert answers["b"] != answers["a"]
        llm.update_weights(weights["a"].items(), weight_version="a")
        assert tokens(llm) == answers["a"]
        yield llm, weights, answers


def calls_of(call: Callable[[], object]) -> int:
    counter = SigintAtCall(0, PACKAGE_DIR)
    assert not interrupted(call, counter)
    return counter.calls


@settings(max_examples=20, deadline=None)
@given(level=st.sampled_from([1, 2]), where=st.floats(0.0, 1.0, exclude_max=True))
def test_a_sigint_anywhere_in_a_sleep_or_wake_leaves_the_record_true(
    served: Served, level: int, where: float
) -> None:
    """The record says resident exactly when the ranks hold pools, and an engine the
    record says is asleep wakes and answers as before."""
    llm, _, answers = served

    def cycle() -> None:
        llm.sleep(level)
        llm.wake_up()

    trace = SigintAtCall(1 + int(where * calls_of(cycle)), PACKAGE_DIR)
    assert interrupted(cycle, trace) == trace.fired
    info = llm.cache_info()
    assert (info.kv_cache == "resident") == bool(llm.runner.cache.pools)
    if info.kv_cache != "resident" or info.weights != "resident":
        llm.wake_up()  # what the record says is asleep wakes
    assert tokens(llm) == answers[llm.weight_version], (
        f"after a Ctrl-C at call {trace.n} of a level-{level} sleep and wake")
    info = llm.cache_info()
    assert info.num_free_blocks == info.num_blocks


@settings(max_examples=20, deadline=None)
@given(where=st.floats(0.0, 1.0, exclude_max=True))
def test_a_sigint_anywhere_in_a_push_leaves_the_version_naming_the_weights(
    served: Served, where: float
) -> None:
    """The prompts' KV is in the prefix cache before each push: a push the record
    misses would serve the new weights under the old version, over the old KV."""
    llm, weights, answers = served
    current = llm.weight_version
    target = "b" if current == "a" else "a"

    def push() -> None:
        llm.update_weights(weights[target].items(), weight_version=target)

    # the call count of a push to the other weights, then back
    total = calls_of(push)
    llm.update_weights(weights[current].items(), weight_version=current)
    tokens(llm)
    trace = SigintAtCall(1 + int(where * total), PACKAGE_DIR)
    assert interrupted(push, trace) == trace.fired
    if llm.cache_info().weights == "partial":
        push()  # the repair the error names: a whole push
    assert tokens(llm) == answers[llm.weight_version], (
        f"after a Ctrl-C at call {trace.n} of {total} of a push of {target!r}")


@pytest.mark.parametrize("call", ["finish_weight_update", "sleep", "wake_up"])
def test_a_sigint_as_the_ranks_answer_waits_for_the_record(
    served: Served, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The narrowest window: the ranks have done it, the driver has not noted it."""
    llm, weights, answers = served
    tokens(llm)
    ranks = llm._sleep_wake.ranks
    real = getattr(ranks, call)

    def answered(*args: Any) -> Any:
        out = real(*args)
        signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(ranks, call, answered)
    current = llm.weight_version
    target = "b" if current == "a" else "a"
    with pytest.raises(KeyboardInterrupt):
        if call == "finish_weight_update":
            llm.update_weights(weights[target].items(), weight_version=target)
        elif call == "sleep":
            llm.sleep(1)
        else:
            llm.sleep(1)
            llm.wake_up()
    monkeypatch.undo()
    info = llm.cache_info()
    assert info.kv_cache == ("released" if call == "sleep" else "resident")
    assert (info.kv_cache == "resident") == bool(llm.runner.cache.pools)
    assert llm.weight_version == (target if call == "finish_weight_update" else current)
    if call == "sleep":
        llm.wake_up()
    assert tokens(llm) == answers[llm.weight_version]
