"""Sleep, wake and weight updates across two ranks on gloo: the same pool on every
rank, the same answers as a never-slept single rank, and a wake that cannot fit on
one rank refused by every rank with nothing allocated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_tensor_parallel import test_hooks

from kvrunner import LLM, SamplingParams
from kvrunner.distributed.fault_injection import TEST_HOOKS_ENV
from kvrunner.errors import SleepStateError, WakeError
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint

PROMPTS = [[3, 17, 29, 101], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 201]]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SMALL = dict(max_num_seqs=4, max_model_len=64, block_size=16, capture_sizes=(1, 2, 4),
             cpu_cache_bytes=2 << 20)
CYCLES = 50
#: a refused wake must reach the driver from every rank within this
REFUSAL_BOUND_S = 5.0


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=["qwen3", "qwen3-next"])
def checkpoints(request, tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp(f"tp-{request.param}")
    return (
        str(write_tiny_checkpoint(root / "a", kind=request.param, seed=5)),
        str(write_tiny_checkpoint(root / "b", kind=request.param, seed=6)),
    )


@pytest.fixture(scope="module")
def tp1_answers(checkpoints) -> dict[str, list[list[int]]]:
    answers = {}
    for path in checkpoints:
        with LLM(path, enforce_eager=True, **SMALL) as llm:
            answers[path] = tokens(llm)
    return answers


@pytest.fixture(scope="module")
def tp2(checkpoints) -> Iterator[LLM]:
    with LLM(checkpoints[0], tensor_parallel_size=2, **SMALL) as llm:
        yield llm


def test_tp2_cycles_at_both_levels_keep_pool_and_answers(tp2, checkpoints, tp1_answers) -> None:
    served = checkpoints[0]
    start = tp2.cache_info()
    assert [r.rank for r in start.ranks] == [0, 1]
    for cycle in range(CYCLES):
        level = 1 + cycle % 2
        tp2.sleep(level)
        assert not any(r.kv_resident for r in tp2.cache_info().ranks)
        tp2.wake_up()
        info = tp2.cache_info()
        assert info.num_blocks == start.num_blocks == tp2.engine.block_manager.num_blocks
        assert [r.pool_bytes for r in info.ranks] == [r.pool_bytes for r in start.ranks]
        assert all(r.kv_resident and r.weights == "resident" for r in info.ranks)
        assert tokens(tp2) == tp1_answers[served], f"cycle {cycle} (level {level})"
    assert [r["nan_rows"] for r in tp2.executor.describe_ranks()][0] == 0


def test_tp2_update_weights_equals_a_fresh_engine_on_that_checkpoint(
    tp2, checkpoints, tp1_answers
) -> None:
    served, pushed = checkpoints
    tp2.sleep(2, discard_weights=True)
    tp2.wake_up(["weights"])
    tp2.update_weights(iter_safetensors(Path(pushed), torch.float64))  # cast on our side
    tp2.wake_up(["kv_cache"])
    assert tokens(tp2) == tp1_answers[pushed]
    tp2.load_weights(served)  # each rank reads the directory itself
    assert tokens(tp2) == tp1_answers[served]


def test_a_wake_short_on_rank_1_is_refused_by_every_rank_and_retried(
    checkpoints, tp1_answers, tmp_path
) -> None:
    pressure = tmp_path / "rank1-pressure"
    pressure.touch()
    plan = {"wake_pressure": {"rank": 1, "bytes": 3 << 20, "while_file": str(pressure)}}
    with test_hooks(plan):
        llm = LLM(checkpoints[0], tensor_parallel_size=2, **SMALL)
    with llm:
        blocks = llm.cache_info().num_blocks
        llm.sleep(1)
        start = time.monotonic()
        with pytest.raises(WakeError, match=r"rank 1 needs .* MiB short") as refused:
            llm.wake_up()
        assert time.monotonic() - start < REFUSAL_BOUND_S
        assert refused.value.refused_by == [0, 1]
        assert list(refused.value.short) == [1]
        assert not any(r.kv_resident for r in llm.cache_info().ranks), "something was allocated"
        with pytest.raises(SleepStateError, match="asleep"):
            llm.generate(PROMPTS, GREEDY)
        pressure.unlink()
        llm.wake_up()
        assert llm.cache_info().num_blocks == blocks
        assert tokens(llm) == tp1_answers[checkpoints[0]]


def test_under_torchrun_sleep_wake_and_pushed_weights_change_nothing(checkpoints) -> None:
    script = Path(__file__).with_name("sleep_wake_under_torchrun.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script), checkpoints[0]]
    env = {k: v for k, v in os.environ.items() if k != TEST_HOOKS_ENV}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert report["ranks"] == [0, 1]
    assert len(set(report["blocks"])) == 1
    first = report["rounds"][0]
    assert all(len(t) == 4 for t in first)
    assert report["rounds"] == [first] * 4
