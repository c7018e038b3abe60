"""The messages of one push, trainer to engine and back.

One push over one connection::

    trainer                                   engine
    Begin(buffers) ───────────────────────►   maps the buffers
    Bucket(0, buffer 0, layout) ──────────►   checks, copies, waits for the copy
    Bucket(1, buffer 1, layout) ──────────►     ...
                 ◄─────────────────────────   Ack(0)   (buffer 0 may be refilled)
    Bucket(2, buffer 0, layout) ──────────►
                 ◄─────────────────────────   Ack(1), Ack(2)
    End(num_tensors) ─────────────────────►   finishes the push (prefix cache, graphs)
    (or Abort(message) at any point: the trainer gives the push up)
                 ◄─────────────────────────   Done(loaded)    or, at any point, Refusal

Messages are pickled plain data (no tensors) over an authenticated
``multiprocessing.connection``: only a peer holding the authkey can connect.
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any

import attrs

from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.layout import BucketLayout
from kvrunner.weight_sync.shared_buffer import BufferHandle

#: the protocol's version; an engine refuses a Begin of another
PROTOCOL = 1


@attrs.frozen
class Begin:
    """A push starts: the buffers its buckets will arrive in."""

    buffers: tuple[BufferHandle, ...]
    protocol: int = PROTOCOL


@attrs.frozen
class Bucket:
    """Bucket ``index`` (from 0) is ready in buffer ``buffer``."""

    index: int
    buffer: int
    layout: BucketLayout


@attrs.frozen
class End:
    """Every bucket was sent: ``num_tensors`` tensors in all."""

    num_tensors: int


@attrs.frozen
class Abort:
    """The trainer gives the push up (its iterator raised, a tensor was refused before
    sending); ``message`` says why."""

    message: str


@attrs.frozen
class Ack:
    """Bucket ``index`` has been copied, on the device, into the engine's weights: its
    buffer may be refilled."""

    index: int


@attrs.frozen
class Done:
    """The push is complete: ``loaded`` tensors are in the engine's weights."""

    loaded: int


@attrs.frozen
class Refusal:
    """The engine refused the push; ``message`` says why (the weights are ``partial``
    if any bucket had loaded)."""

    message: str


def send(conn: Connection, message: Any) -> None:
    """Send ``message``; :class:`WeightSyncError` if the peer has closed the connection."""
    try:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError as e:
        raise WeightSyncError(f"the peer closed the connection before this side could send "
                              f"{type(message).__name__} ({type(e).__name__})") from None


def receive(conn: Connection, timeout_s: float, *, waiting_for: str) -> Any:
    """The next message; :class:`WeightSyncError` if the peer closed the connection or
    sent nothing within ``timeout_s`` (``waiting_for`` says what was expected)."""
    try:
        if not conn.poll(timeout_s):
            raise WeightSyncError(f"no message within {timeout_s:g} s while waiting for "
                                  f"{waiting_for}")
        data = conn.recv_bytes()
    except (EOFError, OSError) as e:
        raise WeightSyncError(f"the peer closed the connection while this side waited for "
                              f"{waiting_for} ({type(e).__name__})") from None
    try:
        return pickle.loads(data)
    except Exception as e:  # a garbled message is a malformed push, not a crash
        raise WeightSyncError(f"a message that is not a weight-sync message arrived while "
                              f"waiting for {waiting_for}: {e}") from None
