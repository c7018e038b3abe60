"""A Ctrl-C held until the state it would cut in half is whole: real SIGINTs raised in
this process (the suite runs with Python's own handler, see conftest.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from kvrunner.held_sigint import SigintAtStepEnd, children_born_without_sigint, sigint_held


def test_a_ctrl_c_between_checks_is_raised_by_the_next_check() -> None:
    steps: list[int] = []
    with pytest.raises(KeyboardInterrupt), SigintAtStepEnd() as sigint:
        for step in range(5):
            if step == 2:
                signal.raise_signal(signal.SIGINT)
            steps.append(step)  # the step the Ctrl-C landed in runs to its end
            sigint.check()
    assert steps == [0, 1, 2]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_is_raised_at_once() -> None:
    reached = False
    with pytest.raises(KeyboardInterrupt), SigintAtStepEnd():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        reached = True
    assert not reached
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_held_when_the_loop_ends_is_raised_there() -> None:
    with pytest.raises(KeyboardInterrupt), SigintAtStepEnd():
        signal.raise_signal(signal.SIGINT)


def test_a_block_that_sees_no_ctrl_c_raises_nothing_and_restores_the_handler() -> None:
    with SigintAtStepEnd() as sigint:
        sigint.check()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_applications_own_handler_is_left_to_decide() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: seen.append(signum))
    try:
        with SigintAtStepEnd() as sigint:
            signal.raise_signal(signal.SIGINT)
            sigint.check()  # nothing held: the application's handler had it
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_off_the_main_thread_nothing_is_replaced() -> None:
    handlers: list[object] = []

    def run() -> None:
        with SigintAtStepEnd():
            handlers.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert handlers == [signal.default_int_handler]


def test_sigint_held_delivers_the_ctrl_c_when_the_block_ends() -> None:
    reached = False
    with pytest.raises(KeyboardInterrupt), sigint_held():
        signal.raise_signal(signal.SIGINT)
        reached = True
    assert reached
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigint_held_inside_the_step_loop_hands_its_ctrl_c_to_the_next_check() -> None:
    """A command sent to every rank holds its Ctrl-C to the send's end; the loop then
    holds it to the step's end."""
    after_send = False
    with pytest.raises(KeyboardInterrupt), SigintAtStepEnd() as sigint:
        with sigint_held():
            signal.raise_signal(signal.SIGINT)
        after_send = True
        sigint.check()
    assert after_send


def _wait_a_moment() -> None:
    time.sleep(0.5)


@pytest.mark.parametrize("born_without", [True, False], ids=["inside", "outside"])
def test_a_child_started_inside_never_sees_a_ctrl_c_sent_while_it_starts(
    born_without: bool,
) -> None:
    """The terminal's Ctrl-C reaches every process of its group, a rank still importing
    torch too: started inside, it lives on; outside, it dies of it (the control)."""
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_wait_a_moment)
    if born_without:
        with children_born_without_sigint():
            child.start()
    else:
        child.start()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # ours again
    os.kill(child.pid, signal.SIGINT)  # while it is still starting up
    child.join(30)
    assert (child.exitcode == 0) == born_without, child.exitcode  # outside: 1 or -SIGINT
