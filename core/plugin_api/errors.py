"""The errors a backend plugin sees: the ones it may raise and the ones the core
raises about it.

A backend raises :class:`BackendError` for a request it cannot serve (a layer type,
a shape, a dtype), naming itself and the problem. The core raises it for a backend
that breaks the contract (a missing declaration, a hook that answers wrongly), and
wraps any exception from inside a hook in :class:`BackendHookError` with the
backend's and the hook's names.
"""

from __future__ import annotations

from kvrunner.errors import KvrunnerError


class BackendError(KvrunnerError, RuntimeError):
    """A backend could not be found, loaded, validated or called correctly."""


class BackendHookError(BackendError):
    """A backend's hook raised: a bug in the backend, reported with its traceback."""


__all__ = ["BackendError", "BackendHookError", "KvrunnerError"]
