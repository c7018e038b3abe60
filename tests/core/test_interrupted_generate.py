"""An interrupted ``generate`` (Ctrl-C, or any exception out of a step) leaves the LLM
usable: that call's requests are aborted, their blocks and state slots freed, the
step in flight settled, and the next call returns what a fresh engine returns.

The interrupt is raised inside the real engine path: right after the executor
launched a step (the scheduler holds it, the engine never got its handle) or right
after a step's tokens were read (they are lost with the call). A real SIGINT raised
inside the scheduler's bookkeeping (admitting a request, applying a step) is held
until the step is done; a property raises one as any call into kvrunner's own code
starts during a generate. One test sends a real SIGINT to a process looping over
generate calls.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sigint_at_call import SigintAtCall, run_traced

import kvrunner
from kvrunner import LLM, SamplingParams
from kvrunner.runner.step.launched_step import SubmittedStep

PROMPTS = [[3, 17, 29, 101], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 201]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
#: a call long enough to be interrupted in its middle
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SMALL = dict(max_num_seqs=4, max_model_len=64, block_size=8, num_blocks=64)
#: the step of the interrupted call in which the interrupt lands
INTERRUPTED_STEP = 3


def interrupt_at(llm: LLM, site: str, step: int = INTERRUPTED_STEP) -> Callable[[], None]:
    """Make the ``step``-th step submitted from now raise KeyboardInterrupt at
    ``site``: "launch" (after the real launch, before the engine has its handle) or
    "result" (the real tokens read, then lost); returns what undoes it."""
    executor = llm.executor
    real_submit = executor.submit
    count = 0

    def submit(step_input):
        nonlocal count
        count += 1
        handle = real_submit(step_input)
        if count != step:
            return handle
        if site == "launch":
            raise KeyboardInterrupt
        return SubmittedStep(lambda: (handle.read(), _raise_interrupt())[1])

    executor.submit = submit
    return lambda: vars(executor).pop("submit")


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


def assert_every_block_and_slot_free(llm: LLM) -> None:
    info = llm.cache_info()
    assert info.num_free_blocks == info.num_blocks
    assert info.num_free_state_slots == info.num_state_slots
    assert not llm.engine.has_unfinished()


def tokens(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private home for the embedded models, shared by this module's engines."""
    path = str(tmp_path_factory.mktemp("home"))
    old = os.environ.get("KVRUNNER_HOME")
    os.environ["KVRUNNER_HOME"] = path
    yield path
    if old is None:
        os.environ.pop("KVRUNNER_HOME", None)
    else:
        os.environ["KVRUNNER_HOME"] = old


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-qwen3-next"])
def model(request: pytest.FixtureRequest, home: str) -> str:
    return request.param


@pytest.fixture(scope="module")
def fresh_tokens(model: str) -> list[list[int]]:
    with LLM(model, **SMALL) as llm:
        return tokens(llm)


@pytest.fixture(scope="module")
def qwen3_tokens(home: str) -> list[list[int]]:
    """What a fresh TP=1 engine returns on tiny-qwen3 (TP=2 returns the same)."""
    with LLM("tiny-qwen3", **SMALL) as llm:
        return tokens(llm)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("site", ["launch", "result"])
def test_a_keyboard_interrupt_inside_a_step_leaves_the_llm_usable(
    model: str, fresh_tokens: list[list[int]], site: str, async_scheduling: bool
) -> None:
    with LLM(model, async_scheduling=async_scheduling, **SMALL) as llm:
        undo = interrupt_at(llm, site)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, LONG)
        undo()
        assert_every_block_and_slot_free(llm)
        assert tokens(llm) == fresh_tokens
        assert_every_block_and_slot_free(llm)
        # and the rest of the API is open again
        llm.sleep(1)
        llm.wake_up()
        assert tokens(llm) == fresh_tokens


def test_an_error_raised_inside_a_step_is_raised_and_leaves_the_llm_usable(
    model: str, fresh_tokens: list[list[int]]
) -> None:
    with LLM(model, **SMALL) as llm:
        real_submit = llm.executor.submit

        def failing(step_input):
            real_submit(step_input)
            raise OSError("the disk the tokens go to is full")

        llm.executor.submit = failing
        with pytest.raises(OSError, match="disk"):
            llm.generate(PROMPTS, LONG)
        del llm.executor.submit
        assert_every_block_and_slot_free(llm)
        assert tokens(llm) == fresh_tokens


