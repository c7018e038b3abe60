"""What a rank answers to the driver's sleep, wake and weight-push calls: typed records.

Every rank answers each call with one of these (in rank order on the driver, see
:class:`~kvrunner.runner.ranks.rank_client.RankClient`); the driver folds them into the
one :class:`~kvrunner.rl.sleep_state.SleepState` that decides which calls are legal.
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


@attrs.frozen(kw_only=True)
class RankCacheInfo:
    """One rank's pools and weights, as :meth:`kvrunner.LLM.cache_info` reports them."""

    rank: int
    device: str
    #: bytes of each backend's pools on this rank while resident (backend -> bytes)
    pool_bytes: dict[str, int]
    #: bytes of this rank's weights (its TP shard) while resident
    weight_bytes: int
    kv_resident: bool
    #: "resident", "offloaded" or "discarded"
    weights: str
    #: what the last sleep returned to the device on CUDA, the pool storage it freed
    #: (plus the weights released) on the CPU; measured, never a backend's word
    last_freed_bytes: int = 0
    #: device memory this rank's process held (reserved by torch) around its last
    #: sleep and after its last wake; 0 on the CPU
    device_bytes_before_sleep: int = 0
    device_bytes_after_sleep: int = 0
    device_bytes_after_wake: int = 0
    #: bytes of live tensors after the last wake (CUDA): the same after every wake
    #: unless something leaks; the reserved figure above also moves with the
    #: allocator's segment layout (a level-2 wake reallocates the weights)
    allocated_bytes_after_wake: int = 0
