"""The base of every error kvrunner raises for a fault a user can fix, and the error
types that belong to no one subsystem.

Every error kvrunner raises for such a fault derives from :class:`KvrunnerError`, so
a caller (the command line among them) can tell "you asked for something that cannot
work" from a bug. A subsystem's own errors live with it (a backend's in
:mod:`kvrunner.plugin_api.errors`, a rank's in :mod:`kvrunner.distributed.errors`);
the ones here are raised from several places: sleep, wake and weight pushes' among
them (the ranks raise them, the driver and the servers catch them).

Each keeps the built-in base its callers already catch (``ValueError`` for bad
values, ``RuntimeError`` for failures at run time). This module imports nothing
from kvrunner, so any module may import it.
"""

from __future__ import annotations

from pathlib import Path


class KvrunnerError(Exception):
    """Base of every error kvrunner raises for a fault the user can fix; the message
    names the field, file, request or rank, and what to do."""


class ConfigError(KvrunnerError, ValueError):
    """A configuration value or key is invalid; the message names it."""


class CheckpointError(KvrunnerError, ValueError):
    """A checkpoint file is missing, truncated, malformed or inconsistent.

    :ivar path: the file (or directory) at fault.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem

    def __reduce__(self) -> tuple:  # crosses a rank's pipe with its path and problem
        return (type(self), (self.path, self.problem))


class RequestError(KvrunnerError, ValueError):
    """A prompt or its sampling settings can never be served; the message names the
    request (by its position in the call) and the field."""


class ConcurrentUseError(KvrunnerError, RuntimeError):
    """An ``LLM`` was called from a second thread while a call was still running.

    ``LLM`` is not thread-safe: use one per thread, or serialise the calls.
    """


class NonFiniteLogitsError(KvrunnerError, RuntimeError):
    """A step sampled a row whose logits were non-finite, with ``nonfinite="raise"``.

    Those requests ended with finish reason ``"error"`` (never a sampled token); the
    call's other requests were aborted, and the engine takes the next call.

    :ivar errors: each failed request's id and its error (``"step 12: logits hold NaN"``).
    """

    def __init__(self, errors: dict[int, str]) -> None:
        listed = "; ".join(f"request {rid}: {why}" for rid, why in errors.items())
        super().__init__(
            f"non-finite logits (nonfinite='raise'): {listed}; the weights are likely "
            f"NaN or inf (check the checkpoint or the last push)"
        )
        self.errors = dict(errors)


class SleepStateError(KvrunnerError, RuntimeError):
    """A call that the engine's sleep state does not allow now; nothing was changed."""


class WakeError(KvrunnerError, RuntimeError):
    """A wake that could not allocate on every rank; nothing stays allocated and the
    engine stays asleep, so the same call can be retried once memory is back.

    :ivar short: ``{rank: bytes short}`` for each rank that could not fit its share.
    """

    def __init__(self, message: str, *, short: dict[int, int] | None = None) -> None:
        super().__init__(message)
        self.short = dict(short or {})

    def __reduce__(self) -> tuple:  # keeps ``short`` across a pipe
        return (_rebuild_wake_error, (str(self), self.short))


def _rebuild_wake_error(message: str, short: dict[int, int]) -> WakeError:
    return WakeError(message, short=short)


class WeightUpdateError(KvrunnerError, ValueError):
    """A pushed tensor was refused (unknown name, wrong shape, not a floating-point
    tensor, not finite); the message names it.

    Nothing of the refused tensor was loaded, and nothing of an update known up front
    (a list or Mapping). If tensors of a streamed push (a generator, earlier buckets)
    loaded before it, the weights are ``"partial"``, the message says how to repair
    them, and the engine refuses to generate until every tensor not loaded since has
    been pushed.
    """
