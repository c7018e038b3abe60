"""Holding a Ctrl-C (SIGINT) until the state it would cut in half is whole again.

Python raises ``KeyboardInterrupt`` at the next point where it runs signal handlers
(a function's start, a loop's jump back, the return of a call into C), wherever that
is. Inside the scheduler's bookkeeping that can leave a request half admitted (its
blocks allocated while it is still queued, or marked running without a batch row) or
a step half applied, and no abort can undo that. Two holds:

* :func:`sigint_held` holds it over a block and delivers it when the block ends: a
  command sent to every rank or to none, a sleep, wake or push end on the ranks and
  its record in the driver's state, the call guard's lock and the note that it was
  taken;
* :class:`SigintAtStepEnd` holds it over a call's queueing and its loop of engine
  steps and raises it where the call asks (:meth:`~SigintAtStepEnd.check`): once
  its requests are queued and between two steps, where every request is whole and
  an abort frees everything. A second Ctrl-C while one is held raises at once, as
  Python's own handler would: a step that never ends (a hung device) can still be
  left.

Only the main thread may set handlers, so both do nothing elsewhere (and signals are
only delivered there).

A process started inside :func:`children_born_without_sigint` is born with SIGINT
ignored: a rank process, whose driver alone answers Ctrl-C (the terminal sends it to
the whole process group), would otherwise die of it with a traceback while still
importing, before it can ignore it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Hold a Ctrl-C that lands inside the block, and deliver it when the block ends."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # only the main thread may set handlers; None: not ours to replace
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)  # now reaches the previous handler


class SigintAtStepEnd:
    """While entered, a Ctrl-C is raised as ``KeyboardInterrupt`` by :meth:`check`
    (called between steps), or at once if a second one comes first.

    It replaces only Python's own handler: a handler the application installed
    decides for itself. A Ctrl-C held when the block ends normally is raised there.
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous: object = None

    def __enter__(self) -> SigintAtStepEnd:
        self.pending = False
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if self.pending:
            raise KeyboardInterrupt  # asked twice: the step is not waited for
        self.pending = True

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if a Ctrl-C came since the last check."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
            self._previous = None
        if exc_type is None:
            self.check()


@contextlib.contextmanager
def children_born_without_sigint() -> Iterator[None]:
    """Ignore SIGINT while the block starts processes: a child started from this
    process keeps an ignored signal ignored across fork and exec, and Python keeps it
    so, so a Ctrl-C never reaches it. (A signal mask would be held too, but
    multiprocessing clears it in the child.) A Ctrl-C in the block's instant (the
    start of a process: milliseconds) is lost to this process as well."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
