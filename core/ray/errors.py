"""The errors a :class:`~kvrunner.ray.RolloutFleet` raises about its replicas."""

from __future__ import annotations

from kvrunner.errors import KvrunnerError


class ReplicaError(KvrunnerError, RuntimeError):
    """A replica of the fleet died or its tensor-parallel group failed.

    A request that was on it fails with this error (it is not retried elsewhere:
    see :mod:`kvrunner.ray.fleet`); the fleet stops routing to the replica and keeps
    serving on the others.

    :ivar replica: the index of the replica (0 to ``num_replicas - 1``).
    """

    def __init__(self, message: str, *, replica: int) -> None:
        super().__init__(message)
        self.replica = replica

    def __reduce__(self) -> tuple:  # crosses Ray's object store with its replica
        return (_rebuild, (type(self), str(self), self.replica))


def _rebuild(cls: type[ReplicaError], message: str, replica: int) -> ReplicaError:
    return cls(message, replica=replica)


class NoReplicaError(KvrunnerError, RuntimeError):
    """Every replica of the fleet has died (or the fleet was shut down)."""


class FleetCallError(KvrunnerError, RuntimeError):
    """A call to every replica (pause, sleep, wake, a weight update ...) failed on
    some of them; the message names each replica and its error.

    :ivar failures: replica index -> the exception it raised.
    :ivar results: replica index -> the answer of each replica where it succeeded.
    """

    def __init__(self, what: str, failures: dict[int, BaseException], results: dict[int, object]):
        listed = "; ".join(f"replica {i}: {type(e).__name__}: {e}" for i, e in failures.items())
        super().__init__(f"{what} failed on {len(failures)} replica(s): {listed}")
        self.failures = failures
        self.results = results


class WeightGroupError(KvrunnerError, RuntimeError):
    """A call about the fleet's weight-update group that cannot run now (no group, a
    group already there, a replica of the group has died since it was built);
    nothing was sent or changed."""


class PartialPushError(KvrunnerError, RuntimeError):
    """The fleet's last weight push failed on some replica, so the replicas may hold
    different weights: generation is refused until a push reaches every live
    replica (``update_weights``, or ``update_weights_from_distributed`` over a group
    built again on the live replicas)."""
