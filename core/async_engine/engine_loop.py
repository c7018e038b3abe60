"""The engine thread: the one thread that touches an ``LLM`` behind ``AsyncLLM``.

Every call from the asyncio side is a command (a function run on this thread) put
on a thread-safe queue; its result goes back as the settling of an asyncio future
(``handoff.Reply``). The thread steps the engine while any request can make
progress and, between steps, runs the commands that arrived; with nothing to step
it blocks on the queue (no polling).

Rules for the calls that change what the engine serves (each checked here, on
this thread, between steps, so nothing is in flight while one runs):

- ``sleep`` refuses (``EngineBusyError``) while any request is in the engine,
  running, waiting or parked: their KV would be freed. Abort or drain them first
  (``pause("abort")``, ``pause("wait")``, ``wait_for_requests_to_drain``).
  Requests submitted while paused are only held (nothing of theirs is on the
  device) and do not count.
- ``update_weights``, ``load_weights`` and ``reset_prefix_cache`` refuse while
  requests are running; under a pause they are allowed, also with requests parked
  by ``pause("keep")``: a parked request keeps its blocks and state slot (the
  engine was settled: no step is in flight) and continues on the new weights from
  its next token. A weight change records the new version on every live request.
- ``wake_up`` and ``cache_info`` are allowed at any time.
- ``resume`` with requests parked or held refuses (``SleepStateError``) while the
  engine cannot serve (asleep, or weights missing), and stays paused.

A dead engine stays dead: a step whose executor is unusable afterwards (a rank
died or failed), a rank found lost while the thread waits (``executor.watch()``
every ``WATCH_S``), or the thread failing, sets :attr:`EngineLoop.dead`; every live
request and waiter gets that ``EngineDeadError`` (the requests of the failed step
get its cause), the thread stops, and every later command is refused with it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from kvrunner.async_engine.errors import EngineBusyError, EngineClosedError, EngineDeadError
from kvrunner.async_engine.handoff import Channel, Outbox, Reply
from kvrunner.async_engine.live_request import LiveRequest
from kvrunner.async_engine.stats import EngineStats
from kvrunner.engine.sequence import Sequence, SequenceStatus
from kvrunner.errors import RequestError
from kvrunner.prompts import prompt_token_ids
from kvrunner.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvrunner.llm import LLM

#: a command's return value meaning "I keep the reply and settle it later"
LATER = object()
#: seconds between two looks at the ranks while the engine thread has nothing to do
#: (a rank that dies mid-step is found by the step itself)
WATCH_S = 0.5

Command = Callable[[Reply], Any]


class EngineLoop:
    """Owns an ``LLM`` on a dedicated thread; see the module docstring for the rules.

    :param owns_llm: ``shutdown`` also shuts the ``LLM`` down (else the caller keeps
        it, idle, usable synchronously again).
    """

    def __init__(self, llm: LLM, *, owns_llm: bool) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.owns_llm = owns_llm
        self._commands: queue.SimpleQueue[tuple[Command, Reply]] = queue.SimpleQueue()
        # closing and submitting agree under this lock, so no command is left unrun
        self._gate = threading.Lock()
        self._closed = False
        self._running = True
        #: set once the engine can serve nothing more (see EngineDeadError)
        self.dead: EngineDeadError | None = None
        self._live: dict[str, LiveRequest] = {}
        self._by_seq: dict[int, LiveRequest] = {}
        self._streams: dict[str, LiveRequest] = {}
        #: submitted while paused, not yet handed to the engine (no KV of theirs exists)
        self._held: deque[LiveRequest] = deque()
        self.paused = False
        self.pause_mode: str | None = None
        self._pause_waiters: list[Reply] = []
        self._drain_waiters: list[Reply] = []
        self._done_tokens = 0
        self._prompt_tokens = 0
        self._num_aborted = 0
        self._num_steps = 0
        self._last_step_s = 0.0
        self._outbox = Outbox()
        self.stats = EngineStats()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="kvrunner-engine", daemon=True)
        self._thread.start()

    # -- the asyncio side's entry points (any thread) -----------------------------------

    def submit(self, command: Command, reply: Reply) -> None:
        """Queue ``command`` for the engine thread; ``EngineClosedError`` after close."""
        with self._gate:
            if self._closed:
                raise self.dead or EngineClosedError("the AsyncLLM was shut down")
            self._commands.put((command, reply))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._running:
                if self._can_step():
                    self._run_commands(block=False)
                    if self._running and self._can_step():
                        self._step()
                else:
                    self._run_commands(block=True)
                self._after_progress()
        except BaseException as error:  # noqa: BLE001 - the thread itself failed
            self._die(error)
        finally:
            with self._gate:
                self._closed = True
            if self.dead is not None and self.owns_llm:
                with contextlib.suppress(Exception):  # dying already: nothing to add
                    self.llm.shutdown()
            # Whatever arrived after the stop command is refused, not left hanging.
            while True:
                try:
                    _, reply = self._commands.get_nowait()
                except queue.Empty:
                    break
                reply.fail(self.dead or EngineClosedError("the AsyncLLM was shut down"))

    def _can_step(self) -> bool:
        engine = self.engine
        if engine.parked or not engine.has_unfinished():
            return False
        return not self.paused or self.pause_mode == "wait"

    def _run_commands(self, *, block: bool) -> None:
        try:
            item = self._commands.get(timeout=WATCH_S) if block else self._commands.get_nowait()
        except queue.Empty:
            if block:
                self._watch()
            return
        while True:
            command, reply = item
            try:
                result = command(reply)
            except BaseException as error:  # noqa: BLE001 - it goes to the caller
                self._publish()
                self._outbox.flush()
                reply.fail(error)
            else:
                # The caller sees the stats after its command, and the deltas it made (an
                # abort's final one) arrive before its reply.
                self._publish()
                self._outbox.flush()
                if result is not LATER:
                    reply.ok(result)
            if not self._running:
                return
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception as error:  # noqa: BLE001 - every request in the engine hears it
            self._fail_engine(error)
            try:
                self.llm.executor.check()
            except Exception:  # noqa: BLE001 - the ranks are gone: nothing can step again
                self._die(error)
            return
        self._last_step_s = time.perf_counter() - start
        self._num_steps += 1
        self._finish_seqs(finished)
        tokenizer = self.llm.tokenizer
        for live in self._streams.values():
            delta = live.delta(tokenizer)
            if delta is not None:
                self._outbox.put(live.channel, delta)

    def _after_progress(self) -> None:
        """After a step or a batch of commands: publish the stats, post the deltas,
        then answer who waited for the engine (or every request) to be done."""
        self._publish()  # first: a caller told its request ended sees the stats after it
        self._outbox.flush()  # and the deltas before the replies to who waited on them
        if not self.engine.has_unfinished():
            waiters, self._pause_waiters = self._pause_waiters, []
            for reply in waiters:
                reply.ok(None)
            if not self._live:
                drained, self._drain_waiters = self._drain_waiters, []
                for reply in drained:
                    reply.ok(None)

    # -- requests --------------------------------------------------------------------------

    def add(
        self, request_ids: list[str], prompt: Any, params: SamplingParams,
        channels: list[Channel], stream: bool, cache_salt: str | None = None,
    ) -> Command:
        """The command that checks and queues the samples of one request (the engine's
        group: ``LLMEngine.make_group``, every sample with ``cache_salt``),
        ``request_ids[k]`` and ``channels[k]`` for sample ``k``, held while paused.
        Nothing is queued unless every sample passes."""

        def command(_reply: Reply) -> None:
            for request_id in request_ids:
                if request_id in self._live:
                    raise RequestError(
                        f"request {request_id!r}: a request with this id is live"
                    )
            self.llm.executor.check()
            if not self.paused:
                self.llm.sleep_state.require_servable("generate")
            name = request_ids[0]  # RequestError messages name the request by it
            ids = prompt_token_ids(prompt, name, self.llm.tokenizer)
            seqs = self.engine.make_group(ids, params, name, cache_salt=cache_salt)
            if len(seqs) != len(request_ids):
                raise RequestError(
                    f"request {name!r}: {len(request_ids)} request id(s) for a group of "
                    f"{len(seqs)} sample(s) (SamplingParams.n={params.n})"
                )
            for request_id, seq, channel in zip(request_ids, seqs, channels, strict=True):
                live = LiveRequest(request_id, prompt, seq, channel, stream,
                                   versions=[(self.engine.weight_version, 0)])  # fmt: skip
                self._live[request_id] = live
                self._by_seq[seq.seq_id] = live
                if stream:
                    self._streams[request_id] = live
                if self.paused:
                    self._held.append(live)
                else:
                    self._to_engine(live)

        return command

    def _to_engine(self, live: LiveRequest) -> None:
        self.engine.add_request(live.seq)
        self._prompt_tokens += live.seq.num_prompt_tokens

    def abort(self, request_id: str, channel: Channel | None = None) -> Command:
        """The command that withdraws one request: True if it was live (and, given
        ``channel``, only the request whose deltas go there)."""

        def command(_reply: Reply) -> bool:
            live = self._live.get(request_id)
            if live is None or (channel is not None and live.channel is not channel):
                return False
            self._abort(live)
            return True

        return command

    def abort_all(self) -> Command:
        def command(_reply: Reply) -> int:
            return self._abort_every()

        return command

    def _abort_every(self) -> int:
        lives = list(self._live.values())
        for live in lives:
            self._abort(live)
        return len(lives)

    def _abort(self, live: LiveRequest) -> None:
        seq = live.seq
        if seq.status is SequenceStatus.WAITING and live in self._held:
            self._held.remove(live)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        else:
            # Safe with a step in flight: its update skips the sequence, and the blocks
            # it frees are handed out only by a later schedule().
            self.engine.abort_request(seq.seq_id)
        self._finish(live)

    def _finish_seqs(self, finished: list[Sequence]) -> None:
        for seq in finished:
            live = self._by_seq.get(seq.seq_id)
            if live is not None:
                self._finish(live)

    def _finish(self, live: LiveRequest) -> None:
        del self._live[live.request_id]
        del self._by_seq[live.seq.seq_id]
        self._streams.pop(live.request_id, None)
        self._done_tokens += live.num_output_tokens
        if live.seq.finish_reason == "abort":
            self._num_aborted += 1
        spans = live.spans()
        output = self.llm._output(live.prompt, live.seq)
        output = attrs.evolve(output, request_id=live.request_id,
                              weight_version=spans[-1][0], weight_versions=spans)  # fmt: skip
        self._outbox.put(live.channel, live.final(output))

    def _fail_engine(self, error: BaseException) -> None:
        """A step raised: requests it ended end as it said; every other one in the
        engine fails with the error, and the engine is emptied for what comes next."""
        try:
            self.engine.abort_all()
            self.engine.settle()
        except Exception:  # noqa: BLE001 - the step in flight failed too: it is dropped
            pass
        self.engine.unpark()
        for live in list(self._live.values()):
            if live in self._held:
                continue
            if live.seq.finish_reason is not None and live.seq.finish_reason != "abort":
                self._finish(live)  # ended by the step itself (e.g. "error")
                continue
            del self._live[live.request_id]
            del self._by_seq[live.seq.seq_id]
            self._streams.pop(live.request_id, None)
            self._outbox.put(live.channel, error)

    def _watch(self) -> None:
        """Idle: have the executor look at its ranks; one lost is the engine's death."""
        try:
            self.llm.executor.watch()
        except Exception as error:  # noqa: BLE001 - a WorkerError naming the rank
            self._die(error)

    def _die(self, cause: BaseException) -> None:
        """The engine can serve nothing more: every live request (held and parked ones
        too) and every waiter fails with :class:`EngineDeadError`, the thread stops
        (releasing the LLM if it owns it: the ranks left are stopped), and later calls
        are refused with the same error."""
        if self.dead is not None:
            return
        summary = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        self.dead = EngineDeadError(f"the engine is dead and serves nothing more: "
                                    f"{summary}")
        self.dead.__cause__ = cause
        for live in list(self._live.values()):
            self._outbox.put(live.channel, self.dead)
        self._live.clear()
        self._by_seq.clear()
        self._streams.clear()
        self._held.clear()
        waiters = self._pause_waiters + self._drain_waiters
        self._pause_waiters, self._drain_waiters = [], []
        self._outbox.flush()
        for reply in waiters:
            reply.fail(self.dead)
        self._running = False

    # -- pause / resume ----------------------------------------------------------------

    def pause(self, mode: str) -> Command:
        if mode not in ("abort", "keep", "retract", "wait"):
            raise RequestError(f"pause mode must be 'abort', 'keep', 'retract' or 'wait'; "
                               f"got {mode!r}")

        def command(reply: Reply) -> Any:
            self.paused, self.pause_mode = True, mode
            if mode == "abort":
                self._abort_every()
                self._finish_seqs(self.engine.settle())
                self.engine.unpark()
                return None
            if mode == "keep":
                self._finish_seqs(self.engine.park())
                return None
            if mode == "retract":
                self._finish_seqs(self.engine.retract())
                return None
            self.engine.unpark()  # "wait" lets parked requests finish too
            if not self.engine.has_unfinished():
                return None
            self._pause_waiters.append(reply)
            return LATER

        return command

    def resume(self) -> Command:
        def command(_reply: Reply) -> None:
            if not self.paused:
                return
            if self._held or self.engine.has_unfinished():
                self.llm.sleep_state.require_servable("resume requests")
            self.paused, self.pause_mode = False, None
            self.engine.unpark()
            held, self._held = self._held, deque()
            for live in held:
                self._to_engine(live)

        return command

    def wait_drained(self) -> Command:
        def command(reply: Reply) -> Any:
            if not self._live:
                return None
            self._drain_waiters.append(reply)
            return LATER

        return command

    # -- what the engine serves ----------------------------------------------------------

    def _require_empty(self, what: str) -> None:
        scheduler = self.engine.scheduler
        n = len(scheduler.running) + len(scheduler.waiting) + self.engine.num_compiling
        if self.engine.has_unfinished():
            raise EngineBusyError(
                f"cannot {what}: {n} request(s) are in the engine (running, waiting or "
                f"parked) and their KV would be lost; abort or drain them first "
                f"(pause('abort'), pause('wait') or wait_for_requests_to_drain())"
            )

    def _require_quiet(self, what: str) -> None:
        if self.engine.has_unfinished() and not self.engine.parked:
            raise EngineBusyError(
                f"cannot {what} while requests are running: pause() first (pause('keep') "
                f"parks them with their KV; they continue after resume())"
            )

    def call(self, what: str, rule: str, fn: Callable[[], Any]) -> Command:
        """A command running ``fn`` on the engine thread under ``rule``: "empty" (no
        request in the engine), "quiet" (none running; parked is fine) or "any"."""

        def command(_reply: Reply) -> Any:
            if rule == "empty":
                self._require_empty(what)
            elif rule == "quiet":
                self._require_quiet(what)
            return fn()

        return command

    def weights_changed(self) -> None:
        """After a completed weight change: the engine's new version
        (``LLMEngine.weight_version``) on every live request."""
        for live in self._live.values():
            live.note_version(self.engine.weight_version)

    def stop(self) -> Command:
        """The last command: abort every request, settle, release the LLM if owned."""

        def command(_reply: Reply) -> None:
            try:
                self._abort_every()
                self._finish_seqs(self.engine.settle())
                self.engine.unpark()
                self._outbox.flush()
                if self.owns_llm:
                    self.llm.shutdown()
            finally:
                self._running = False
                self.paused = False
                self._publish()

        return command

    # -- stats ---------------------------------------------------------------------------

    def _publish(self) -> None:
        scheduler, manager = self.engine.scheduler, self.engine.block_manager
        live_tokens = sum(len(s.token_ids) - s.num_prompt_tokens for s in scheduler.running)
        live_tokens += sum(len(s.token_ids) - s.num_prompt_tokens for s in scheduler.waiting)
        state = self.llm.sleep_state
        asleep = state.asleep_tags()
        self.stats = EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + self.engine.num_compiling + len(self._held),
            blocks_used=manager.num_blocks - manager.num_free_blocks,
            blocks_total=manager.num_blocks,
            state_slots_used=manager.num_state_slots - manager.num_free_state_slots,
            state_slots_total=manager.num_state_slots,
            generated_tokens_total=self._done_tokens + live_tokens,
            prompt_tokens_total=self._prompt_tokens,
            num_steps=self._num_steps,
            last_step_s=self._last_step_s,
            sleep_state="awake" if not asleep else "asleep: " + ", ".join(asleep),
            weight_version=self.engine.weight_version,
            nonfinite_rows=scheduler.nonfinite_rows,
            num_aborted=self._num_aborted,
            paused=self.paused,
            pause_mode=self.pause_mode,
        )
