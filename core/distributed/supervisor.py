"""Spawned rank processes and their control channels, watched by the driver.

Each rank is a ``spawn``-ed process with one duplex pipe to the driver: commands go
down it, replies (``("ok", payload)``) and failure reports (``("error",
RankFailure)``) come back. While the driver waits for replies it also waits on
every process's sentinel, so a rank that dies without a word is noticed at once,
and every wait has a deadline, so a rank that hangs is noticed in bounded time.

On the first failure the driver keeps listening for a short grace period, to hear
the other ranks' reports too (and so tell the cause from its consequences), then
terminates every rank and raises one :class:`WorkerError`. The processes are also
stopped when the supervisor is garbage-collected or the interpreter exits.

Ctrl-C: a command reaches every rank or none (the interrupt is held until the last
send), so no rank is left alone in a collective. An interrupt while replies are
awaited leaves them unread, out of step with the next command: the group is then
stopped and every later call says why.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import connection
from typing import Any

import torch.multiprocessing as mp

from kvrunner.distributed.errors import RankFailure, WorkerError, worker_error

#: seconds to keep collecting other ranks' reports after the first failure
FAILURE_GRACE_S = 2.0
#: seconds a rank gets to exit after "stop" before it is terminated
STOP_GRACE_S = 10.0

STOP = ("stop",)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold a Ctrl-C that lands inside the block, and deliver it when the block ends."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # only the main thread may set handlers; None: not ours to replace
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)  # now reaches the previous handler


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
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for conn in conns:
        conn.close()


class WorkerProcesses:
    """One spawned process per rank running ``target(rank, conn, *args)``."""

    def __init__(
        self,
        target: Callable[..., None],
        *,
        world_size: int,
        args: tuple[Any, ...],
        name: str = "kvrunner-rank",
    ) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.failure: WorkerError | None = None
        self._procs: list = []
        self._conns: list = []
        self._eof: set[int] = set()  # ranks whose pipe reached end-of-file
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=target, args=(rank, child, *args), name=f"{name}{rank}", daemon=True
            )
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

    def send_all(self, message: Any, *, during: str) -> None:
        """Send ``message`` to every rank (pickled once), all or none under Ctrl-C."""
        self.check_usable()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with _sigint_held():  # a rank given a step its peers never get hangs in it
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(payload)
                except OSError:  # the rank is gone: find out what it said, if anything
                    failures: list[RankFailure] = []
                    self._read(rank, {}, set(), failures)
                    if not failures:
                        failures.append(self._death_report(rank))
                    self._fail(failures, during=during)

    def collect(self, ranks: Sequence[int], *, during: str, timeout_s: float) -> dict[int, Any]:
        """One ``("ok", payload)`` from each rank in ``ranks``; raises WorkerError on
        any rank's failure report, death or silence past ``timeout_s``."""
        self.check_usable()
        waiting, replies = set(ranks), {}
        failures: list[RankFailure] = []
        deadline = time.monotonic() + timeout_s
        try:
            while waiting and not failures:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    what = f"no answer within {timeout_s:.0f} s"
                    failures += [self._silence_report(r, what) for r in sorted(waiting)]
                    break
                self._wait_round(remaining, replies, waiting, failures)
        except KeyboardInterrupt:
            self._abandon(during=during)
            raise
        if failures:
            self._fail(failures, during=during)
        return replies

    def _wait_round(self, timeout: float, replies: dict, waiting: set, failures: list) -> None:
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
                self._read(conns[id(obj)], replies, waiting, failures)
        for rank in dead:
            # A report sent just before exiting is still in the pipe: read it first.
            self._read(rank, replies, waiting, failures)
            if not any(f.rank == rank for f in failures):
                failures.append(self._death_report(rank))

    def _read(self, rank: int, replies: dict, waiting: set, failures: list) -> None:
        if rank in self._eof:
            return
        conn = self._conns[rank]
        try:
            while conn.poll():
                kind, payload = pickle.loads(conn.recv_bytes())
                if kind == "error":
                    failures.append(payload)
                elif rank in waiting:
                    replies[rank] = payload
                    waiting.discard(rank)
                    # Leave what follows in the pipe: with asynchronous steps rank 0 may
                    # have answered the next step too, and the next collect wants it.
                    break
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
            self._wait_round(remaining, {}, set(), failures)

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

    def _abandon(self, *, during: str) -> None:
        """Stop the group after an interrupt left replies unread (they would answer
        the next command); later calls raise a WorkerError that says so."""
        self.failure = WorkerError(
            f"interrupted (Ctrl-C) while waiting for the ranks during {during}; their "
            "replies were left unread, so the group was stopped. Create a new LLM.",
            rank=None,
        )
        self._finalizer()  # ask every rank to stop once its current command is done

    def shutdown(self) -> None:
        """Stop every rank (idempotent): ask nicely, then terminate, then kill."""
        self._finalizer()
