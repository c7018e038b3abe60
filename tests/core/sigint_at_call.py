"""A real Ctrl-C, raised where CPython could deliver one: as a chosen call starts.

A function's start is one of the points where CPython runs a signal's handler, so a
``KeyboardInterrupt`` raised there lands exactly where a Ctrl-C can (a line's start,
in general, is not one: a ``finally`` clause's first line is never interrupted).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


class SigintAtCall:
    """A trace function that raises a real SIGINT as the ``n``-th call into code under
    ``directory`` starts (``n`` 0: never; it only counts the calls)."""

    def __init__(self, n: int, directory: str) -> None:
        self.n = n
        self.directory = directory
        self.calls = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(self.directory):
            self.calls += 1
            if self.calls == self.n:
                signal.raise_signal(signal.SIGINT)

    @property
    def fired(self) -> bool:
        """Whether the call came (a shorter run may end before it)."""
        return 0 < self.n <= self.calls


def run_traced(call: Callable[[], Any], trace: SigintAtCall) -> tuple[bool, Any]:
    """Run ``call`` under ``trace``: ``(True, None)`` if it raised KeyboardInterrupt,
    else ``(False, its result)``."""
    sys.settrace(trace)
    try:
        return False, call()
    except KeyboardInterrupt:
        return True, None
    finally:
        sys.settrace(None)
