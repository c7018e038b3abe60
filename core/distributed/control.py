"""The control channel of an externally launched group (torchrun): rank 0 -> all.

Under torchrun every rank is its own process from the start and rank 0 runs the
engine, so commands travel as pickled objects over a torch.distributed broadcast
(a length, then the bytes) on a gloo group of their own. That group has a long
timeout on purpose: ranks > 0 wait on it while rank 0 is idle between
``generate`` calls, which is not a failure; a rank 0 that dies closes its sockets
and wakes them at once. Collectives of the model itself keep the short timeout.

A rank > 0 that fails leaves a :class:`RankFailure` in the rendezvous store and
leaves the job *with exit status 0*; its process exit closes its sockets, so rank
0's pending collective fails at once, and rank 0 reads the report and raises a
``WorkerError`` naming that rank, which decides the job's status. Exiting non-zero
instead would make torchrun kill rank 0 at once, often before it could say why
(a failure that could not be reported still exits non-zero).
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from kvrunner.distributed.errors import CollectiveError, RankFailure
from kvrunner.distributed.group import DistGroup

#: ranks > 0 may wait this long for rank 0's next command (idle is not failure)
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
_FAILURE_KEY = "kvrunner/failure/"
#: how long a broadcast waits for gloo's worker to drop the tensor (it takes microseconds)
_RELEASE_WAIT_S = 5.0


class BroadcastChannel:
    """Commands from rank 0 to every rank, answers gathered back to rank 0."""

    def __init__(self, group: DistGroup) -> None:
        self.group = group
        self.rank = group.rank
        # Collective: every rank creates it, in the same order.
        self._pg = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S)
        )

    def send(self, command: Any) -> None:
        """Rank 0: deliver ``command`` to every rank."""
        assert self.rank == 0, "only rank 0 sends commands"
        data = torch.frombuffer(bytearray(pickle.dumps(command)), dtype=torch.uint8)
        with _as_collective_error("sending a command"):
            self._broadcast(torch.tensor([data.numel()], dtype=torch.int64))
            self._broadcast(data)

    def receive(self) -> Any:
        """Ranks > 0: the next command from rank 0 (blocks while rank 0 is idle)."""
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` into every rank's, in place; returns once gloo's worker
        thread has let go of it too.

        That thread drops its references after the wait returns, and dropping a
        tensor Python knows takes the GIL. After the last command ("stop") the
        process exits; a worker still holding the tensor then meets a finalizing
        interpreter and the process aborts ("terminate called without an active
        exception"). Waiting here for the tensor's use count keeps that drop inside
        the call, where the GIL is there to take.
        """
        held = tensor._use_count()
        work = dist.broadcast(tensor, src=0, group=self._pg, async_op=True)
        work.wait()
        del work
        deadline = time.monotonic() + _RELEASE_WAIT_S
        while tensor._use_count() > held and time.monotonic() < deadline:
            time.sleep(0.0005)  # lets the worker thread take the GIL

    def gather(self, answer: Any) -> list[Any] | None:
        """Every rank's ``answer`` in rank order on rank 0; ``None`` elsewhere."""
        out: list[Any] | None = [None] * self.group.size if self.rank == 0 else None
        with _as_collective_error("gathering answers"):
            dist.gather_object(answer, out, dst=0, group=self._pg)
        return out

    def report_failure(self, failure: RankFailure) -> bool:
        """Leave this rank's failure where rank 0 looks for it; False if that failed
        (the store may be gone with rank 0)."""
        try:
            self.group.store.set(f"{_FAILURE_KEY}{failure.rank}", pickle.dumps(failure))
        except Exception:  # noqa: BLE001 - reported by the caller's exit status instead
            return False
        return True

    def peer_failures(self, wait_s: float) -> list[RankFailure]:
        """Failures other ranks reported, waiting up to ``wait_s`` for the first."""
        deadline = time.monotonic() + wait_s
        keys = [f"{_FAILURE_KEY}{r}" for r in range(self.group.size) if r != self.rank]
        while True:
            found = []
            for key in keys:
                try:
                    if self.group.store.check([key]):
                        found.append(pickle.loads(self.group.store.get(key)))
                except Exception:  # noqa: BLE001 - a dead store: nothing more to learn
                    return found
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)


@contextlib.contextmanager
def _as_collective_error(doing: str) -> Iterator[None]:
    """A failed channel collective (a peer gone) raised as CollectiveError."""
    try:
        yield
    except RuntimeError as e:  # gloo: "Connection closed by peer", timeouts
        raise CollectiveError(f"control channel failed while {doing}: {e}") from e
