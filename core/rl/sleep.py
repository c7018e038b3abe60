"""The RL loop's half of the public API: sleep, wake, weight updates, cache info.

Shaped as vLLM / verl users call it. A training step with a colocated trainer::

    outs = llm.generate(prompt_ids, params)
    llm.sleep(level=2, discard_weights=True)   # the trainer gets the memory
    ...trainer step...
    llm.wake_up(["weights"])
    llm.update_weights(model.named_parameters())  # HF names, full tensors, any dtype
    llm.wake_up(["kv_cache"])                  # same pool, graphs recaptured, blanked
    outs = llm.generate(prompt_ids, params)

:class:`SleepWakeControl` is the part of an ``LLM`` that does it: it owns the one
:class:`~kvrunner.rl.sleep_state.SleepState` of the engine (the ranks only hold what
they were told to hold) and checks every call against it before a rank is asked
anything, so an illegal order raises and changes nothing. The ranks answer through
the typed :class:`~kvrunner.runner.ranks.rank_client.RankClient`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from kvrunner.errors import (
    CheckpointError,
    KvrunnerError,
    SleepStateError,
    WeightUpdateError,
)
from kvrunner.held_sigint import sigint_held
from kvrunner.models.weight_specs import TensorSpec
from kvrunner.plugin_api.errors import BackendError
from kvrunner.rl.sleep_state import CacheInfo, SleepState, parse_tags
from kvrunner.rl.weight_push import checked_pairs
from kvrunner.runner.ranks.rank_calls import weight_buckets
from kvrunner.runner.ranks.rank_client import RankClient
from kvrunner.runner.ranks.rank_reports import PushReport

if TYPE_CHECKING:
    from kvrunner.config import EngineConfig
    from kvrunner.engine.cache_salt import WeightVersion
    from kvrunner.engine.llm_engine import LLMEngine
    from kvrunner.runner.ranks.executor import DriverExecutor
    from kvrunner.weight_sync.ipc_handles import IpcUpdate


#: why each call that needs an idle engine needs it
_WHY_IDLE = {
    "sleep": "a sleep frees the KV cache an unfinished request holds",
    "update_weights": "an unfinished request's KV was computed under the weights it replaces",
    "load_weights": "an unfinished request's KV was computed under the weights it replaces",
    "reset_prefix_cache": "an unfinished request holds blocks of the cache it resets",
}


@attrs.define
class SleepTimings:
    """The last sleep, wake and recapture, as ``cache_info()`` reports them."""

    sleep_level: int = 0
    sleep_s: float = 0.0
    wake_s: float = 0.0
    recapture_s: float = 0.0
    freed_bytes: int = 0
    sleeps: int = 0
    wakes: int = 0


class SleepWakeControl:
    """Sleep, wake and weight pushes of one engine, driven from the driver.

    The public methods of :class:`kvrunner.LLM` of the same names call these (one at
    a time: the LLM guards them); see there for what each does.
    """

    def __init__(self, config: EngineConfig, executor: DriverExecutor, engine: LLMEngine) -> None:
        self.config = config
        self.executor = executor
        self.engine = engine
        self.ranks: RankClient = executor.ranks
        #: what is resident and what may be called: the one record of it
        self.state = SleepState()
        self.timings = SleepTimings()
        #: the weight update held open across calls (:meth:`start_update`), if any
        self._open_update: contextlib.ExitStack | None = None
        self._finish_version: WeightVersion | None = None  # named by finish_update

    def _require_idle(self, what: str, *, parked_ok: bool = False) -> None:
        """Refuse ``what`` (a method's name) while a request is unfinished or a step
        launched, naming the call, the requests, why and what to do instead."""
        # Parked requests (``LLMEngine.park``: nothing in flight, their blocks and slots
        # held) survive a weight change or a prefix-cache reset; a sleep frees their KV.
        if parked_ok and self.engine.parked:
            return
        if not self.engine.has_unfinished():
            return
        ids = self.engine.scheduler.unfinished_ids()
        if not ids:
            held = "a launched step is not applied yet"
            remedy = "let the engine settle first (LLMEngine.settle)"
        else:
            named = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
            held = (f"request {named} is unfinished" if len(ids) == 1
                    else f"{len(ids)} requests are unfinished ({named})")
            remedy = "finish or abort the requests first (LLMEngine.abort_request)"
            if parked_ok:
                remedy += ", or park them with their KV (AsyncLLM.pause(mode='keep'))"
        raise SleepStateError(f"{what}() refused: {held}, and {_WHY_IDLE[what]}; {remedy}")

    def sleep(self, level: int = 1, *, discard_weights: bool = False) -> float:
        """See :meth:`kvrunner.LLM.sleep`."""
        self.executor.check()
        self.state.require_no_open_update("sleep")
        self.state.require_can_sleep(level, discard_weights)
        self._require_idle("sleep")
        with sigint_held():  # the ranks' sleep and its record, or neither
            reports = self.ranks.sleep(level, discard_weights)
            state = self.state
            state.level, state.kv_cache = level, "released"
            if level == 2:
                state.weights = "discarded" if discard_weights else "offloaded"
                state.weights_pending = reports[0].pending
                state.weights_missing = ()  # every tensor: none is named
        seconds = max(r.seconds for r in reports)
        t = self.timings
        t.sleep_level, t.sleep_s = level, seconds
        t.freed_bytes, t.sleeps = reports[0].freed_bytes, t.sleeps + 1
        kept = [f"rank {rank}: {r.kept}" for rank, r in enumerate(reports) if r.kept]
        if kept:  # the engine is asleep all the same: wake_up() allocates new pools
            raise BackendError("; ".join(kept) if len(reports) > 1 else reports[0].kept)
        return seconds

    def wake_up(self, tags: Iterable[str] | str | None = None) -> float:
        """See :meth:`kvrunner.LLM.wake_up`."""
        self.executor.check()
        wanted = parse_tags(tags)
        state = self.state
        todo = tuple(t for t in wanted if getattr(state, t) != "resident")
        if not todo:
            return 0.0
        with sigint_held():  # the ranks' wake and its record, or neither
            reports = self.ranks.wake_up(todo)
            if "weights" in todo:
                state.weights = "resident"
            if "kv_cache" in todo:
                state.kv_cache = "resident"
                self.engine.block_manager.reset_prefix_cache()  # the KV it indexed is gone
            if state.awake:
                state.level = 0
        seconds = max(r.seconds for r in reports)
        recapture = max(r.recapture_s for r in reports)
        self.timings.wake_s, self.timings.wakes = seconds, self.timings.wakes + 1
        if recapture:
            self.timings.recapture_s = recapture
        return seconds

    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        check_finite: bool = True,
        weight_version: WeightVersion | None = None,
        reset_prefix_cache: bool = True,
    ) -> int:
        """See :meth:`kvrunner.LLM.update_weights`."""
        self.executor.check()
        self.state.require_no_open_update("update_weights")
        self.state.require_weights_resident("update_weights")
        self._require_idle("update_weights", parked_ok=True)
        pairs = checked_pairs(weights, check_finite=check_finite)  # a list: checked whole
        with self._weight_change(weight_version, reset_prefix_cache):
            return self._load_pairs(pairs)

    def update_weights_from_tensor(
        self, serialized: list[str | bytes], load_format: str | None, *,
        check_finite: bool = True, weight_version: WeightVersion | None = None,
        reset_prefix_cache: bool = True,
    ) -> int:
        """See :meth:`kvrunner.LLM.update_weights_from_tensor`."""
        from kvrunner.weight_sync.tensor_payload import check_entries_agree, check_entry_count

        self.executor.check()
        self.state.require_no_open_update("update_weights_from_tensor")
        self.state.require_weights_resident("update_weights_from_tensor")
        self._require_idle("update_weights", parked_ok=True)
        check_entry_count(len(serialized), self.config.parallel.tensor_parallel_size)
        with self._weight_change(weight_version, reset_prefix_cache):
            # every rank opens and judges its own entry before any rank loads
            try:
                check_entries_agree(self.ranks.stage_tensor_payload(
                    list(serialized), load_format, check_finite))
            except WeightUpdateError:
                self.ranks.drop_staged_payload()  # the ranks that staged let go
                raise
            return self.ranks.load_staged_payload()[0]

    def update_weights_from_ipc_handles(
        self, update: IpcUpdate, *, check_finite: bool = True,
        weight_version: WeightVersion | None = None, reset_prefix_cache: bool = True,
    ) -> int:
        """See :meth:`kvrunner.LLM.update_weights_from_ipc_handles`."""
        from kvrunner.weight_sync.ipc_handles import read_handles

        def part() -> int:
            read_handles(update)  # the payload whole, once, before any rank is asked
            # every rank opens and judges its own GPU's handles before any rank loads
            try:
                self.ranks.stage_ipc_handles(update, check_finite)
            except WeightUpdateError:
                self.ranks.drop_staged_payload()  # the ranks that staged let go
                raise
            return self.ranks.load_staged_payload()[0]

        return self.in_update("update_weights_from_ipc_handles", part,
                              weight_version=weight_version,
                              reset_prefix_cache=reset_prefix_cache)

    @contextlib.contextmanager
    def push_session(
        self, what: str, *,
        weight_version: WeightVersion | None | Callable[[], WeightVersion | None] = None,
        reset_prefix_cache: bool = True,
    ) -> Iterator[Callable[[Iterable[tuple[str, torch.Tensor]]], int]]:
        """One weight update arriving in parts (``kvrunner.weight_sync``'s buckets):
        checked as :meth:`update_weights` is, then yields a function loading one
        part (a list: its values already checked, no finiteness pass here) and
        returning how many tensors it loaded. Each part's names and shapes are judged
        whole before any of it loads, so a refused part loads nothing; but the parts
        count as one push, so a failure in a later part, or in the caller between
        parts, leaves the weights ``"partial"`` (the earlier parts loaded) until a full
        push, and the error says so; the end records ``weight_version``, resets the
        prefix cache (unless ``reset_prefix_cache`` is false) and recaptures.
        When a part's call returns, every rank has copied it (in process: the copies
        are queued on the device; the caller waits for them)."""
        self.executor.check()
        self.state.require_no_open_update(what)
        self.state.require_weights_resident(what)
        self._require_idle(what, parked_ok=True)
        with self._weight_change(weight_version, reset_prefix_cache):
            yield self._load_pairs

    def _load_pairs(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
        if isinstance(pairs, list):  # known up front: every rank judges it before any loads
            self.ranks.check_weights([TensorSpec.of(name, t) for name, t in pairs])
        if self.config.parallel.tensor_parallel_size == 1:
            return self.ranks.update_weights(pairs)[0]
        loaded = 0
        for bucket in weight_buckets(pairs):
            loaded = loaded + self.ranks.update_weights(bucket)[0]
        return loaded

    def load_weights(
        self, path: str | Path, *, check_finite: bool = True,
        weight_version: WeightVersion | None = None, reset_prefix_cache: bool = True,
    ) -> int:
        """See :meth:`kvrunner.LLM.load_weights`."""
        self.executor.check()
        self.state.require_no_open_update("load_weights")
        self.state.require_weights_resident("load_weights")
        self._require_idle("load_weights", parked_ok=True)
        if not Path(path).is_dir():
            raise FileNotFoundError(f"load_weights: {str(path)!r} is not a directory")
        with self._weight_change(weight_version, reset_prefix_cache):
            return self.ranks.load_weights(str(path), check_finite)[0]

    def start_update(self) -> None:
        """Open one weight update that spans calls (vLLM's ``start_weight_update``):
        :meth:`in_update` parts join it and :meth:`finish_update` closes it, as one
        :meth:`push_session`. While it is open nothing generates and no other weight
        change, sleep or second update starts."""
        stack = contextlib.ExitStack()
        # the version is named when the update is finished
        stack.enter_context(self.push_session("start_weight_update",
                                              weight_version=lambda: self._finish_version))
        self._open_update, self._finish_version = stack, None
        self.state.update_open = True

    def in_update(self, what: str, part: Callable[[], int], *,
                  weight_version: WeightVersion | None = None,
                  reset_prefix_cache: bool = True) -> int:
        """Run ``part`` (it loads through the ranks) inside the open update, or, none
        open, as one update by itself (recording ``weight_version``; resetting the
        prefix cache unless ``reset_prefix_cache`` is false). A part that fails closes
        the open update as a failed push (``"partial"`` if anything of it loaded) and
        raises."""
        stack = self._open_update
        if stack is None:
            with self.push_session(what, weight_version=weight_version,
                                   reset_prefix_cache=reset_prefix_cache):
                return part()
        try:
            return part()
        except BaseException as e:
            self._open_update, self.state.update_open = None, False
            stack.__exit__(type(e), e, e.__traceback__)
            raise

    def finish_update(self, weight_version: WeightVersion | None = None) -> None:
        """Close the open update (vLLM's ``finish_weight_update``): the end of a push,
        recording ``weight_version`` (unset: the count of updates), its prefix-cache
        reset and recapture."""
        stack = self._open_update
        if stack is None:
            raise SleepStateError("finish_weight_update: no weight update is open "
                                  "(start_weight_update opens one; a part that failed "
                                  "closed it)")
        self._finish_version = weight_version
        self._open_update, self.state.update_open = None, False
        stack.close()

    @contextlib.contextmanager
    def _weight_change(self, version: WeightVersion | None | Callable[[], WeightVersion | None],
                       reset: bool) -> Iterator[None]:
        """Around one push: the ranks count what it loads; a failure leaves the state
        saying which tensors are still to push; success records ``version`` (unset:
        the count of updates), resets the prefix cache (unless ``reset`` is false:
        then the engine's salting by weight version is what keeps the old KV from
        being reused) and recaptures."""
        self.ranks.begin_weight_update()
        try:
            yield
        except BaseException as e:
            if self._note_failed_push():
                _add_repair(e, self.state.repair_advice())
            raise
        with sigint_held():  # the push's end and its record (no old KV reused), or neither
            finished = self.ranks.finish_weight_update()
            self._note_pending(finished[0])
            self.engine.weights_changed(version() if callable(version) else version)
            if reset:
                self.engine.block_manager.reset_prefix_cache()  # its KV came from old weights
        recapture = max(f.recapture_s for f in finished)
        if recapture:
            self.timings.recapture_s = recapture

    def _note_failed_push(self) -> bool:
        """Record a failed push; returns whether it had loaded anything (the weights
        are then ``"partial"``)."""
        state = self.state
        try:
            report = self.ranks.fail_weight_update()[0]
        except Exception:  # the ranks cannot say (one died): assume the worst
            state.weights_partial = True
            return False
        # a refusal before anything loaded leaves the weights (and the state) as they were
        state.weights_partial = state.weights_partial or report.partial
        self._note_pending(report)
        if report.partial:
            self.engine.block_manager.reset_prefix_cache()
        return report.partial

    def _note_pending(self, report: PushReport) -> None:
        state = self.state
        state.weights_pending, state.weights_missing = report.pending, report.missing
        if not state.weights_pending:
            state.weights_partial = False

    def reset_prefix_cache(self) -> int:
        """See :meth:`kvrunner.LLM.reset_prefix_cache`."""
        self._require_idle("reset_prefix_cache", parked_ok=True)
        with sigint_held():  # the index whole or empty
            return self.engine.block_manager.reset_prefix_cache()

    def recapture(self) -> float:
        """See :meth:`kvrunner.LLM.recapture`."""
        self.state.require_weights_resident("recapture")
        self.state.require_kv_resident("recapture")
        with sigint_held():  # every graph captured and blanked, as a wake leaves them
            seconds = self.executor.capture()
        self.timings.recapture_s = seconds
        return seconds

    def cache_info(self) -> CacheInfo:
        """See :meth:`kvrunner.LLM.cache_info`."""
        ranks = tuple(self.ranks.cache_info())
        manager = self.engine.block_manager
        t = self.timings
        return CacheInfo(
            num_blocks=manager.num_blocks,
            block_size=self.config.cache.block_size,
            num_state_slots=manager.num_state_slots,
            prefix_cached_blocks=manager.pool.num_cached,
            weights=self.state.weights_status,
            kv_cache=self.state.kv_cache,
            ranks=ranks,
            last_sleep_level=t.sleep_level,
            last_sleep_s=t.sleep_s,
            last_wake_s=t.wake_s,
            last_recapture_s=t.recapture_s,
            last_freed_bytes=t.freed_bytes,
            num_sleeps=t.sleeps,
            num_wakes=t.wakes,
            nonfinite_rows=self.engine.scheduler.nonfinite_rows,
            prefix_hit_tokens=manager.prefix_hit_tokens,
            num_free_blocks=manager.num_free_blocks,
            num_free_state_slots=manager.num_free_state_slots,
        )


def _add_repair(error: BaseException, advice: str) -> None:
    """Append ``advice`` (how to repair partial weights) to a refusal's message, keeping
    its type: its callers catch it by type, the user reads the message."""
    if not (isinstance(error, KvrunnerError) and len(error.args) == 1
            and isinstance(error.args[0], str)):
        return
    if isinstance(error, CheckpointError):
        error.problem = f"{error.problem}; {advice}"
    error.args = (f"{error.args[0]}; {advice}",)
