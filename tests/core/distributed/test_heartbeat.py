"""A rank that stops running (SIGSTOP) is named within ``heartbeat_timeout_s``, long
before ``distributed_timeout_s``; a rank that runs but is busy is not.

Real groups: two spawned ranks over gloo, the driver's engine, a real SIGSTOP.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from kvrunner import LLM, SamplingParams
from kvrunner.distributed.errors import WorkerError
from kvrunner.distributed.fault_injection import TEST_HOOKS_ENV
from kvrunner.distributed.supervisor import FAILURE_GRACE_S

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 17, 29, 101], [200, 201]]
SMALL = dict(max_num_seqs=4, max_model_len=64, block_size=8, num_blocks=64, enforce_eager=True)
HEARTBEAT_S = 2.0
#: the collectives' bound: far above what the heartbeat needs, well below a CI timeout
COLLECTIVE_S = 40.0
#: past the heartbeat timeout: one poll, the grace to hear the other rank, the stop
MARGIN_S = 1.0 + FAILURE_GRACE_S + 3.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) is gone for our purpose
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


@pytest.fixture
def tp2(kvrunner_home: str) -> Iterator[LLM]:
    llm = LLM("tiny-qwen3", tensor_parallel_size=2, heartbeat_timeout_s=HEARTBEAT_S,
              distributed_timeout_s=COLLECTIVE_S, **SMALL)
    pids = llm.executor.procs.pids
    yield llm
    for pid in pids:  # a test that failed half way must not leave a stopped rank
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    llm.shutdown()


@pytest.mark.parametrize("during", ["wake_up", "generate"])
def test_a_stopped_rank_is_named_within_the_heartbeat_timeout(tp2: LLM, during: str) -> None:
    assert tp2.generate(PROMPTS, GREEDY)[0].token_ids  # a healthy group first
    pids = tp2.executor.procs.pids
    if during == "wake_up":
        tp2.sleep(1)
    os.kill(pids[1], signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        if during == "wake_up":
            tp2.wake_up()
        else:
            tp2.generate(PROMPTS, GREEDY)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    what = "call 'wake_up'" if during == "wake_up" else "a step"
    assert str(info.value).startswith(f"tensor-parallel rank 1 failed during {what}: "
                                      f"HeartbeatTimeout: no heartbeat for ")
    assert HEARTBEAT_S <= elapsed < HEARTBEAT_S + MARGIN_S, elapsed
    assert not [pid for pid in pids if alive(pid)], "a rank outlived the failed group"
    with pytest.raises(WorkerError, match="already failed"):
        tp2.generate(PROMPTS, GREEDY)


def test_a_busy_rank_keeps_beating_and_is_left_to_the_collective_timeout(
    kvrunner_home: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 sleeps in its second step (running, not stopped): its heartbeat goes on,
    and only the collectives' timeout ends the wait, naming it as hung."""
    monkeypatch.setenv(TEST_HOOKS_ENV, '{"fail": {"rank": 1, "at": "step", "step": 2, '
                                       '"mode": "hang"}}')
    llm = LLM("tiny-qwen3", tensor_parallel_size=2, heartbeat_timeout_s=HEARTBEAT_S,
              distributed_timeout_s=3 * HEARTBEAT_S, **SMALL)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start >= 3 * HEARTBEAT_S
        assert info.value.rank == 1
        assert "HeartbeatTimeout" not in str(info.value)
        assert "TimeoutError" in str(info.value)
    finally:
        llm.shutdown()
