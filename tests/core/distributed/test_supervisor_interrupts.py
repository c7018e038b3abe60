"""Ctrl-C in the driver never leaves the tensor-parallel ranks out of step.

A command must reach every rank or none: a rank that alone got a step would wait in
its collectives for peers that never join. And an interrupt while replies are
awaited leaves them unread, so the group stops and later calls say why, instead of
taking a stale reply as the answer to the next command.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time

import pytest

from kvrunner.distributed.errors import WorkerError
from kvrunner.distributed.supervisor import WorkerProcesses


def echo_rank(rank: int, conn, _unused: None) -> None:
    """A rank that answers ("echo", x, delay_s) with (rank, x) after delay_s."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            command = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if command[0] == "stop":
            return
        _, value, delay_s = command
        time.sleep(delay_s)
        conn.send_bytes(pickle.dumps(("ok", (rank, value))))


@pytest.fixture
def group():
    workers = WorkerProcesses(echo_rank, world_size=2, args=(None,), name="echo-rank")
    yield workers
    workers.shutdown()


def test_a_ctrl_c_between_two_sends_still_reaches_every_rank(group) -> None:
    first = group._conns[0]
    send = first.send_bytes

    def send_then_interrupt(payload: bytes) -> None:
        send(payload)
        signal.raise_signal(signal.SIGINT)  # Ctrl-C lands after rank 0's copy is sent

    first.send_bytes = send_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        group.send_all(("echo", "step", 0.0), during="a step")
    first.send_bytes = send
    replies = group.collect([0, 1], during="a step", timeout_s=30)
    assert replies == {0: (0, "step"), 1: (1, "step")}


def test_a_ctrl_c_while_awaiting_replies_stops_the_group_and_says_so(group) -> None:
    group.send_all(("echo", "warm", 0.0), during="warm-up")
    assert group.collect([0, 1], during="warm-up", timeout_s=60) == {0: (0, "warm"), 1: (1, "warm")}
    group.send_all(("echo", "slow", 1.0), during="a slow step")
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        group.collect([0, 1], during="a slow step", timeout_s=30)
    assert group.alive() == [False, False]
    with pytest.raises(WorkerError, match=r"interrupted \(Ctrl-C\).*during a slow step"):
        group.send_all(("echo", "next", 0.0), during="the next step")


def test_the_previous_ctrl_c_handler_is_back_after_a_send(group) -> None:
    before = signal.getsignal(signal.SIGINT)
    group.send_all(("echo", "x", 0.0), during="a step")
    assert signal.getsignal(signal.SIGINT) is before
    assert group.collect([0, 1], during="a step", timeout_s=60) == {0: (0, "x"), 1: (1, "x")}
