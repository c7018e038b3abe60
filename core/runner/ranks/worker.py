"""A tensor-parallel rank: one :class:`ModelRunner` serving the driver's commands.

Commands are tuples, the same whichever channel carries them (a pipe from a
spawned driver, or a broadcast from rank 0 under torchrun):

- ``("step", StepInput)``: run one step. Every rank runs the forward and the LM
  head; rank 0 alone samples and answers (see :meth:`RankWorker.step`).
- ``("answer",)``: rank 0 answers the step it holds, if any (see below); others
  ignore it.
- ``("call", name, args)``: run one of :data:`CALLS` on every rank; every rank
  answers.

A spawned rank 0 with asynchronous steps (``defer_answers``) answers a step only
after it has launched the next one (or on ``("answer",)``, or before a call's
answer): the driver sends step N+1 before it reads step N's tokens, so rank 0
prepares N+1 while its device still computes N, and answers are still one per
step, in the order of the commands.
- ``("stop",)``: leave the group and exit.

A spawned rank that raises — at start-up or in any command — sends a
:class:`RankFailure` to the driver before it exits, so the driver can name it. A
call that fails but leaves the rank consistent (a refused wake, a bad weight name)
is answered with a :class:`~kvrunner.runner.ranks.rank_calls.Refused` instead, and the rank
keeps serving.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

import attrs
import torch
from tqdm import tqdm

from kvrunner import process_heap
from kvrunner.config import EngineConfig
from kvrunner.distributed.errors import RankFailure
from kvrunner.distributed.fault_injection import FaultPlan
from kvrunner.distributed.group import DistGroup, connect_store
from kvrunner.distributed.heartbeat import HeartbeatSender
from kvrunner.engine.step_io import PackedSampled, StepInput, no_samples
from kvrunner.runner.model_runner import ModelRunner
from kvrunner.runner.ranks.rank_calls import CALLS, RECOVERABLE, RankCalls, Refused
from kvrunner.runner.setup import resolve_device
from kvrunner.runner.step.launched_step import LaunchedStep

#: returned by RankWorker.handle when the command wants no answer from this rank
NO_REPLY = object()


def rank_device(name: str, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` on its host: ``cuda:<local_rank>``
    on CUDA (an index in ``name`` is ignored: each rank gets its own card), else CPU."""
    device = resolve_device(name)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


class RankWorker:
    """This rank's runner and the commands it serves: steps here, the calls between
    steps through its :class:`~kvrunner.runner.ranks.rank_calls.RankCalls` (``calls``)."""

    def __init__(
        self,
        config: EngineConfig,
        group: DistGroup,
        *,
        progress: bool = False,
        faults: FaultPlan | None = None,
        defer_answers: bool = False,
    ) -> None:
        self.rank = group.rank
        self.defer_answers = defer_answers and self.rank == 0
        #: with deferred answers, the launched step whose answer is still to send
        self._held: LaunchedStep | None = None
        self.group = group
        device = group.device
        config = attrs.evolve(config, device=str(device))
        if faults is not None:  # the only place the test hooks reach (see fault_injection)
            config = faults.config_for(self.rank, config)
            faults.before_load(self.rank)
        runner = ModelRunner(config, progress=progress and self.rank == 0, group=group)
        if faults is not None:
            runner.sleep_wake.wake_pressure = faults.wake_pressure_for(self.rank)
        self.runner = faults.wrap(self.rank, runner) if faults is not None else runner
        self.last_sampled: PackedSampled = no_samples()
        self.calls = RankCalls(self.runner, self.rank, describe_extra=self._last_sampled)

    def step(self, step: StepInput) -> PackedSampled:
        """Run one step on this rank; the sampled tokens (as columns) on rank 0, none
        elsewhere.

        Every rank runs the forward and joins the LM head's all-gather; only rank 0
        samples. Nothing sampled has to reach the other ranks: the engine puts the
        tokens to feed into the next step it sends to all of them.
        """
        self.last_sampled = self.runner.execute(step)
        return self.last_sampled

    def launch(self, step: StepInput) -> LaunchedStep:
        """:meth:`step` up to its samples, which stay on the device (torchrun's rank 0
        schedules the next step meanwhile); :meth:`finish` reads them."""
        return self.runner.launch(step)

    def finish(self, launched: LaunchedStep) -> PackedSampled:
        """The tokens of a step :meth:`launch` started."""
        self.last_sampled = launched.result()
        return self.last_sampled

    def _last_sampled(self) -> dict[str, Any]:
        """What ``describe`` adds: this rank's last sampled ``(seq_id, token_id)``."""
        seq_ids, token_ids = self.last_sampled[:2]
        return {"last_sampled": list(zip(seq_ids, token_ids, strict=True))}

    def describe(self) -> dict[str, Any]:
        return self.calls.describe()

    def flush_held(self) -> Any:
        """The answer of the step held back (deferred answers), or :data:`NO_REPLY`."""
        held, self._held = self._held, None
        return self.finish(held) if held is not None else NO_REPLY

    def handle(self, command: tuple) -> Any:
        """Run one command; its answer, or :data:`NO_REPLY`."""
        kind = command[0]
        if kind == "step" and self.defer_answers:
            launched = self.launch(command[1])  # queued behind the step held, if any
            held, self._held = self._held, launched
            return self.finish(held) if held is not None else NO_REPLY
        if kind == "step":
            tokens = self.step(command[1])
            return tokens if self.rank == 0 else NO_REPLY
        if kind == "answer":
            return self.flush_held()
        if kind == "call":
            name, args = command[1], command[2]
            if name not in CALLS:
                raise ValueError(f"unknown worker call {name!r}; known: {sorted(CALLS)}")
            try:
                return getattr(self.calls, name)(*args)
            except RECOVERABLE as e:  # this rank is still consistent: answer, do not die
                return Refused(e)
        raise ValueError(f"unknown worker command {command!r}")


