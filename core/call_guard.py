"""Refusing a second, concurrent call into an object that is not thread-safe.

An ``LLM`` owns one engine whose scheduler expects ``schedule()`` and ``update()``
to alternate; two threads stepping it at once would interleave them and corrupt
its state. Rather than let that surface as an internal assertion, a method marked
:func:`exclusive` refuses to start while another marked call on the same object is
running, with a :class:`~kvrunner.errors.ConcurrentUseError` that says why.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvrunner.errors import ConcurrentUseError
from kvrunner.held_sigint import sigint_held

F = TypeVar("F", bound=Callable[..., Any])

#: guards the lazy creation of each object's own lock
_CREATE = threading.Lock()
_ATTR = "_kvrunner_call_lock"


def _lock_of(obj: object) -> threading.Lock:
    lock = obj.__dict__.get(_ATTR)
    if lock is None:
        with _CREATE:
            lock = obj.__dict__.setdefault(_ATTR, threading.Lock())
    return lock


def exclusive(method: F) -> F:
    """Run ``method`` only while no other exclusive method of the same object runs."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        lock = _lock_of(self)
        taken = False
        try:
            # A Ctrl-C landing between the acquire and the note that it was taken
            # would leave the object refusing every later call: held until both are
            # done, it is raised inside this try, which lets the lock go.
            with sigint_held():
                taken = lock.acquire(blocking=False)
            if not taken:
                raise ConcurrentUseError(
                    f"{type(self).__name__}.{method.__name__} was called while another call "
                    f"on the same {type(self).__name__} is still running (from another "
                    f"thread); {type(self).__name__} is not thread-safe: use one per thread, "
                    f"or serialise the calls with a lock"
                )
            return method(self, *args, **kwargs)
        finally:
            if taken:
                lock.release()

    return guarded  # type: ignore[return-value]
