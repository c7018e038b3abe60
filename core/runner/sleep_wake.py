"""One rank's sleep and wake.

``sleep(level)`` drops the decode graphs and their memory pool, releases every
backend's pools through ``release_cache`` (and checks that their storage is gone:
:mod:`~kvrunner.runner.pools.pool_release`) and, at level 2, the weights (kept in
host memory or discarded); then it returns the memory to the device. ``wake_up``
allocates exactly the saved block and slot counts through ``allocate_cache``
after a cross-rank preflight (:mod:`~kvrunner.runner.pools.wake_preflight`); sizing never
runs again. Once every part is back (and the weights are whole) the decode graphs
are recaptured, through the same blanked capture as at start-up.

What is resident is the parts' own state (:class:`~kvrunner.runner.pools.cache_pools.CachePools`,
:class:`~kvrunner.runner.weight_store.WeightStore`); :class:`SleepWake` moves them and
measures what each move did. The driver decides which calls are legal
(:class:`~kvrunner.rl.sleep_state.SleepState`); the checks here only keep a rank from
being driven into a state it cannot serve.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvrunner import process_heap
from kvrunner.config import EngineConfig
from kvrunner.distributed.group import DistGroup
from kvrunner.errors import SleepStateError
from kvrunner.plugin_api.errors import BackendError
from kvrunner.runner.capture.graph_capture import GraphCapture
from kvrunner.runner.pools.cache_pools import CachePools
from kvrunner.runner.pools.wake_preflight import agree_allocated, available_bytes, preflight
from kvrunner.runner.ranks.rank_reports import RankCacheInfo, SleepReport, WakeReport
from kvrunner.runner.weight_store import WeightStore


class SleepWake:
    """Sleep and wake of one rank's pools, weights and graphs.

    :param capture: the runner's (re)capture of every decode graph.
    """

    def __init__(
        self,
        *,
        config: EngineConfig,
        device: torch.device,
        group: DistGroup | None,
        cache: CachePools,
        weights: WeightStore,
        graphs: GraphCapture,
        capture: Callable[[], float],
    ) -> None:
        self.config = config
        self.device = device
        self.group = group
        self.cache = cache
        self.weights = weights
        self.graphs = graphs
        self._capture = capture
        #: test hook: bytes to treat as taken by someone else when a wake checks memory
        self.wake_pressure: Callable[[], int] = lambda: 0
        self.device_bytes_before_sleep = 0
        self.device_bytes_after_sleep = 0
        self.device_bytes_after_wake = 0
        self.allocated_bytes_after_wake = 0
        self.last_freed_bytes = 0

    def _device_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    def _return_memory(self) -> None:
        process_heap.collect()  # graphs and modules hold reference cycles
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # -- sleep -----------------------------------------------------------------------

    def sleep(self, level: int, discard_weights: bool = False) -> SleepReport:
        """Release the graphs and pools (level 1) and the weights (level 2).

        The sleep completes even when a backend's ``release_cache`` kept a pool alive
        (the report's ``kept`` names it): the driver raises once its state says asleep.
        """
        if not (self.cache.resident and self.weights.state == "resident"):
            raise SleepStateError("this rank is already asleep")
        start = time.perf_counter()
        before = self.device_bytes_before_sleep = self._device_bytes()
        weight_bytes = 0
        self.graphs.drop()  # their memory pool goes with them
        release = self.cache.release()
        if level == 2:
            weight_bytes = self.weights.release(discard=discard_weights)
        self._return_memory()
        self.device_bytes_after_sleep = self._device_bytes()
        if self.device.type == "cuda":
            freed = before - self.device_bytes_after_sleep
        else:
            freed = release.freed_bytes() + weight_bytes
        self.last_freed_bytes = freed
        try:
            release.require_released(collected=True)  # _return_memory collected
            kept = ""
        except BackendError as e:
            kept = str(e)
        return SleepReport(seconds=time.perf_counter() - start, freed_bytes=freed,
                           pending=len(self.weights.pending), kept=kept)

    # -- wake ------------------------------------------------------------------------

    def wake_up(self, tags: tuple[str, ...]) -> WakeReport:
        """Bring back the tagged parts at their saved sizes, or raise ``WakeError`` on
        every rank with nothing allocated."""
        start = time.perf_counter()
        cache, weights = self.cache, self.weights
        wake_weights = "weights" in tags and weights.state != "resident"
        wake_kv = "kv_cache" in tags and not cache.resident
        what = repr(list(tags))
        if wake_weights or wake_kv:
            on_cuda = self.device.type == "cuda"
            pool_bytes = sum(cache.bytes_by_backend().values())
            need = weights.nbytes if wake_weights and on_cuda else 0
            if wake_kv:
                # the pool, and room for the activation peak the pool was sized after
                need += pool_bytes + cache.size.activation_peak_bytes
            held = pool_bytes if cache.resident else 0
            room = available_bytes(self.config.cache, self.device, held_bytes=held)
            preflight(need=need, available=room - self.wake_pressure(), what=what,
                      group=self.group)

            prior_weights = weights.state

            def allocate() -> None:
                if wake_weights:
                    weights.restore()
                if wake_kv:
                    cache.allocate()

            def undo() -> None:  # whatever allocate() got done, on this rank
                if wake_kv and cache.resident:
                    cache.release()
                if wake_weights and weights.state == "resident":
                    weights.residency.release(discard=prior_weights == "discarded")
                self._return_memory()

            agree_allocated(allocate, undo, what=what, group=self.group)
        recapture_s = self.recapture_if_whole() if wake_weights or wake_kv else 0.0
        self.device_bytes_after_wake = self._device_bytes()
        if self.device.type == "cuda":
            self.allocated_bytes_after_wake = torch.cuda.memory_allocated(self.device)
        return WakeReport(seconds=time.perf_counter() - start, recapture_s=recapture_s)

    def recapture_if_whole(self) -> float:
        """Capture the decode graphs once everything is resident and the weights whole."""
        if not (self.cache.resident and self.weights.whole) or self.config.capture.enforce_eager:
            return 0.0
        return self._capture()

    # -- reporting -------------------------------------------------------------------

    def cache_info(self, rank: int) -> RankCacheInfo:
        return RankCacheInfo(
            rank=rank,
            device=str(self.device),
            pool_bytes=self.cache.bytes_by_backend(),
            weight_bytes=self.weights.nbytes,
            kv_resident=self.cache.resident,
            weights=self.weights.state,
            last_freed_bytes=self.last_freed_bytes,
            device_bytes_before_sleep=self.device_bytes_before_sleep,
            device_bytes_after_sleep=self.device_bytes_after_sleep,
            device_bytes_after_wake=self.device_bytes_after_wake,
            allocated_bytes_after_wake=self.allocated_bytes_after_wake,
        )