def sigint_inside(llm: LLM, site: str, step: int = INTERRUPTED_STEP) -> Callable[[], None]:
    """Raise a real SIGINT in the middle of the scheduler's bookkeeping, from the
    ``step``-th call of ``site`` on: "queue" (a request is queued, its per-request
    extras not yet noted), "allocate" (a request's blocks are allocated, it is still
    queued), "admit" (it is marked running, its batch row not yet made) or "apply" (a
    step's rows are moved on, its tokens not yet appended). Returns what undoes it."""
    scheduler = llm.engine.scheduler
    owner, name = {"queue": (scheduler._extras, "admit"),
                   "allocate": (scheduler.block_manager, "allocate"),
                   "admit": (scheduler.batch, "append"),
                   "apply": (scheduler.batch, "applied")}[site]
    real = getattr(owner, name)
    count = 0

    def interrupted(*args, **kwargs):
        nonlocal count
        count += 1
        if site == "allocate":
            out = real(*args, **kwargs)
            if count == step:
                signal.raise_signal(signal.SIGINT)  # lands before the queue is popped
            return out
        if count == step:
            signal.raise_signal(signal.SIGINT)  # lands before the real call
        return real(*args, **kwargs)

    setattr(owner, name, interrupted)
    return lambda: vars(owner).pop(name)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("site", ["queue", "allocate", "admit", "apply"])
def test_a_sigint_inside_the_engines_bookkeeping_is_held_until_it_is_whole(
    model: str, fresh_tokens: list[list[int]], site: str, async_scheduling: bool
) -> None:
    """Ctrl-C mid-bookkeeping would leave a request half queued, half admitted (blocks
    held while queued, or running without a batch row) or a step half applied, which
    no abort can undo: generate holds it and raises KeyboardInterrupt once the request
    is queued or the step is done."""
    with LLM(model, async_scheduling=async_scheduling, max_num_seqs=1,
             **{k: v for k, v in SMALL.items() if k != "max_num_seqs"}) as llm:
        # one request at a time: the later ones are admitted in the middle of the call
        undo = sigint_inside(llm, site, step=2)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, LONG)
        undo()
        assert_every_block_and_slot_free(llm)
        assert tokens(llm) == fresh_tokens


#: kvrunner's own code (the engine's bookkeeping, the runner's launch, in this
#: process): a Ctrl-C landing as any of its functions starts must leave every request
#: whole
PACKAGE_DIR = str(Path(kvrunner.__file__).parent)


def traced_generate(llm: LLM, trace: SigintAtCall) -> list[list[int]] | None:
    """``generate(PROMPTS, GREEDY)`` under ``trace``: its tokens, or None when the call
    raised KeyboardInterrupt."""
    _, got = run_traced(lambda: [out.token_ids for out in llm.generate(PROMPTS, GREEDY)],
                        trace)
    return got


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def traced_llm(model: str, request: pytest.FixtureRequest) -> Iterator[tuple[LLM, int]]:
    """One engine for every example (each must leave it as a fresh one), and how many
    calls into kvrunner a whole generate makes once the prompts are in the prefix
    cache (as they are for every example)."""
    with LLM(model, async_scheduling=request.param, **SMALL) as llm:
        tokens(llm)
        counter = SigintAtCall(0, PACKAGE_DIR)
        assert traced_generate(llm, counter) is not None
        yield llm, counter.calls


@settings(max_examples=40, deadline=None)
@given(where=st.floats(0.0, 1.0, exclude_max=True))
def test_a_sigint_at_any_call_into_kvrunner_ends_the_call_and_leaves_it_whole(
    traced_llm: tuple[LLM, int], fresh_tokens: list[list[int]], where: float
) -> None:
    """Wherever a Ctrl-C lands (queueing a request, planning, launching or applying a
    step, freeing blocks), the call raises KeyboardInterrupt and the next
    call answers what a fresh engine answers, with every block free."""
    llm, calls = traced_llm
    trace = SigintAtCall(1 + int(where * calls), PACKAGE_DIR)
    got = traced_generate(llm, trace)
    # (an interrupted call leaves less cached: more calls)
    assert (got is None) == trace.fired, f"call {trace.n} of {trace.calls}: {got}"
    assert_every_block_and_slot_free(llm)
    assert tokens(llm) == fresh_tokens, f"after a Ctrl-C at call {trace.n} of {calls}"


