"""The push's socket: authenticated, and Nagle's algorithm off at both ends from the
handshake on (a push is small request/answer exchanges; with Nagle on, each write that
waits for the peer's delayed acknowledgement stalls 40 ms)."""

from __future__ import annotations

import socket
import threading
from multiprocessing.connection import Connection

import pytest

from kvrunner.weight_sync.connection import connect, listen, parse_address
from kvrunner.weight_sync.errors import WeightSyncError

KEY = b"k" * 32


def no_delay(conn: Connection) -> bool:
    sock = socket.socket(fileno=socket.dup(conn.fileno()))
    try:
        return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    finally:
        sock.close()


def accept_one(address: tuple[str, int] | str, key: bytes) -> tuple[threading.Thread, dict]:
    listener = listen(address, key)
    got: dict = {"address": listener.address}

    def run() -> None:
        try:
            got["conn"] = listener.accept()
        except Exception as e:  # noqa: BLE001 - the test reads it
            got["error"] = e
        finally:
            listener.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def test_both_ends_of_a_tcp_push_connection_send_without_delay() -> None:
    thread, got = accept_one(("127.0.0.1", 0), KEY)
    engine_end = connect(got["address"], KEY, timeout_s=5.0)
    thread.join(5.0)
    sender_end = got["conn"]
    try:
        assert no_delay(engine_end) and no_delay(sender_end)
        engine_end.send_bytes(b"x" * 100_000)  # header and body written apart
        assert sender_end.recv_bytes() == b"x" * 100_000
    finally:
        engine_end.close()
        sender_end.close()


def test_a_host_port_text_connects_as_the_http_route_gives_it() -> None:
    thread, got = accept_one(("127.0.0.1", 0), KEY)
    host, port = got["address"]
    conn = connect(f"{host}:{port}", KEY, timeout_s=5.0)
    thread.join(5.0)
    conn.close()
    got["conn"].close()
    assert parse_address(f"{host}:{port}") == (host, port)


def test_a_unix_socket_path_still_connects(tmp_path) -> None:
    path = str(tmp_path / "push.sock")
    thread, got = accept_one(path, KEY)
    conn = connect(path, KEY, timeout_s=5.0)
    thread.join(5.0)
    conn.send_bytes(b"hello")
    assert got["conn"].recv_bytes() == b"hello"
    conn.close()
    got["conn"].close()


def test_a_wrong_key_is_refused_naming_the_authkey() -> None:
    thread, got = accept_one(("127.0.0.1", 0), KEY)
    with pytest.raises(WeightSyncError, match="refused the authkey"):
        connect(got["address"], b"w" * 32, timeout_s=5.0)
    thread.join(5.0)
    assert "error" in got  # the listener refused it too


def test_nobody_listening_is_an_error_after_the_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(WeightSyncError, match="no sender listens"):
        connect(("127.0.0.1", port), KEY, timeout_s=0.2)
