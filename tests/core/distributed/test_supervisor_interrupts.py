"""Ctrl-C in the driver never leaves the tensor-parallel ranks out of step.

A command must reach every rank or none: a rank that alone got a step would wait in
its collectives for peers that never join. And an interrupt while replies are
awaited leaves the group serving: the replies left unread are dropped, never taken
as the answer to the next command.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time

import pytest

from kvrunner.distributed.supervisor import WorkerProcesses


def echo_rank(rank: int, conn, _unused: None) -> None:
    """A rank that reports ready, then answers ("echo", x, delay_s) with (rank, x)
    after delay_s."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send_bytes(pickle.dumps(("ok", (rank, "ready"))))
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
    ready = workers.collect(workers.startup_ticket, during="start-up", timeout_s=60)
    assert ready == {0: (0, "ready"), 1: (1, "ready")}
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
        group.send_all(("echo", "step", 0.0), during="a step", replies_from=(0, 1))
    first.send_bytes = send
    replies = group.collect({0: 1, 1: 1}, during="a step", timeout_s=30)
    assert replies == {0: (0, "step"), 1: (1, "step")}


def test_a_ctrl_c_while_awaiting_replies_leaves_the_group_serving_in_step(group) -> None:
    ticket = group.send_all(("echo", "warm", 0.0), during="warm-up", replies_from=(0, 1))
    assert group.collect(ticket, during="warm-up", timeout_s=60) == {0: (0, "warm"), 1: (1, "warm")}
    slow = group.send_all(("echo", "slow", 1.0), during="a slow step", replies_from=(0, 1))
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        group.collect(slow, during="a slow step", timeout_s=30)
    assert group.alive() == [True, True]
    # The slow replies arrive after this command was sent: they are dropped, not
    # taken as its answer.
    ticket = group.send_all(("echo", "next", 0.0), during="the next step", replies_from=(0, 1))
    assert group.collect(ticket, during="the next step", timeout_s=60) == {
        0: (0, "next"), 1: (1, "next")
    }
    group.send_all(("echo", "unread", 0.5), during="a step", replies_from=(0, 1))
    group.settle(during="settling", timeout_s=60)  # waits for them, and drops them
    assert group._inbox == [{}, {}]
    ticket = group.send_all(("echo", "last", 0.0), during="a step", replies_from=(0, 1))
    assert group.collect(ticket, during="a step", timeout_s=60) == {0: (0, "last"), 1: (1, "last")}


def test_the_previous_ctrl_c_handler_is_back_after_a_send(group) -> None:
    before = signal.getsignal(signal.SIGINT)
    ticket = group.send_all(("echo", "x", 0.0), during="a step", replies_from=(0, 1))
    assert signal.getsignal(signal.SIGINT) is before
    assert group.collect(ticket, during="a step", timeout_s=60) == {0: (0, "x"), 1: (1, "x")}


def test_a_ctrl_c_to_the_whole_group_while_the_ranks_start_reaches_the_driver_alone() -> None:
    """A terminal's Ctrl-C goes to every process of its group: sent while the ranks are
    still importing (before a rank could ignore it), it must not kill them with a
    traceback; the driver alone answers it."""
    workers = WorkerProcesses(echo_rank, world_size=2, args=(None,), name="echo-rank")
    try:
        for pid in workers.pids:
            os.kill(pid, signal.SIGINT)  # at once: they are still starting up
        ready = workers.collect(workers.startup_ticket, during="start-up", timeout_s=60)
        assert ready == {0: (0, "ready"), 1: (1, "ready")}
        assert workers.alive() == [True, True]
    finally:
        workers.shutdown()
