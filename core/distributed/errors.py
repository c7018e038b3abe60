"""Errors of a tensor-parallel group, and how a rank's failure reaches the driver.

A rank that raises reports a :class:`RankFailure` (plain strings, always picklable:
the original exception object may not be) over its control channel before it
exits. The driver turns the reports into one :class:`WorkerError` that names the
rank whose failure came first in cause, not merely first in arrival: a rank that
only failed because a peer vanished (:class:`CollectiveError`, :class:`PeerRankError`)
is reported as a consequence, never as the cause.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence

import attrs

from kvrunner.errors import KvrunnerError


class CollectiveError(RuntimeError):
    """A collective over the tensor-parallel group failed or timed out.

    Almost always a consequence: another rank died or raised and left this one
    waiting. The driver looks for that rank's own report first.
    """


class PeerRankError(RuntimeError):
    """This rank is fine but must stop because another rank reported a failure."""


class WorkerError(KvrunnerError, RuntimeError):
    """A tensor-parallel rank failed; the message names it and its exception.

    :ivar rank: the rank whose failure is the cause.
    :ivar failures: every report the driver collected, cause first.
    """

    def __init__(self, message: str, *, rank: int | None, failures: Sequence[RankFailure] = ()):
        super().__init__(message)
        self.rank = rank
        self.failures = tuple(failures)


#: exception type names that mark a report as a consequence of another rank's failure
_CONSEQUENCES = frozenset({CollectiveError.__name__, PeerRankError.__name__})


@attrs.frozen(kw_only=True)
class RankFailure:
    """One rank's exception, flattened to text so it always crosses a pipe or store."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    #: wall-clock time of the report; orders reports between ranks on one host
    at: float

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> RankFailure:
        return cls(
            rank=rank,
            exc_type=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            at=time.time(),
        )

    @property
    def is_consequence(self) -> bool:
        return self.exc_type in _CONSEQUENCES

    def summary(self) -> str:
        return f"rank {self.rank}: {self.exc_type}: {self.message}"


def order_by_cause(failures: Sequence[RankFailure]) -> list[RankFailure]:
    """Causes before consequences; within each, earliest first."""
    return sorted(failures, key=lambda f: (f.is_consequence, f.at, f.rank))


def worker_error(failures: Sequence[RankFailure], *, during: str) -> WorkerError:
    """One error for the driver to raise, naming the causing rank and its exception."""
    ordered = order_by_cause(failures)
    cause = ordered[0]
    lines = [f"tensor-parallel rank {cause.rank} failed during {during}: "
             f"{cause.exc_type}: {cause.message}"]
    if len(ordered) > 1:
        lines.append("other ranks: " + "; ".join(f.summary() for f in ordered[1:]))
    if cause.traceback:
        lines.append(f"--- traceback of rank {cause.rank} ---\n{cause.traceback.rstrip()}")
    return WorkerError("\n".join(lines), rank=cause.rank, failures=ordered)
