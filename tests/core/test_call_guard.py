"""The guard that refuses a second, concurrent call into an LLM: it refuses only while
a call runs, and a Ctrl-C landing as it is taken leaves it free (a real SIGINT)."""

from __future__ import annotations

import signal
import threading

import pytest

from kvrunner import ConcurrentUseError
from kvrunner.call_guard import _ATTR, _lock_of, exclusive


class Engine:
    """An object with one guarded method that can be held inside."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    @exclusive
    def step(self, hold: bool = False) -> int:
        self.calls += 1
        if hold:
            self.inside.set()
            self.release.wait(30)
        return self.calls


def test_a_second_call_while_one_runs_is_refused_and_the_first_is_undisturbed() -> None:
    engine = Engine()
    results: list[int] = []
    worker = threading.Thread(target=lambda: results.append(engine.step(hold=True)))
    worker.start()
    try:
        assert engine.inside.wait(30)
        with pytest.raises(ConcurrentUseError, match="Engine.step was called while another"):
            engine.step()
    finally:
        engine.release.set()
        worker.join(30)
    assert results == [1]
    assert engine.step() == 2  # free again


class _InterruptedAsTaken:
    """The object's lock, with a Ctrl-C arriving as its acquire returns."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock

    def acquire(self, blocking: bool = True) -> bool:
        taken = self.lock.acquire(blocking)
        signal.raise_signal(signal.SIGINT)
        return taken

    def release(self) -> None:
        self.lock.release()


def test_a_ctrl_c_as_the_guard_is_taken_leaves_it_free() -> None:
    engine = Engine()
    lock = _lock_of(engine)
    engine.__dict__[_ATTR] = _InterruptedAsTaken(lock)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.__dict__[_ATTR] = lock
    assert engine.calls == 0  # the interrupted call ran nothing
    assert not lock.locked()
    assert engine.step() == 1  # not refused as if a call still ran
