"""One rank's sleep, wake and weight updates (a part of :class:`ModelRunner`).

``sleep(level)`` drops the decode graphs and their memory pool, releases every
backend's pools through ``release_cache`` (and checks that their storage is gone:
:mod:`~kvrunner.runner.pool_release`) and, at level 2, the weights (kept in
host memory or discarded); then it returns the memory to the device. ``wake_up``
allocates exactly the saved block and slot counts through ``allocate_cache``
after a cross-rank preflight (:mod:`~kvrunner.runner.wake_preflight`); sizing never
runs again. Once every part is back (and the weights are whole) the decode graphs
are recaptured, through the same blanked capture as at start-up.

The driver decides which calls are legal (:class:`~kvrunner.sleep_state.SleepState`);
the checks here only keep a rank from being driven into a state it cannot serve.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from kvrunner.models.checkpoint_tensors import CheckpointTensors
from kvrunner.plugin_api.errors import BackendError
from kvrunner.runner.pool_release import PoolRelease
from kvrunner.runner.rank_reports import PushReport, SleepReport, WakeReport
from kvrunner.runner.wake_preflight import agree_allocated, available_bytes, preflight
from kvrunner.sleep_state import RankCacheInfo, SleepStateError, WeightUpdateError
from kvrunner.weight_push import tensor_problem

#: how many of the tensors still to push an error names
MISSING_SHOWN = 8


class SleepWake:
    """Sleep, wake and weight updates for :class:`~kvrunner.runner.model_runner.ModelRunner`.

    Uses the runner's ``config``, ``device``, ``group``, ``model``, ``weights``, ``backends``,
    ``pools``, ``graphs``, ``num_blocks``, ``num_slots``, ``activation_peak_bytes``
    and ``capture()``.
    """

    def _init_sleep_wake(self) -> None:
        # self.weights (a WeightResidency) is made by the runner as the weights load
        self.kv_resident = True
        #: checkpoint names not pushed since the weights were discarded
        self.weights_pending: set[str] = set()
        #: names the driver's current update call has loaded (see begin_weight_update)
        self._update_loaded: set[str] = set()
        #: test hook: bytes to treat as taken by someone else when a wake checks memory
        self.wake_pressure: Callable[[], int] = lambda: 0
        self.device_bytes_before_sleep = 0
        self.device_bytes_after_sleep = 0
        self.device_bytes_after_wake = 0
        self.allocated_bytes_after_wake = 0
        self.last_freed_bytes = 0

    # -- what the pools and weights take ---------------------------------------------

    def pool_bytes_by_backend(self) -> dict[str, int]:
        """Each backend's pool bytes at the saved counts (resident or not)."""
        return {
            name: s.bytes_per_block * self.num_blocks + s.bytes_per_slot * self.num_slots
            for name, s in self.backends.cache_specs().items()
        }

    def _device_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    def _return_memory(self) -> None:
        gc.collect()  # graphs and modules hold reference cycles
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # -- sleep -----------------------------------------------------------------------

    def sleep(self, level: int, discard_weights: bool = False) -> SleepReport:
        """Release the graphs and pools (level 1) and the weights (level 2).

        The sleep completes even when a backend's ``release_cache`` kept a pool alive
        (the report's ``kept`` names it): the driver raises once its state says asleep.
        """
        if not (self.kv_resident and self.weights.state == "resident"):
            raise SleepStateError("this rank is already asleep")
        start = time.perf_counter()
        before = self.device_bytes_before_sleep = self._device_bytes()
        release = PoolRelease(self.pools)
        weight_bytes = 0
        self.graphs = {}  # their memory pool goes with them
        self.backends.release_cache()
        self.pools = {}
        self.kv_resident = False
        if level == 2:
            weight_bytes = self.weights.release(discard=discard_weights)
            if discard_weights:
                self.weights_pending = set(self.model.expected_weight_names())
        self._return_memory()
        self.device_bytes_after_sleep = self._device_bytes()
        if self.device.type == "cuda":
            freed = before - self.device_bytes_after_sleep
        else:
            freed = release.freed_bytes() + weight_bytes
        self.last_freed_bytes = freed
        try:
            release.require_released()
            kept = ""
        except BackendError as e:
            kept = str(e)
        return SleepReport(seconds=time.perf_counter() - start, freed_bytes=freed,
                           pending=len(self.weights_pending), kept=kept)

    # -- wake ------------------------------------------------------------------------

    def wake_up(self, tags: tuple[str, ...]) -> WakeReport:
        """Bring back the tagged parts at their saved sizes, or raise ``WakeError`` on
        every rank with nothing allocated."""
        start = time.perf_counter()
        wake_weights = "weights" in tags and self.weights.state != "resident"
        wake_kv = "kv_cache" in tags and not self.kv_resident
        what = repr(list(tags))
        if wake_weights or wake_kv:
            on_cuda = self.device.type == "cuda"
            pool_bytes = sum(self.pool_bytes_by_backend().values())
            need = self.weights.nbytes if wake_weights and on_cuda else 0
            if wake_kv:
                need += pool_bytes + self.activation_peak_bytes
            held = pool_bytes if self.kv_resident else 0
            room = available_bytes(self.config.cache, self.device, held_bytes=held)
            preflight(need=need, available=room - self.wake_pressure(), what=what,
                      group=self.group)

            prior_weights = self.weights.state

            def allocate() -> None:
                if wake_weights:
                    self.weights.restore()
                if wake_kv:
                    # The saved counts, never re-derived: the engine's block manager
                    # and every other rank were built on exactly these.
                    self.pools = self.backends.allocate_cache(
                        num_blocks=self.num_blocks, num_slots=self.num_slots
                    )

            def undo() -> None:  # whatever allocate() got done, on this rank
                if wake_kv and self.pools:
                    self.backends.release_cache()
                    self.pools = {}
                if wake_weights and self.weights.state == "resident":
                    self.weights.release(discard=prior_weights == "discarded")
                self._return_memory()

            agree_allocated(allocate, undo, what=what, group=self.group)
            self.kv_resident = self.kv_resident or wake_kv
        recapture_s = self._recapture_if_whole() if wake_weights or wake_kv else 0.0
        self.device_bytes_after_wake = self._device_bytes()
        if self.device.type == "cuda":
            self.allocated_bytes_after_wake = torch.cuda.memory_allocated(self.device)
        return WakeReport(seconds=time.perf_counter() - start, recapture_s=recapture_s)

    def _recapture_if_whole(self) -> float:
        """Capture the decode graphs once everything is resident and the weights whole."""
        whole = self.kv_resident and self.weights.state == "resident" and not self.weights_pending
        if not whole or self.config.capture.enforce_eager:
            return 0.0
        return self.capture()

    # -- weights ---------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        """Start counting what one driver call loads (it may arrive in several buckets)."""
        self._update_loaded = set()

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load Hugging Face-named full tensors (this rank takes its shard, in its dtype);
        returns how many were loaded. Raises ``WeightUpdateError`` naming a bad one,
        after :meth:`_fail_weight_update`."""
        if self.weights.state != "resident":
            raise SleepStateError(f"weights are {self.weights.state}: wake them first")
        loaded: set[str] = set()
        try:
            self.model.load_weights(weights, require_all=False, loaded=loaded)
        except BaseException as e:
            self._fail_after(loaded)
            if isinstance(e, ValueError) and not isinstance(e, WeightUpdateError):
                raise WeightUpdateError(str(e)) from e
            raise
        self._note_loaded(loaded)
        return len(loaded)

    def load_weights(self, path: str, check_finite: bool = True) -> int:
        """Every tensor of a safetensors checkpoint directory (a whole model: a missing
        or unexpected tensor is refused too); a fault raises ``CheckpointError``
        naming the file and the tensor, after :meth:`_fail_weight_update`."""
        if self.weights.state != "resident":
            raise SleepStateError(f"weights are {self.weights.state}: wake them first")
        check = (lambda _, t: tensor_problem(t, check_finite=True)) if check_finite else None
        tensors = CheckpointTensors(Path(path), self.dtype, check=check)
        loaded: set[str] = set()
        try:
            self.model.load_weights(tensors, loaded=loaded)
        except BaseException as e:
            self._fail_after(loaded)
            if isinstance(e, ValueError):
                raise tensors.error(e) from None
            raise
        self._note_loaded(loaded)
        return len(loaded)

    def _note_loaded(self, loaded: set[str]) -> None:
        self.weights_pending -= loaded
        self._update_loaded |= loaded

    def _fail_after(self, loaded: set[str]) -> None:
        self._note_loaded(loaded)
        self.fail_weight_update()

    def fail_weight_update(self) -> PushReport:
        """A push failed part way (here or on the driver): unless the call loaded
        nothing (the weights are unchanged), every tensor it did not load is pending
        until pushed, whatever was pushed before it. Returns what
        :meth:`finish_weight_update` does, without recapturing, and ``partial``:
        whether the call loaded anything."""
        if self._update_loaded:  # idempotent: the rank and then the driver may call it
            self.weights_pending = set(self.model.expected_weight_names()) - self._update_loaded
        return self._push_report(partial=bool(self._update_loaded))

    def finish_weight_update(self) -> PushReport:
        """After the last tensor of an update: recapture if the engine is whole; how
        many tensors are still missing since a discard or a failed push, and a few of
        their names."""
        self._update_loaded = set()
        return self._push_report(recapture_s=self._recapture_if_whole())

    def _push_report(self, *, partial: bool = False, recapture_s: float = 0.0) -> PushReport:
        return PushReport(pending=len(self.weights_pending),
                          missing=tuple(sorted(self.weights_pending)[:MISSING_SHOWN]),
                          recapture_s=recapture_s, partial=partial)

    # -- reporting -------------------------------------------------------------------

    def cache_info(self, rank: int) -> RankCacheInfo:
        return RankCacheInfo(
            rank=rank,
            device=str(self.device),
            pool_bytes=self.pool_bytes_by_backend(),
            weight_bytes=self.weights.nbytes,
            kv_resident=self.kv_resident,
            weights=self.weights.state,
            last_freed_bytes=self.last_freed_bytes,
            device_bytes_before_sleep=self.device_bytes_before_sleep,
            device_bytes_after_sleep=self.device_bytes_after_sleep,
            device_bytes_after_wake=self.device_bytes_after_wake,
            allocated_bytes_after_wake=self.allocated_bytes_after_wake,
        )
