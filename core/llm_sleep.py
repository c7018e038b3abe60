"""The RL loop's half of the public API: sleep, wake, weight updates, cache info.

Shaped as vLLM / verl users call it. A training step with a colocated trainer::

    outs = llm.generate(prompt_ids, params)
    llm.sleep(level=2, discard_weights=True)   # the trainer gets the memory
    ...trainer step...
    llm.wake_up(["weights"])
    llm.update_weights(model.named_parameters())  # HF names, full tensors, any dtype
    llm.wake_up(["kv_cache"])                  # same pool, graphs recaptured, blanked
    outs = llm.generate(prompt_ids, params)

Every call is checked against :class:`~kvrunner.sleep_state.SleepState` before a
rank is asked anything, so an illegal order raises and changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvrunner.call_guard import exclusive
from kvrunner.plugin_api.errors import BackendError
from kvrunner.runner.rank_calls import weight_buckets
from kvrunner.sleep_state import CacheInfo, SleepState, SleepStateError, parse_tags
from kvrunner.weight_push import checked_pairs

if TYPE_CHECKING:
    from kvrunner.engine.llm_engine import LLMEngine
    from kvrunner.runner.executor import DriverExecutor


class SleepWakeAPI:
    """Mixed into :class:`kvrunner.LLM` (which provides ``executor``, ``engine`` and
    ``config``)."""

    executor: DriverExecutor
    engine: LLMEngine

    def _init_sleep_state(self) -> None:
        self.sleep_state = SleepState()
        self._timings: dict[str, Any] = {
            "sleep_level": 0, "sleep_s": 0.0, "wake_s": 0.0, "recapture_s": 0.0,
            "freed_bytes": 0, "sleeps": 0, "wakes": 0,
        }

    def _require_idle(self, what: str, *, parked_ok: bool = False) -> None:
        # Parked requests (``LLMEngine.park``: nothing in flight, their blocks and slots
        # held) survive a weight change or a prefix-cache reset; a sleep frees their KV.
        if parked_ok and self.engine.parked:
            return
        if self.engine.has_unfinished():
            raise SleepStateError(
                f"cannot {what} while requests are unfinished (a generate call was "
                f"interrupted); their KV would be lost"
            )

    @exclusive
    def sleep(self, level: int = 1, *, discard_weights: bool = False) -> float:
        """Free the device memory the engine holds; returns seconds.

        Level 1 drops the decode graphs and every backend's cache pools. Level 2 also
        frees the weights: kept in pinned host memory, or discarded
        (``discard_weights=True``) when new ones will be pushed before generating.
        Raises :class:`~kvrunner.plugin_api.BackendError` naming the backend whose
        ``release_cache`` kept its pools' memory (the engine is asleep all the same).
        """
        self.executor.check()
        self.sleep_state.require_can_sleep(level, discard_weights)
        self._require_idle("sleep")
        reports = self.executor.call_ranks("sleep", level, discard_weights)
        state = self.sleep_state
        state.level, state.kv_cache = level, "released"
        if level == 2:
            state.weights = "discarded" if discard_weights else "offloaded"
            state.weights_pending = reports[0]["pending"]
            state.weights_missing = ()  # every tensor: none is named
        seconds = max(r["seconds"] for r in reports)
        self._timings.update(sleep_level=level, sleep_s=seconds,
                             freed_bytes=reports[0]["freed_bytes"],
                             sleeps=self._timings["sleeps"] + 1)
        kept = [f"rank {rank}: {r['kept']}" for rank, r in enumerate(reports) if r["kept"]]
        if kept:  # the engine is asleep all the same: wake_up() allocates new pools
            raise BackendError("; ".join(kept) if len(reports) > 1 else reports[0]["kept"])
        return seconds

    @exclusive
    def wake_up(self, tags: Iterable[str] | str | None = None) -> float:
        """Bring back ``"weights"`` and/or ``"kv_cache"`` (both when ``None``), in either
        order; returns seconds. The KV pool comes back at exactly its start-up size
        on every rank, or :class:`~kvrunner.sleep_state.WakeError` is raised on every
        rank with nothing allocated (retry once memory is free). The prefix cache is
        empty afterwards; the decode graphs are recaptured, blanked, once every part
        is back and the weights are whole."""
        self.executor.check()
        wanted = parse_tags(tags)
        state = self.sleep_state
        todo = tuple(t for t in wanted if getattr(state, t) != "resident")
        if not todo:
            return 0.0
        reports = self.executor.call_ranks("wake_up", todo)
        if "weights" in todo:
            state.weights = "resident"
        if "kv_cache" in todo:
            state.kv_cache = "resident"
            self.engine.block_manager.reset_prefix_cache()  # the KV it indexed is gone
        if state.awake:
            state.level = 0
        seconds = max(r["seconds"] for r in reports)
        recapture = max(r["recapture_s"] for r in reports)
        self._timings.update(wake_s=seconds, wakes=self._timings["wakes"] + 1)
        if recapture:
            self._timings["recapture_s"] = recapture
        return seconds

    @exclusive
    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        check_finite: bool = True,
    ) -> int:
        """Load ``(name, tensor)`` pairs, or a Mapping of them (a ``state_dict``), with
        Hugging Face names and full (unsharded) tensors of any floating dtype, on the
        CPU or a GPU; a generator is fine, and an update may be spread over several
        calls. Returns how many tensors were loaded.

        Each rank takes its tensor-parallel shard in the model's dtype; fused
        projections are filled part by part. A wrong name or shape, a value that is
        not a floating-point tensor, or (``check_finite``, one reduction per tensor)
        NaN or inf raises :class:`~kvrunner.sleep_state.WeightUpdateError` naming it,
        with nothing of that tensor loaded. If tensors before it were, the weights are
        ``"partial"`` (``cache_info().weights``) and generation is refused until every
        tensor this call did not load has been pushed. After a call completes the
        prefix cache is reset and, if the engine is awake, the graphs are recaptured.
        """
        self.executor.check()
        self.sleep_state.require_weights_resident("update_weights")
        self._require_idle("update_weights", parked_ok=True)
        pairs = checked_pairs(weights, check_finite=check_finite)
        with self._weight_change():
            if self.config.parallel.tensor_parallel_size == 1:
                return self.executor.call_ranks("update_weights", pairs)[0]
            loaded = 0
            for bucket in weight_buckets(pairs):
                loaded = loaded + self.executor.call_ranks("update_weights", bucket)[0]
            return loaded

    @exclusive
    def load_weights(self, path: str | Path, *, check_finite: bool = True) -> int:
        """Load every tensor of a safetensors checkpoint directory (each rank reads it),
        as :meth:`update_weights` does; returns how many were loaded. The directory
        must hold the whole model: a wrong shape, a missing or unexpected tensor, or
        (``check_finite``) NaN or inf raises
        :class:`~kvrunner.errors.CheckpointError` naming the file and the tensor."""
        self.executor.check()
        self.sleep_state.require_weights_resident("load_weights")
        self._require_idle("load_weights", parked_ok=True)
        if not Path(path).is_dir():
            raise FileNotFoundError(f"load_weights: {str(path)!r} is not a directory")
        with self._weight_change():
            return self.executor.call_ranks("load_weights", str(path), check_finite)[0]

    @contextlib.contextmanager
    def _weight_change(self) -> Iterator[None]:
        """Around one push: the ranks count what it loads; a failure leaves the state
        saying which tensors are still to push; success resets and recaptures."""
        self.executor.call_ranks("begin_weight_update")
        try:
            yield
        except BaseException:
            self._note_failed_push()
            raise
        finished = self.executor.call_ranks("finish_weight_update")
        self._note_pending(finished[0])
        self.engine.block_manager.reset_prefix_cache()  # cached KV came from the old weights
        recapture = max(f["recapture_s"] for f in finished)
        if recapture:
            self._timings["recapture_s"] = recapture

    def _note_failed_push(self) -> None:
        state = self.sleep_state
        try:
            report = self.executor.call_ranks("fail_weight_update")[0]
        except Exception:  # the ranks cannot say (one died): assume the worst
            state.weights_partial = True
            return
        # a refusal before anything loaded leaves the weights (and the state) as they were
        state.weights_partial = state.weights_partial or report["partial"]
        self._note_pending(report)
        if report["partial"]:
            self.engine.block_manager.reset_prefix_cache()

    def _note_pending(self, report: dict[str, Any]) -> None:
        state = self.sleep_state
        state.weights_pending, state.weights_missing = report["pending"], report["missing"]
        if not state.weights_pending:
            state.weights_partial = False

    @exclusive
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were uncached."""
        self._require_idle("reset_prefix_cache", parked_ok=True)
        return self.engine.block_manager.reset_prefix_cache()

    @exclusive
    def recapture(self) -> float:
        """Capture every decode graph again (blanked, as at start-up); returns seconds."""
        self.sleep_state.require_weights_resident("recapture")
        self.sleep_state.require_kv_resident("recapture")
        seconds = self.executor.capture()
        self._timings["recapture_s"] = seconds
        return seconds

    @exclusive
    def cache_info(self) -> CacheInfo:
        """A frozen record of the pool, what is resident, and the last sleep / wake."""
        ranks = tuple(self.executor.call_ranks("cache_info"))
        manager = self.engine.block_manager
        t = self._timings
        return CacheInfo(
            num_blocks=manager.num_blocks,
            block_size=self.config.cache.block_size,
            num_state_slots=manager.num_state_slots,
            prefix_cached_blocks=manager.pool.num_cached,
            weights=self.sleep_state.weights_status,
            kv_cache=self.sleep_state.kv_cache,
            ranks=ranks,
            last_sleep_level=t["sleep_level"],
            last_sleep_s=t["sleep_s"],
            last_wake_s=t["wake_s"],
            last_recapture_s=t["recapture_s"],
            last_freed_bytes=t["freed_bytes"],
            num_sleeps=t["sleeps"],
            num_wakes=t["wakes"],
            nonfinite_rows=self.engine.scheduler.nonfinite_rows,
            prefix_hit_tokens=manager.prefix_hit_tokens,
            num_free_blocks=manager.num_free_blocks,
            num_free_state_slots=manager.num_free_state_slots,
        )
