"""The errors ``AsyncLLM`` raises for calls its engine loop cannot take now."""

from __future__ import annotations

from kvrunner.errors import KvrunnerError


class EngineBusyError(KvrunnerError, RuntimeError):
    """An ``AsyncLLM`` control call (sleep, a weight update, a prefix-cache reset) was
    refused because requests hold engine state; the message says what to do first
    (``pause()``, or abort / drain the requests). Nothing was changed."""


class EngineClosedError(KvrunnerError, RuntimeError):
    """An ``AsyncLLM`` was called after ``shutdown()``, or its engine loop stopped."""


class EngineDeadError(EngineClosedError):
    """The engine can serve nothing more: a tensor-parallel rank died (or failed, or
    stopped beating), or the engine thread itself failed. The requests in flight
    failed with the cause (a ``WorkerError`` naming the rank), every other live
    request with this error, and every later call raises it; ``shutdown()`` still
    works. Only a new engine serves again (``kvrunner serve`` exits non-zero, so a
    supervisor restarts it)."""
