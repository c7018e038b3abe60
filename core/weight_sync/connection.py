"""The socket a push travels over: an authenticated ``multiprocessing.connection``
channel between the trainer's sender and the engine, with Nagle's algorithm off.

A push is a handful of request/answer exchanges (the authentication handshake, the
storages the engine holds, one message per bucket or chunk and its acknowledgement)
whose small writes meet the peer's delayed acknowledgements: with Nagle's algorithm
on, a write waiting for the acknowledgement of the one before it stalls 40 ms on
Linux's loopback, and ``Connection.send_bytes`` writes a large message's header and
body separately. Every TCP socket of a push therefore has ``TCP_NODELAY``, from
before the handshake (a listener's accepted sockets inherit it on Linux). A Unix
socket path has no such delay.
"""

from __future__ import annotations

import socket
import time
from multiprocessing.connection import (
    AuthenticationError,
    Client,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)

from kvrunner.weight_sync.errors import WeightSyncError

Address = tuple[str, int] | str


def parse_address(text: str | tuple[str, int]) -> Address:
    """``"host:port"`` -> ``(host, port)``; a tuple as it is; anything else is a Unix
    socket path."""
    if isinstance(text, tuple):
        return text
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and "/" not in text:
        return host, int(port)
    return text


def listen(address: Address, authkey: bytes) -> Listener:
    """An authenticated listener at ``address`` whose TCP connections have Nagle's
    algorithm off."""
    listener = Listener(address, authkey=authkey)
    sock = listener._listener._socket  # type: ignore[union-attr]
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return listener


def connect(address: Address, authkey: bytes, timeout_s: float) -> Connection:
    """A connection to the sender at ``address``, retried until it listens (at most
    ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    where = parse_address(address)
    while True:
        try:
            return _open(where, authkey)
        except AuthenticationError:
            raise WeightSyncError(f"the sender at {address} refused the authkey") from None
        except (ConnectionRefusedError, FileNotFoundError) as e:
            if time.monotonic() > deadline:
                raise WeightSyncError(f"no sender listens at {address} ({e})") from None
            time.sleep(0.05)


def _open(address: Address, authkey: bytes) -> Connection:
    if not isinstance(address, tuple):
        return Client(address, authkey=authkey)
    sock = socket.create_connection(address)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock.detach())
    finally:
        sock.close()
    try:  # as Client() authenticates: answer the listener's challenge, then pose ours
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn
