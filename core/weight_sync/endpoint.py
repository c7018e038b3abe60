"""The trainer's end of a push: where it listens, and the exchange's message rules.

Both senders (:class:`~kvrunner.weight_sync.sender.BucketSender` and
:class:`~kvrunner.weight_sync.direct_sender.DirectSender`) listen from construction
on an authenticated ``multiprocessing.connection.Listener``
(:mod:`kvrunner.weight_sync.connection`); each push accepts one
engine connection, runs its exchange over it, and on a failure tells the engine why
(``Abort``) unless the engine was the one that refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvrunner.weight_sync import messages
from kvrunner.weight_sync.connection import Address, listen
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.messages import Abort, Ack, Refusal


class SenderEndpoint:
    """A listening socket and the message exchange of the pushes through it.

    :param address: ``(host, port)`` (port 0: any free port) or a Unix socket path.
    :param authkey: the key an engine must present.
    :param timeout_s: how long a push waits for the engine to connect, and then for
        each answer.
    """

    def __init__(self, address: Address, authkey: bytes, timeout_s: float) -> None:
        self.authkey = authkey
        self.timeout_s = timeout_s
        self._listener = listen(address, authkey)

    @property
    def address(self) -> Address:
        """Where the engine connects: ``(host, port)`` or a socket path."""
        return self._listener.address

    @property
    def address_text(self) -> str:
        """:attr:`address` as ``"host:port"`` or a path (what the HTTP route takes)."""
        address = self.address
        return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)

    def push(self, exchange: Callable[[Connection], int]) -> tuple[int, Connection]:
        """Accept the engine's connection (waiting up to ``timeout_s``) and run
        ``exchange`` over it; returns its result and the open connection (the
        caller's to close or keep). On a failure the engine hears why and the
        connection is closed."""
        self._listener._listener._socket.settimeout(self.timeout_s)  # type: ignore[union-attr]
        try:
            conn = self._listener.accept()
        except TimeoutError:
            raise WeightSyncError(f"no engine connected to {self.address_text} within "
                                  f"{self.timeout_s:g} s") from None
        try:
            return exchange(conn), conn
        except Exception as e:  # tell the engine why, so its error says so too
            if not isinstance(e, WeightSyncError) or not str(e).startswith("the engine"):
                with contextlib.suppress(WeightSyncError):
                    messages.send(conn, Abort(f"{type(e).__name__}: {e}"))
            conn.close()
            raise
        except BaseException:
            conn.close()
            raise

    def send(self, conn: Connection, message: Any) -> None:
        """Send; if the engine has hung up, raise its refusal (sent before it closed)
        rather than the broken pipe."""
        try:
            messages.send(conn, message)
        except WeightSyncError:
            try:
                answer = messages.receive(conn, 1.0, waiting_for="the engine's refusal")
            except WeightSyncError:
                answer = None
            if isinstance(answer, Refusal):
                raise WeightSyncError(f"the engine refused the push: {answer.message}") from None
            raise

    def answer(self, conn: Connection, waiting_for: str) -> Any:
        """The engine's next message; its refusal raised as :class:`WeightSyncError`."""
        answer = messages.receive(conn, self.timeout_s, waiting_for=waiting_for)
        if isinstance(answer, Refusal):
            raise WeightSyncError(f"the engine refused the push: {answer.message}")
        return answer

    def expect_ack(self, conn: Connection, index: int) -> None:
        """Wait for ``Ack(index)`` (the engine's copy of message ``index`` is done)."""
        answer = self.answer(conn, f"the acknowledgement of bucket {index}")
        if answer != Ack(index):
            raise WeightSyncError(f"expected Ack({index}) from the engine, got {answer!r:.200}")

    def close(self) -> None:
        """Stop listening (idempotent)."""
        self._listener.close()
