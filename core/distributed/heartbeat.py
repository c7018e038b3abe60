"""Heartbeats: each spawned rank says it is running, so the driver can name one that
stopped (SIGSTOP, a frozen host, a process starved of the CPU) within seconds.

``distributed_timeout_s`` bounds the collectives, and must be long (a peer may be
slow to load, a step may be long); a rank that is not running at all says nothing
until then. So every rank runs a :class:`HeartbeatSender`, a daemon thread that
bumps the rank's counter in the rendezvous store (served by the driver) a few
times per ``heartbeat_timeout_s``, from start-up to exit, whatever the rank's main
thread is doing. The driver's :class:`HeartbeatMonitor` reads the counters while it
waits for replies; a counter that has not moved for ``heartbeat_timeout_s`` names
its rank. A rank only waiting (in a collective, for the driver) still beats: that
is the collectives' timeout to judge, not this one.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

_KEY = "kvrunner/heartbeat/"
#: beats per heartbeat_timeout_s: a beat late by a scheduling hiccup is not silence
BEATS_PER_TIMEOUT = 5


def _key(rank: int) -> str:
    return f"{_KEY}{rank}"


class HeartbeatSender:
    """A rank's heartbeat: a daemon thread bumping its counter every
    ``timeout_s / BEATS_PER_TIMEOUT`` seconds through its own store client."""

    def __init__(self, store: dist.Store, *, rank: int, timeout_s: float) -> None:
        self._store = store
        self._key = _key(rank)
        self._interval_s = timeout_s / BEATS_PER_TIMEOUT
        self._stopped = threading.Event()
        self._store.add(self._key, 1)  # the first beat: from here on, silence counts
        self._thread = threading.Thread(
            target=self._run, name=f"kvrunner-heartbeat{rank}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            try:
                self._store.add(self._key, 1)
            except Exception:  # noqa: BLE001 - the driver (the store) is gone: nobody listens
                return

    def stop(self) -> None:
        self._stopped.set()


class HeartbeatMonitor:
    """The driver's view of every rank's heartbeat.

    A rank is silent once its counter has not moved for ``timeout_s`` of the
    driver's own clock between two reads; a rank that has not beaten yet (still
    starting its interpreter) is left to the start-up timeout.
    """

    def __init__(self, store: dist.Store, *, world_size: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        #: how often a waiting driver looks (it wakes up at least this often)
        self.poll_s = min(1.0, timeout_s / BEATS_PER_TIMEOUT)
        self._store = store
        now = time.monotonic()
        self._count = [0] * world_size
        self._moved = [now] * world_size
        self._read_at = 0.0

    def silent(self, ranks: list[int]) -> list[tuple[int, float]]:
        """``(rank, seconds without a beat)`` for each of ``ranks`` silent too long;
        reads the store at most every ``poll_s``."""
        now = time.monotonic()
        if now - self._read_at < self.poll_s:
            return []
        self._read_at = now
        found = []
        for rank in ranks:
            count = self._store.add(_key(rank), 0)  # reads without waiting for the key
            if count != self._count[rank]:
                self._count[rank], self._moved[rank] = count, now
            elif count > 0 and now - self._moved[rank] > self.timeout_s:
                found.append((rank, now - self._moved[rank]))
        return found