SIGINT_CHILD = textwrap.dedent(
    """
    import json, sys
    from kvrunner import LLM, SamplingParams

    PROMPTS = {prompts!r}
    GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    if __name__ == "__main__":
        llm = LLM("tiny-qwen3", **{small!r}, **{extra!r})
        print("generating", flush=True)
        interrupted = 0
        try:
            while True:
                llm.generate(PROMPTS, LONG)
        except KeyboardInterrupt:
            interrupted = 1
        info = llm.cache_info()
        after = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        print(json.dumps({{"interrupted": interrupted, "after": after,
                          "free": info.num_free_blocks, "blocks": info.num_blocks,
                          "unfinished": llm.engine.has_unfinished()}}), flush=True)
        llm.shutdown()
    """
)


def run_and_interrupt(tmp_path, home: str, extra: dict, *, after_s: float = 1.0) -> dict:
    """Start a process looping over generate calls, SIGINT it mid-loop, and read the
    report it prints after one more generate."""
    script = tmp_path / "child.py"
    script.write_text(SIGINT_CHILD.format(prompts=PROMPTS, small=SMALL, extra=extra))
    env = {**os.environ, "KVRUNNER_HOME": home}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "generating", proc.stderr.read()
        try:
            proc.wait(after_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_a_real_sigint_during_generate_leaves_the_llm_usable(
    tmp_path, home: str, qwen3_tokens: list[list[int]], tp: int
) -> None:
    report = run_and_interrupt(tmp_path, home, {"tensor_parallel_size": tp})
    assert report["interrupted"] == 1
    assert report["free"] == report["blocks"] and not report["unfinished"]
    assert report["after"] == qwen3_tokens


# -- TP=2: spawned ranks over gloo ------------------------------------------------------


@pytest.fixture(scope="module")
def tp2(home: str) -> Iterator[LLM]:
    llm = LLM("tiny-qwen3", tensor_parallel_size=2, **SMALL)
    yield llm
    llm.shutdown()


def interrupt_a_wait(llm: LLM, wait: int = 4) -> Callable[[], None]:
    """Make the driver's ``wait``-th wait for the ranks from now raise KeyboardInterrupt
    (as a Ctrl-C landing while rank 0's tokens are awaited); returns what undoes it."""
    procs = llm.executor.procs
    real = procs._wait_round
    count = 0

    def wait_round(*args):
        nonlocal count
        count += 1
        if count == wait:
            raise KeyboardInterrupt
        return real(*args)

    procs._wait_round = wait_round
    return lambda: vars(procs).pop("_wait_round")


def interrupt_a_send(llm: LLM) -> Callable[[], None]:
    """Make a Ctrl-C land while a step is being sent (after rank 0's copy went out):
    the driver holds it until every rank has the step, then raises. It lands on the
    first step sent after one whose answer the driver asked rank 0 for by itself
    (rank 0 then holds the new step's answer until asked: the case where losing
    count of the step hangs the driver). Returns what undoes it."""
    executor = llm.executor
    conn = executor.procs._conns[0]
    real = conn.send_bytes

    def send_bytes(payload: bytes) -> None:
        real(payload)
        after_asked = executor._asked_for == executor._steps_sent - 1 >= 0
        if pickle.loads(payload)[0] == "step" and after_asked:
            vars(conn).pop("send_bytes")  # once
            signal.raise_signal(signal.SIGINT)

    conn.send_bytes = send_bytes
    return lambda: vars(conn).pop("send_bytes", None)


INTERRUPTS = {"launch": lambda llm: interrupt_at(llm, "launch"),
              "result": lambda llm: interrupt_at(llm, "result"),
              "wait": interrupt_a_wait, "send": interrupt_a_send}


@pytest.mark.parametrize("site", sorted(INTERRUPTS))
def test_at_tp2_a_keyboard_interrupt_inside_a_step_leaves_the_group_serving(
    tp2: LLM, qwen3_tokens: list[list[int]], site: str
) -> None:
    """Wherever the interrupt lands, among them a real Ctrl-C while a step is sent
    (the step is counted as sent with the send itself: its held answer is asked for
    when the driver settles)."""
    pids = tp2.executor.procs.pids
    assert tokens(tp2) == qwen3_tokens  # a whole call first: its last answer was asked for
    undo = INTERRUPTS[site](tp2)
    with pytest.raises(KeyboardInterrupt):
        tp2.generate(PROMPTS, LONG)
    undo()
    assert tp2.executor.procs.alive() == [True, True]
    assert_every_block_and_slot_free(tp2)
    assert tokens(tp2) == qwen3_tokens
    assert tp2.executor.procs.pids == pids  # the same ranks: no new group was needed
    tp2.sleep(1)
    tp2.wake_up()
    assert tokens(tp2) == qwen3_tokens