@attrs.frozen(kw_only=True)
class SpawnSpec:
    """What a spawned rank needs to start (picklable)."""

    config: EngineConfig
    store_host: str
    store_port: int
    progress: bool = False


def _send(conn: Connection, kind: str, payload: Any) -> None:
    conn.send_bytes(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))


def run_spawned_rank(rank: int, conn: Connection, spec: SpawnSpec) -> None:
    """Entry point of a rank process spawned by the driver (MultiprocExecutor)."""
    # Ctrl-C reaches every process of the terminal's group; the driver alone handles it
    # (by stopping the ranks), so a rank never dies half-way and leaks what it holds.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # tqdm's default lock is a named multiprocessing semaphore; a rank that ends by
    # os._exit (below) or is terminated never unlinks it, and the driver's resource
    # tracker then warns of a leak. One bar in one process needs only a thread lock.
    tqdm.set_lock(threading.RLock())
    parallel = spec.config.parallel
    world = parallel.tensor_parallel_size
    group: DistGroup | None = None
    heartbeat: HeartbeatSender | None = None
    try:
        device = rank_device(spec.config.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            # Every rank shares this host: split its cores, and keep gloo on loopback
            # (otherwise it binds to whatever the host name resolves to).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = connect_store(
            spec.store_host, spec.store_port, timeout_s=parallel.distributed_timeout_s,
            is_master=False,
        )
        # Its own store client: the beats never queue behind the group's store traffic.
        heartbeat = HeartbeatSender(
            connect_store(spec.store_host, spec.store_port,
                          timeout_s=parallel.distributed_timeout_s, is_master=False),
            rank=rank, timeout_s=parallel.heartbeat_timeout_s,
        )
        group = DistGroup.init(
            rank=rank, size=world, device=device, backend=parallel.distributed_backend,
            timeout_s=parallel.distributed_timeout_s, store=store,
        )
        worker = RankWorker(
            spec.config, group, progress=spec.progress, faults=FaultPlan.from_env(),
            defer_answers=spec.config.scheduler.async_scheduling,
        )
        _send(conn, "ok", worker.describe())
        process_heap.freeze_started_heap()  # the rank is up: see process_heap
        while True:
            try:
                command = pickle.loads(conn.recv_bytes())
            except EOFError:  # the driver is gone: nobody is left to serve
                break
            if command[0] == "stop":
                break
            if command[0] == "call":  # a held step's answer comes first: replies keep order
                held = worker.flush_held()
                if held is not NO_REPLY:
                    _send(conn, "ok", held)
            reply = worker.handle(command)
            if reply is not NO_REPLY:
                _send(conn, "ok", reply)
    except BaseException as e:  # noqa: BLE001 - report anything, then exit non-zero
        with contextlib.suppress(OSError):
            _send(conn, "error", RankFailure.from_exception(rank, e))
        # Skip the group's orderly teardown: peers may be stuck in a collective with
        # us, and exiting (which closes our sockets) is what releases them.
        os._exit(1)
    if heartbeat is not None:
        heartbeat.stop()
    if group is not None:
        group.destroy()
