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

A direct push (:class:`~kvrunner.weight_sync.direct_sender.DirectSender`) names its
sender in ``Begin``; the engine answers which of that sender's storages it still has
mapped, and the tensors arrive as ``Shared`` messages naming storages instead of
buckets::

    Begin(sender=id) ─────────────────────►
                 ◄─────────────────────────   Holding(storage ids mapped from before)
    Shared(0, new handles, tensors) ──────►   maps the new storages, checks, copies
    Shared(1, ...) ───────────────────────►     (not waited for: nothing is reused)
    End(num_tensors) ─────────────────────►   waits for every copy
                 ◄─────────────────────────   Ack(0), Ack(1), Done(loaded)
    ... the connection stays open as the lease on the mapped storages, until
    Release ──────────────────────────────►   unmaps them (also: sender gone, next push)
                 ◄─────────────────────────   Released

Messages are pickled plain data (no tensors) over an authenticated
``multiprocessing.connection``: only a peer holding the authkey can connect.
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any

import attrs

from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.layout import BucketLayout, TensorSlot
from kvrunner.weight_sync.shared_buffer import BufferHandle
from kvrunner.weight_sync.storage_share import StorageHandle

#: the protocol's version; an engine refuses a Begin of another
PROTOCOL = 1


@attrs.frozen
class Begin:
    """A push starts: the buffers its buckets will arrive in; ``sender`` (a direct
    push) names the sender whose storages the engine may still have mapped."""

    buffers: tuple[BufferHandle, ...]
    protocol: int = PROTOCOL
    sender: str = ""


@attrs.frozen
class Holding:
    """The engine's answer to a direct push's Begin: the ids of that sender's storages
    it has mapped from earlier pushes (a storage not listed comes with its handle)."""

    ids: tuple[int, ...]


@attrs.frozen
class SharedTensor:
    """One tensor of a direct push: ``slot`` (name, dtype, shape, byte offset) in the
    trainer's storage numbered ``storage``."""

    storage: int
    slot: TensorSlot


@attrs.frozen
class Shared:
    """Message ``index`` of a direct push: ``tensors`` read in place from trainer
    storages, ``storages`` the handles of those the engine has not mapped yet.
    ``reply_now``: the sender will overwrite one of them (a fallback bucket) once
    this is acknowledged, so the engine waits for its copies and acknowledges at
    once; otherwise the acknowledgement may wait for the end of the push."""

    index: int
    storages: tuple[StorageHandle, ...]
    tensors: tuple[SharedTensor, ...]
    reply_now: bool = False


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
class Release:
    """The sender closes: the engine unmaps every storage of it (then Released)."""


@attrs.frozen
class Released:
    """The engine holds none of the sender's storages any more."""


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
