"""What of the engine is asleep, which calls that allows, and the records a sleep leaves.

Plain data, no tensors: the driver (``LLM``) keeps one :class:`SleepState` and checks
every call against it *before* anything is sent to a rank, so an illegal order
raises a clear error and changes nothing. The ranks keep their own view of the
same facts (what they freed, what they hold); the driver's is the one that decides.

The two parts that sleep are vLLM's tags: ``"weights"`` and ``"kv_cache"`` (the
KV/state pools and the decode graphs that write into them).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvrunner.errors import SleepStateError
from kvrunner.runner.ranks.rank_reports import RankCacheInfo

#: wake_up tags, as vLLM and the RL trainers that drive it spell them
TAGS = ("weights", "kv_cache")


def parse_tags(tags: Iterable[str] | str | None) -> tuple[str, ...]:
    """``None`` means both; a single string is one tag; unknown tags are refused."""
    if tags is None:
        return TAGS
    if isinstance(tags, str):
        tags = [tags]
    tags = tuple(dict.fromkeys(tags))
    unknown = [t for t in tags if t not in TAGS]
    if unknown or not tags:
        raise ValueError(f"wake_up tags must be among {list(TAGS)}; got {list(tags)}")
    return tags


@attrs.define
class SleepState:
    """The driver's view of what is resident, and whether the weights can be served."""

    #: "resident", "offloaded" (in host memory) or "discarded" (must be pushed again)
    weights: str = "resident"
    #: "resident" or "released"
    kv_cache: str = "resident"
    #: weight tensors not pushed since the weights were discarded or a push failed
    weights_pending: int = 0
    #: a few of those names, for the error that refuses to generate
    weights_missing: tuple[str, ...] = ()
    #: a push failed part way: the weights are partly old and partly new until every
    #: tensor not loaded since (``weights_pending``) is pushed
    weights_partial: bool = False
    #: the level of the sleep in progress (0: awake)
    level: int = 0
    #: a weight update is open across calls (``start_weight_update`` ...
    #: ``finish_weight_update``): the weights are changing, nothing generates
    update_open: bool = False

    @property
    def awake(self) -> bool:
        return self.weights == "resident" and self.kv_cache == "resident"

    @property
    def weights_status(self) -> str:
        """What the weights are, as ``cache_info()`` reports them: ``"resident"``,
        ``"offloaded"``, ``"discarded"`` (by a sleep, and not all pushed since) or
        ``"partial"`` (a push failed part way, and not all pushed since)."""
        if self.weights != "resident":
            return self.weights
        if self.weights_partial:
            return "partial"
        return "discarded" if self.weights_pending else "resident"

    def asleep_tags(self) -> list[str]:
        return [t for t in TAGS if getattr(self, t) != "resident"]

    def require_no_open_update(self, what: str) -> None:
        """Raise while a weight update is open (its parts may still come)."""
        if self.update_open:
            raise SleepStateError(
                f"cannot {what}: a weight update is open (start_weight_update) and the "
                f"weights are changing; finish_weight_update first"
            )

    def require_servable(self, what: str) -> None:
        """Raise unless every part is resident, the weights are whole and no weight
        update is open."""
        self.require_no_open_update(what)
        asleep = self.asleep_tags()
        if asleep:
            raise SleepStateError(
                f"cannot {what}: the engine is asleep ({', '.join(asleep)} released by "
                f"sleep(level={self.level})); call wake_up() first"
            )
        missing = self._missing()
        if self.weights_partial:
            raise SleepStateError(f"cannot {what}: a weight push failed part way, so "
                                  f"{self.repair_advice()}")
        if self.weights_pending:
            raise SleepStateError(
                f"cannot {what}: the weights were discarded by sleep(level=2, "
                f"discard_weights=True) and {self.weights_pending} tensor(s) have not been "
                f"pushed since ({missing}); finish update_weights(...) or "
                f"load_weights(path) first"
            )

    def repair_advice(self) -> str:
        """What partial weights are and the calls that serve again, for the messages
        that refuse a push part way and every call refused after it."""
        return (
            f"the weights are partial (partly old, partly new): {self.weights_pending} "
            f"tensor(s) were not loaded ({self._missing()}) and generation is refused "
            f"until each is pushed: push them (update_weights with them, or a whole "
            f"push again: update_weights_from_ipc / update_weights_from_distributed) "
            f"or load a whole checkpoint (load_weights(path))"
        )

    def _missing(self) -> str:
        more = " ..." if self.weights_pending > len(self.weights_missing) else ""
        return ", ".join(self.weights_missing) + more

    def require_can_sleep(self, level: int, discard_weights: bool) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2; got {level!r}")
        if discard_weights and level != 2:
            raise ValueError("discard_weights=True needs sleep(level=2): level 1 keeps weights")
        if not self.awake:
            raise SleepStateError(
                f"already asleep ({', '.join(self.asleep_tags())} released by "
                f"sleep(level={self.level})); call wake_up() before sleeping again"
            )

    def require_weights_resident(self, what: str) -> None:
        if self.weights != "resident":
            raise SleepStateError(
                f"cannot {what}: the weights are {self.weights} by sleep(level={self.level}); "
                f"call wake_up(['weights']) first"
            )

    def require_kv_resident(self, what: str) -> None:
        if self.kv_cache != "resident":
            raise SleepStateError(
                f"cannot {what}: the KV cache is released by sleep(level={self.level}); "
                f"call wake_up(['kv_cache']) first"
            )


@attrs.frozen(kw_only=True)
class CacheInfo:
    """A frozen record of the engine's cache pool and its last sleep / wake / recapture.

    ``num_blocks`` and ``num_state_slots`` never change after start-up: a wake
    allocates exactly these counts or fails.
    """

    num_blocks: int
    block_size: int
    num_state_slots: int
    prefix_cached_blocks: int
    weights: str
    kv_cache: str
    ranks: tuple[RankCacheInfo, ...]
    last_sleep_level: int
    last_sleep_s: float
    last_wake_s: float
    last_recapture_s: float
    #: device bytes the last sleep returned to the device (rank 0; on the CPU the
    #: bytes of the pool storages it freed, plus the weights released), measured
    last_freed_bytes: int
    num_sleeps: int
    num_wakes: int
    #: sampled rows whose logits were non-finite (NaN, +inf, or all -inf), since start;
    #: each ended its request with finish reason "error"
    nonfinite_rows: int = 0
    #: prompt tokens whose KV admission found in the prefix cache (not computed), since
    #: start: the samples of an ``n > 1`` request share their prompt this way
    prefix_hit_tokens: int = 0
    #: blocks no request holds (a cached prefix block nobody uses counts: it is
    #: evicted on demand), and state slots no request holds; between calls, all
    num_free_blocks: int = 0
    num_free_state_slots: int = 0

    @property
    def pool_bytes(self) -> int:
        """All backends' pool bytes on rank 0."""
        return sum(self.ranks[0].pool_bytes.values())
