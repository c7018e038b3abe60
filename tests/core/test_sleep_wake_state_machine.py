"""Any order of generate / sleep / wake_up / update_weights / load_weights / recapture:
outputs always equal a fresh engine on the weights last pushed, a call the state
does not allow (or an update refused before it loads) raises a clear error and changes
nothing, and a streamed update failing part way leaves the weights "partial".

A hypothesis state machine keeps a model of what should be resident and which
checkpoint is loaded, and checks the engine against it after every call.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvrunner import LLM, SamplingParams
from kvrunner.errors import SleepStateError, WeightUpdateError
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
SETTINGS = dict(
    max_num_seqs=2, max_num_batched_tokens=32, max_model_len=48, block_size=4,
    capture_sizes=(1, 2), num_blocks=40,
)
TAG_CHOICES = [None, ["weights"], ["kv_cache"], ["kv_cache", "weights"]]


def answers(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


class SleepWakeMachine(RuleBasedStateMachine):
    #: set by the test: checkpoint name -> directory, and a fresh engine's answers
    paths: dict[str, str] = {}
    expected: dict[str, list[list[int]]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.llm = LLM(model=self.paths["a"], **SETTINGS)
        self.blocks = self.llm.cache_info().num_blocks
        self.weights, self.kv = "resident", "resident"
        self.loaded, self.pending, self.torn = "a", False, False

    def teardown(self) -> None:
        self.llm.shutdown()

    # -- the model's view --------------------------------------------------------------

    def servable(self) -> bool:
        resident = self.weights == "resident" and self.kv == "resident"
        return resident and not self.pending and not self.torn

    def refused(self, call: Callable[[], object], error: type[Exception] = SleepStateError) -> None:
        before = self.llm.cache_info()
        with pytest.raises(error):
            call()
        after = self.llm.cache_info()
        assert (after.weights, after.kv_cache, after.num_sleeps, after.num_wakes) == (
            before.weights, before.kv_cache, before.num_sleeps, before.num_wakes
        ), "a refused call changed the engine"

    # -- rules -------------------------------------------------------------------------

    @rule()
    def generate(self) -> None:
        if self.servable():
            assert answers(self.llm) == self.expected[self.loaded]
        else:
            self.refused(lambda: self.llm.generate(PROMPTS, GREEDY))

    @rule(level=st.sampled_from([1, 2]), discard=st.booleans())
    def sleep(self, level: int, discard: bool) -> None:
        if discard and level == 1:
            self.refused(lambda: self.llm.sleep(level, discard_weights=True), ValueError)
            return
        if (self.weights, self.kv) != ("resident", "resident"):
            self.refused(lambda: self.llm.sleep(level, discard_weights=discard))
            return
        self.llm.sleep(level, discard_weights=discard)
        self.kv = "released"
        if level == 2:
            self.weights = "discarded" if discard else "offloaded"
            self.pending = self.pending or discard

    @rule(tags=st.sampled_from(TAG_CHOICES))
    def wake_up(self, tags: list[str] | None) -> None:
        self.llm.wake_up(tags)
        for tag in tags or ["weights", "kv_cache"]:
            if tag == "weights":
                self.weights = "resident"
            else:
                self.kv = "resident"

    @rule(name=st.sampled_from(["a", "b"]), split=st.booleans(), bad=st.booleans(),
          streamed=st.booleans())
    def update_weights(self, name: str, split: bool, bad: bool, streamed: bool) -> None:
        tensors = list(iter_safetensors(Path(self.paths[name]), torch.float32))
        if self.weights != "resident":
            self.refused(lambda: self.llm.update_weights(tensors))
            return
        if bad:
            tensors.insert(len(tensors) // 2, ("model.layers.0.nope.weight", torch.zeros(1)))
            if not streamed:
                # a list is judged whole before any of it loads: refused, nothing changed
                self.refused(lambda: self.llm.update_weights(tensors), WeightUpdateError)
                return
            # a generator loads each pair as it is drawn: the first half is in
            with pytest.raises(WeightUpdateError, match="nope"):
                self.llm.update_weights(iter(tensors))
            self.torn = True
            return
        half = len(tensors) // 2 if split else len(tensors)
        self.llm.update_weights(iter(tensors[:half]))
        self.llm.update_weights(iter(tensors[half:]))
        self.loaded, self.pending, self.torn = name, False, False

    @rule(name=st.sampled_from(["a", "b"]))
    def load_weights(self, name: str) -> None:
        if self.weights != "resident":
            self.refused(lambda: self.llm.load_weights(self.paths[name]))
            return
        self.llm.load_weights(self.paths[name])
        self.loaded, self.pending, self.torn = name, False, False

    @rule()
    def recapture(self) -> None:
        if (self.weights, self.kv) == ("resident", "resident"):
            assert self.llm.recapture() > 0
        else:
            self.refused(self.llm.recapture)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()
        assert self.llm.cache_info().prefix_cached_blocks == 0

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def state_and_pool_are_what_the_model_says(self) -> None:
        info = self.llm.cache_info()
        status = self.weights
        if self.weights == "resident" and (self.torn or self.pending):
            status = "partial" if self.torn else "discarded"
        assert (info.weights, info.kv_cache) == (status, self.kv)
        assert info.num_blocks == self.blocks == self.llm.runner.pool_size.num_blocks
        assert info.ranks[0].kv_resident == (self.kv == "resident")


def test_any_order_of_calls_serves_the_last_weights_or_refuses_cleanly(tmp_path) -> None:
    paths = {
        name: str(write_tiny_checkpoint(tmp_path / name, seed=seed))
        for name, seed in (("a", 0), ("b", 1))
    }
    expected = {}
    for name, path in paths.items():
        with LLM(model=path, **SETTINGS) as llm:
            expected[name] = answers(llm)
    assert expected["a"] != expected["b"], "the two checkpoints must answer differently"
    SleepWakeMachine.paths, SleepWakeMachine.expected = paths, expected
    run_state_machine_as_test(
        SleepWakeMachine, settings=settings(settings(), stateful_step_count=25)
    )
