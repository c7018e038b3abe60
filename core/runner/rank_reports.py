"""What a rank answers to the driver's sleep, wake and weight-push calls: typed records.

Every rank answers each call with one of these (in rank order on the driver, see
:class:`~kvrunner.runner.rank_client.RankClient`); the driver folds them into the
one :class:`~kvrunner.sleep_state.SleepState` that decides which calls are legal.
Plain data, picklable: they cross a pipe or a torch.distributed broadcast.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class SleepReport:
    """One rank's sleep."""

    seconds: float
    #: device bytes returned to the device on CUDA; the bytes of the pool storages
    #: actually freed (plus the weights released) on the CPU; measured, both
    freed_bytes: int
    #: weight tensors that must be pushed before serving (all of them after a discard)
    pending: int
    #: when a backend's ``release_cache`` kept a pool alive, the message naming it
    kept: str = ""


@attrs.frozen(kw_only=True)
class WakeReport:
    """One rank's wake."""

    seconds: float
    #: seconds the recapture took, 0.0 when none ran (something still asleep)
    recapture_s: float = 0.0


@attrs.frozen(kw_only=True)
class PushReport:
    """One rank's weights after a push (one driver call, perhaps several buckets)."""

    #: tensors still to push since a discard or a failed push
    pending: int
    #: a few of their names, for the error that refuses to generate
    missing: tuple[str, ...] = ()
    recapture_s: float = 0.0
    #: a failed push loaded something: the weights are partly old, partly new
    partial: bool = False
