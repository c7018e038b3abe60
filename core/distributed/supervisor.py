"""Spawned rank processes and their control channels, watched by the driver.

Each rank is a ``spawn``-ed process with one duplex pipe to the driver: commands go
down it, replies (``("ok", payload)``) and failure reports (``("error",
RankFailure)``) come back. While the driver waits for replies it also waits on
every process's sentinel, so a rank that dies without a word is noticed at once,
and every wait has a deadline, so a rank that hangs is noticed in bounded time.

Each rank also beats a heartbeat into the store the group met through
(:mod:`~kvrunner.distributed.heartbeat`); while the driver waits it checks them, so a
rank that is stopped or frozen is named within ``heartbeat_timeout_s``, however long
the collectives may take.

On the first failure the driver keeps listening for a short grace period, to hear
the other ranks' reports too (and so tell the cause from its consequences), then
terminates every rank and raises one :class:`WorkerError`. The processes are also
stopped when the supervisor is garbage-collected or the interpreter exits.

Replies are matched to what asked for them by :class:`Ticket`: each rank answers the
commands that want an answer in the order they were sent, so the driver counts
them, and a reply whose asker has gone (its wait was interrupted) is dropped when a
later one is wanted, never taken for it.

Ctrl-C: a command reaches every rank or none (the interrupt is held until the last
send), so no rank is left alone in a collective. An interrupt while replies are
awaited leaves the group serving: the unread replies are dropped as they arrive.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import connection
from typing import Any

import torch.multiprocessing as mp

from kvrunner.distributed.errors import RankFailure, WorkerError, worker_error
from kvrunner.distributed.heartbeat import HeartbeatMonitor
from kvrunner.held_sigint import children_born_without_sigint, sigint_held

#: seconds to keep collecting other ranks' reports after the first failure
FAILURE_GRACE_S = 2.0
#: seconds a rank gets to exit after "stop" before it is terminated
STOP_GRACE_S = 10.0

STOP = ("stop",)

#: per rank, the position of the reply a command will get among that rank's replies
Ticket = dict[int, int]


def _stop_processes(procs: list, conns: list, grace_s: float) -> None:
    """Ask every live rank to stop, then terminate and kill what is left."""
    if grace_s > 0:
        payload = pickle.dumps(STOP)
        for proc, conn in zip(procs, conns, strict=True):
            if proc.is_alive():
                with contextlib.suppress(OSError, ValueError):  # pipe broken or closed
                    conn.send_bytes(payload)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            with contextlib.suppress(OSError):  # a stopped rank takes SIGTERM once continued
                os.kill(proc.pid, signal.SIGCONT)
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for conn in conns:
        conn.close()


class WorkerProcesses:
    """One spawned process per rank running ``target(rank, conn, *args)``.

    Each rank's first reply (position 0: :attr:`startup_ticket`) is the one it sends
    once started, unasked; every later reply answers a command, in the order sent.
    """

    def __init__(
        self,
        target: Callable[..., None],
        *,
        world_size: int,
        args: tuple[Any, ...],
        name: str = "kvrunner-rank",
        heartbeats: HeartbeatMonitor | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.failure: WorkerError | None = None
        self.heartbeats = heartbeats
        self._procs: list = []
        self._conns: list = []
        self._eof: set[int] = set()  # ranks whose pipe reached end-of-file
        #: per rank: replies asked for so far (the start-up report is the first)
        self._asked = [1] * world_size
        #: per rank: replies read so far, and those read but not yet taken
        self._received = [0] * world_size
        self._inbox: list[dict[int, Any]] = [{} for _ in range(world_size)]
        #: per rank: replies before this position are stale (their asker is gone)
        self._floor = [0] * world_size
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=target, args=(rank, child, *args), name=f"{name}{rank}", daemon=True
            )
            with children_born_without_sigint():  # the driver alone answers Ctrl-C
                proc.start()
            child.close()  # the driver keeps only its end: EOF then means the rank is gone
            self._procs.append(proc)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(
            self, _stop_processes, self._procs, self._conns, STOP_GRACE_S
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def startup_ticket(self) -> Ticket:
        """The report every rank sends once started."""
        return dict.fromkeys(range(self.world_size), 0)

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self._procs]

    def check_usable(self) -> None:
        """Raise WorkerError if the group failed earlier or was shut down."""
        if self.failure is not None:
            raise WorkerError(
                f"the tensor-parallel group has already failed and is shut down:\n{self.failure}",
                rank=self.failure.rank,
                failures=self.failure.failures,
            )
        if not self._finalizer.alive:
            raise WorkerError("the tensor-parallel group is shut down", rank=None)

    def watch(self, *, during: str) -> None:
        """Between commands: raise :class:`WorkerError` (and stop the group) if a rank
        has died, reported a failure or stopped beating since it was last heard;
        returns at once otherwise. Replies that arrived are kept for their askers."""
        self.check_usable()
        failures: list[RankFailure] = []
        if self.heartbeats is not None:
            failures += self._stopped_heartbeats()
        if not failures:
            self._wait_round(0.0, failures)
        if failures:
            self._fail(failures, during=during)

    def send_all(
        self, message: Any, *, during: str, replies_from: Sequence[int] = ()
    ) -> Ticket:
        """Send ``message`` to every rank (pickled once), all or none under Ctrl-C.

        :param replies_from: the ranks that will answer it (each answers the commands
            that want an answer in the order they were sent).
        :returns: what :meth:`collect` takes to get those answers.
        """
        self.check_usable()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with sigint_held():  # a rank given a step its peers never get hangs in it
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(payload)
                except OSError:  # the rank is gone: find out what it said, if anything
                    failures: list[RankFailure] = []
                    self._read(rank, failures)
                    if not failures:
                        failures.append(self._death_report(rank))
                    self._fail(failures, during=during)
            ticket = {r: self._asked[r] for r in replies_from}
            for r in replies_from:
                self._asked[r] += 1
        return ticket

    def collect(self, ticket: Ticket, *, during: str, timeout_s: float) -> dict[int, Any]:
        """The replies ``ticket`` names, by rank; raises WorkerError on any rank's
        failure report, death, silence past ``timeout_s`` or a heartbeat that stopped.

        Replies still unread from before the ticket's (their wait was interrupted)
        are dropped. An interrupt here leaves the group serving.
        """
        self.check_usable()
        for rank, position in ticket.items():
            self._floor[rank] = max(self._floor[rank], position)
        replies: dict[int, Any] = {}
        self._wait(lambda: self._take(ticket, replies), during=during, timeout_s=timeout_s)
        return replies

    def settle(self, *, during: str, timeout_s: float) -> None:
        """Wait for every reply asked for so far and drop the ones not taken (after an
        interrupted call), so each rank has finished every command sent to it."""
        self.check_usable()
        for rank in range(self.world_size):
            self._floor[rank] = self._asked[rank]

        def settled() -> set[int]:
            for inbox in self._inbox:
                inbox.clear()
            return {r for r in range(self.world_size) if self._received[r] < self._asked[r]}

        self._wait(settled, during=during, timeout_s=timeout_s)

    def _take(self, ticket: Ticket, replies: dict[int, Any]) -> set[int]:
        """Move the ticket's replies that have arrived into ``replies``; the ranks
        still to answer."""
        for rank, position in ticket.items():
            inbox = self._inbox[rank]
            if rank not in replies and position in inbox:
                replies[rank] = inbox.pop(position)
        return set(ticket) - set(replies)

    def _wait(self, outstanding: Callable[[], set[int]], *, during: str,
              timeout_s: float) -> None:
        """Read until ``outstanding()`` is empty; a failure, a death, silence past
        ``timeout_s`` or a stopped heartbeat raises (and stops the group)."""
        failures: list[RankFailure] = []
        deadline = time.monotonic() + timeout_s
        while (waiting := outstanding()) and not failures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                what = f"no answer within {timeout_s:.0f} s"
                failures += [self._silence_report(r, what) for r in sorted(waiting)]
                break
            if self.heartbeats is not None:
                failures += self._stopped_heartbeats()
                if failures:
                    break
                remaining = min(remaining, self.heartbeats.poll_s)
            self._wait_round(remaining, failures)
        if failures:
            self._fail(failures, during=during)

    def _stopped_heartbeats(self) -> list[RankFailure]:
        assert self.heartbeats is not None
        live = [r for r, p in enumerate(self._procs) if p.is_alive()]
        return [
            RankFailure(
                rank=rank, exc_type="HeartbeatTimeout",
                message=f"no heartbeat for {silent_s:.1f} s (heartbeat_timeout_s="
                f"{self.heartbeats.timeout_s:g}); the process is alive but not running "
                f"(stopped, frozen or starved?)",
                traceback="", at=time.time(),
            )
            for rank, silent_s in self.heartbeats.silent(live)
        ]

    def _wait_round(self, timeout: float, failures: list) -> None:
        """Wait once for any pipe or sentinel, then read what is ready."""
        conns = {id(c): r for r, c in enumerate(self._conns) if r not in self._eof}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        live = [c for c in self._conns if id(c) in conns]
        ready = connection.wait([*live, *sentinels], timeout=timeout)
        dead = []
        for obj in ready:
            if isinstance(obj, int):
                dead.append(sentinels[obj])
            else:
                self._read(conns[id(obj)], failures)
        for rank in dead:
            # A report sent just before exiting is still in the pipe: read it first.
            self._read(rank, failures)
            if not any(f.rank == rank for f in failures):
                failures.append(self._death_report(rank))

    def _read(self, rank: int, failures: list) -> None:
        """Read everything ``rank`` has sent: replies into its inbox (unless stale),
        failure reports into ``failures``."""
        if rank in self._eof:
            return
        conn = self._conns[rank]
        try:
            with sigint_held():  # a reply read off the pipe must reach the inbox
                while conn.poll():
                    kind, payload = pickle.loads(conn.recv_bytes())
                    if kind == "error":
                        failures.append(payload)
                        continue
                    position = self._received[rank]
                    self._received[rank] += 1
                    if position >= self._floor[rank]:
                        self._inbox[rank][position] = payload
        except (EOFError, OSError):
            self._eof.add(rank)  # the process is exiting; its sentinel will say so

    def _hear_the_rest(self, failures: list[RankFailure]) -> None:
        """After a first failure, give the other live ranks a moment to report theirs."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while True:
            reported = {f.rank for f in failures}
            pending = [
                r for r, p in enumerate(self._procs) if r not in reported and p.is_alive()
            ]
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                return
            self._wait_round(remaining, failures)

    def _death_report(self, rank: int) -> RankFailure:
        proc = self._procs[rank]
        proc.join(0.5)
        return RankFailure(
            rank=rank,
            exc_type="ProcessDied",
            message=f"process {proc.pid} exited with code {proc.exitcode} without reporting "
            f"an error (killed, crashed, or out of memory?)",
            traceback="",
            at=time.time(),
        )

    def _silence_report(self, rank: int, what: str) -> RankFailure:
        alive = "still running (hung?)" if self._procs[rank].is_alive() else "exited"
        return RankFailure(
            rank=rank,
            exc_type="TimeoutError",
            message=f"{what}; the process is {alive}",
            traceback="",
            at=time.time(),
        )

    def _fail(self, failures: list[RankFailure], *, during: str) -> None:
        """Hear the other ranks out, stop them all, raise one error naming the cause."""
        self._hear_the_rest(failures)
        if all(f.is_consequence for f in failures):
            # Everyone who spoke was only left waiting: the cause is a rank that is
            # still alive but silent (hung), so name it.
            reported = {f.rank for f in failures}
            failures += [
                self._silence_report(r, "no report while its peers' collectives failed")
                for r, p in enumerate(self._procs)
                if r not in reported and p.is_alive()
            ]
        error = worker_error(failures, during=during)
        self.failure = error
        self._finalizer.detach()
        _stop_processes(self._procs, self._conns, grace_s=0.0)
        raise error

    def shutdown(self) -> None:
        """Stop every rank (idempotent): ask nicely, then terminate, then kill."""
        self._finalizer()
