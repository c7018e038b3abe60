"""Sleep, wake and weight updates on one rank: the RL loop loses nothing.

Every wake must give back the pool the engine's block manager was built on, the
weights the engine served before (or exactly the ones pushed since), and graphs
captured with every write target blanked. Each test here is a property of that loop;
the multi-rank ones live in tests/core/distributed/test_sleep_wake_tp.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.errors import SleepStateError, WakeError, WeightUpdateError
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.runner.capture import graph_capture
from kvrunner.runner.capture.capture_safety import PoolSnapshot
from kvrunner.runner.model_runner import ModelRunner

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
SETTINGS = dict(
    max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, block_size=4,
    capture_sizes=(1, 2, 4), cpu_cache_bytes=4 << 20,
)
CYCLES = 50


@pytest.fixture(scope="module", params=["qwen3", "qwen3-next", "qwen3-next-moe"])
def checkpoints(request, tmp_path_factory) -> tuple[str, str]:
    """Two checkpoints of one architecture: the served one and a trainer's next one."""
    root = tmp_path_factory.mktemp(request.param)
    return (
        str(write_tiny_checkpoint(root / "a", kind=request.param, seed=0)),
        str(write_tiny_checkpoint(root / "b", kind=request.param, seed=1)),
    )


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def tensors_of(path: str, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors as a trainer would push them (a generator)."""
    return iter_safetensors(Path(path), dtype)


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[list[int]]]:
    """What a never-slept engine answers on each checkpoint."""
    return {path: tokens(LLM(model=path, **SETTINGS)) for path in checkpoints}


@pytest.mark.parametrize("cycles", [3, pytest.param(CYCLES, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "level, discard", [(1, False), (2, False), (2, True)], ids=["level1", "level2", "discard"]
)
def test_many_cycles_serve_what_a_never_slept_engine_serves(
    checkpoints, expected, level, discard, cycles
) -> None:
    path = checkpoints[0]
    llm = LLM(model=path, **SETTINGS)
    start = llm.cache_info()
    for cycle in range(cycles):
        llm.sleep(level, discard_weights=discard)
        asleep = llm.cache_info()
        assert not asleep.ranks[0].kv_resident and llm.runner.cache.pools == {}
        assert asleep.weights == ("discarded" if discard else "offloaded" if level == 2 else
                                  "resident")
        if discard:
            llm.wake_up(["weights"])
            llm.update_weights(tensors_of(path))
            llm.wake_up(["kv_cache"])
        else:
            llm.wake_up()
        info = llm.cache_info()
        assert (info.num_blocks, info.num_state_slots, info.pool_bytes) == (
            start.num_blocks, start.num_state_slots, start.pool_bytes
        ), f"cycle {cycle}: the pool changed size"
        assert info.pool_bytes == sum(t.nbytes for t in llm.runner.cache.pools.values())
        assert (info.num_sleeps, info.last_sleep_level) == (cycle + 1, level)
        assert tokens(llm) == expected[path], f"cycle {cycle}"
    assert llm.runner.launcher.nan_rows == 0


def test_a_wake_never_sizes_the_pool_again(checkpoints, monkeypatch) -> None:
    llm = LLM(model=checkpoints[0], **SETTINGS)

    def sizing_after_start_up(self) -> int:
        raise AssertionError("pool sizing ran after start-up")

    monkeypatch.setattr(ModelRunner, "_own_pool_size", sizing_after_start_up)
    monkeypatch.setattr(ModelRunner, "_profile_peak_bytes", sizing_after_start_up)
    blocks = llm.engine.block_manager.num_blocks
    shapes = {name: pool.shape for name, pool in llm.runner.cache.pools.items()}
    for level in (1, 2):
        llm.sleep(level)
        llm.wake_up()
    assert llm.engine.block_manager.num_blocks == blocks == llm.runner.pool_size.num_blocks
    assert {name: pool.shape for name, pool in llm.runner.cache.pools.items()} == shapes


def test_update_weights_equals_a_fresh_engine_on_the_pushed_checkpoint(
    checkpoints, expected
) -> None:
    served, pushed = checkpoints
    llm = LLM(model=served, **SETTINGS)
    assert tokens(llm) == expected[served]
    llm.update_weights(tensors_of(pushed, torch.float64))  # cast on our side
    assert tokens(llm) == expected[pushed]
    llm.update_weights(tensors_of(pushed))  # the same weights again: the same answers
    assert tokens(llm) == expected[pushed]


def test_an_update_may_stream_over_several_calls_while_asleep(checkpoints, expected) -> None:
    served, pushed = checkpoints
    llm = LLM(model=served, **SETTINGS)
    tokens(llm)
    llm.sleep(2, discard_weights=True)
    llm.wake_up(["weights"])
    named = list(tensors_of(pushed))
    half = len(named) // 2
    llm.update_weights(iter(named[:half]))
    llm.wake_up(["kv_cache"])
    with pytest.raises(SleepStateError, match=r"\d+ tensor\(s\) have not been pushed"):
        llm.generate(PROMPTS, GREEDY)
    llm.update_weights(named[half:])
    assert tokens(llm) == expected[pushed]


def test_dummy_start_then_pushed_weights_equal_the_real_checkpoint(checkpoints, expected) -> None:
    path = checkpoints[0]
    llm = LLM(model=path, load_format="dummy", **SETTINGS)
    assert tokens(llm) != expected[path]
    assert llm.load_weights(path) > 0
    assert tokens(llm) == expected[path]


def test_a_failed_update_refuses_generation_until_a_later_call_completes(
    checkpoints, expected
) -> None:
    """A streamed push (a generator) refused after some of it loaded."""
    served, pushed = checkpoints
    llm = LLM(model=served, **SETTINGS)
    good = list(tensors_of(pushed))
    with pytest.raises(WeightUpdateError, match="model.no_such.weight"):
        llm.update_weights(iter([*good[:3], ("model.no_such.weight", torch.zeros(2)),
                                 *good[3:]]))
    with pytest.raises(SleepStateError, match="failed part way"):
        llm.generate(PROMPTS, GREEDY)
    name, tensor = good[0]
    with pytest.raises(WeightUpdateError, match=name.replace(".", r"\.")):
        llm.update_weights([(name, tensor[:1])])  # wrong shape, named
    llm.update_weights(good)
    assert tokens(llm) == expected[pushed]


def test_weights_discarded_refuse_generation_until_pushed(checkpoints, expected) -> None:
    path = checkpoints[0]
    llm = LLM(model=path, **SETTINGS)
    llm.sleep(2, discard_weights=True)
    llm.wake_up()
    with pytest.raises(SleepStateError, match="discarded"):
        llm.generate(PROMPTS, GREEDY)
    llm.load_weights(path)
    assert tokens(llm) == expected[path]


def test_illegal_orders_raise_and_change_nothing(checkpoints) -> None:
    llm = LLM(model=checkpoints[0], **SETTINGS)
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="discard_weights=True needs sleep"):
        llm.sleep(1, discard_weights=True)
    with pytest.raises(ValueError, match="tags must be among"):
        llm.wake_up(["kv"])
    assert llm.cache_info().kv_cache == "resident"
    llm.sleep(1)
    with pytest.raises(SleepStateError, match="already asleep"):
        llm.sleep(2)
    with pytest.raises(SleepStateError, match="call wake_up"):
        llm.recapture()
    llm.wake_up(["weights"])  # already resident: nothing to do
    assert llm.cache_info().kv_cache == "released"
    llm.wake_up(["kv_cache"])
    llm.sleep(2)
    with pytest.raises(SleepStateError, match=r"wake_up\(\['weights'\]\)"):
        llm.update_weights(tensors_of(checkpoints[0]))
    info = llm.cache_info()
    assert (info.weights, info.kv_cache) == ("offloaded", "released")


def test_a_wake_that_cannot_fit_raises_allocates_nothing_and_can_be_retried(checkpoints) -> None:
    llm = LLM(model=checkpoints[0], **SETTINGS)
    before = tokens(llm)
    blocks = llm.cache_info().num_blocks
    llm.sleep(1)
    llm.runner.sleep_wake.wake_pressure = lambda: 3 << 20  # someone else holds 3 of 4 MiB
    with pytest.raises(WakeError, match=r"rank 0 needs .* MiB short") as refused:
        llm.wake_up()
    assert refused.value.short[0] > 0
    assert llm.runner.cache.pools == {} and llm.cache_info().kv_cache == "released"
    with pytest.raises(SleepStateError, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    llm.runner.sleep_wake.wake_pressure = lambda: 0
    llm.wake_up()
    assert llm.cache_info().num_blocks == blocks
    assert tokens(llm) == before


def test_reused_state_and_kv_memory_holding_garbage_after_a_wake_changes_nothing(
    checkpoints, expected
) -> None:
    # Memory that comes back from a wake may hold anything (on CUDA it does): a
    # request must never read a slot or block it did not write in this life.
    path = checkpoints[0]
    llm = LLM(model=path, **SETTINGS)
    llm.sleep(1)
    llm.wake_up()
    for pool in llm.runner.cache.pools.values():
        pool.fill_(math.nan)
    assert tokens(llm) == expected[path]
    assert llm.runner.launcher.nan_rows == 0


@pytest.mark.parametrize("blank", [True, False], ids=["blanked", "not-blanked"])
def test_the_capture_after_a_wake_writes_no_pool_byte_only_because_of_blanking(
    checkpoints, monkeypatch, blank
) -> None:
    llm = LLM(model=checkpoints[0], blank_write_targets=blank, **SETTINGS)
    llm.generate(PROMPTS, GREEDY)  # forward_vars now hold a served batch's live rows
    changed: list[list[str]] = []
    real_capture = graph_capture.capture_decode_graphs

    def audited(**kwargs):
        snapshot = PoolSnapshot(kwargs["pools"])
        out = real_capture(**kwargs)
        changed.append(snapshot.changed_pools())
        return out

    monkeypatch.setattr(graph_capture, "capture_decode_graphs", audited)
    llm.sleep(1)
    llm.wake_up()
    assert len(changed) == 1
    assert (changed[0] == []) is blank, changed
