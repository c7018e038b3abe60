"""The engine's side of an IPC push: connect to a trainer's sender, copy every
bucket into the weights, acknowledge each only once its copy is done on the device.

:func:`receive_push` runs one push (see :mod:`~kvrunner.weight_sync.messages` for
the exchange) into a *push session*: the engine's
``SleepWakeControl.push_session``, which counts the whole push as one weight update.
Everything that can go wrong part way — the trainer dies or goes silent, a bucket is
malformed, a tensor has the wrong name, shape or dtype, or holds NaN — ends the
session with an error, so the engine's weights are ``"partial"`` (if anything had
loaded) and generation is refused until a full push; the trainer hears a
:class:`~kvrunner.weight_sync.messages.Refusal` with the same message.

A direct push (``Shared`` messages) reads the trainer's own storages, mapped through
the engine's :class:`~kvrunner.weight_sync.mapped_storages.MappedStorages`, which
keeps them across pushes; its copies are waited for once, at the end of the push
(or before acknowledging a message whose storage the sender will overwrite).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from multiprocessing.connection import Connection

import torch

from kvrunner.errors import WeightUpdateError
from kvrunner.models.tensor_checks import all_finite, tensor_problem
from kvrunner.weight_sync import messages
from kvrunner.weight_sync.connection import connect
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.layout import BucketLayout
from kvrunner.weight_sync.mapped_storages import MappedStorages, SenderStorages
from kvrunner.weight_sync.messages import (
    PROTOCOL,
    Abort,
    Ack,
    Begin,
    Bucket,
    Done,
    End,
    Holding,
    Refusal,
    Shared,
)
from kvrunner.weight_sync.shared_buffer import BufferHandle, OpenedBuffer, open_buffer

Pairs = list[tuple[str, torch.Tensor]]
#: loads one bucket's checked pairs into the weights; returns how many loaded
Load = Callable[[Pairs], int]
#: the engine's push session: ``session(what)`` is a context that yields a Load
Session = Callable[[str], AbstractContextManager[Load]]


def wait_for_copies(devices: set[torch.device]) -> None:
    """Return once every copy queued on ``devices`` has completed (the copies read
    the trainer's memory on the engine's streams)."""
    for device in devices:
        torch.cuda.synchronize(device)


def copy_bucket(load: Load, pairs: Pairs) -> int:
    """Load ``pairs`` (views of the trainer's buffer) and return only once every copy
    out of the buffer has completed on the device: after this the buffer may be
    refilled. Returns how many tensors loaded."""
    loaded = load(pairs)
    wait_for_copies({t.device for _, t in pairs if t.is_cuda})
    return loaded


def check_finite(pairs: Pairs, where: str) -> None:
    """Refuse a bucket holding NaN or inf, naming the tensor: one pass over the whole
    bucket (:func:`~kvrunner.rl.weight_push.all_finite`), and the per-tensor min/max that
    names it only when that pass finds something."""
    if all_finite([t for _, t in pairs]):
        return
    for name, tensor in pairs:
        if tensor_problem(tensor, check_finite=True):
            raise WeightSyncError(f"{where}: tensor {name!r} holds NaN or inf values")


def receive_push(
    session: Session,
    address: tuple[str, int] | str,
    authkey: bytes,
    *,
    check_finite_values: bool = True,
    timeout_s: float = 300.0,
    storages: MappedStorages | None = None,
) -> int:
    """Receive one whole push from the sender at ``address`` into ``session``; returns
    how many tensors loaded. Raises :class:`WeightSyncError` (or the engine's
    refusal: asleep, busy) after telling the sender why.

    ``storages``: the engine's mapped trainer storages, which a direct push reads and
    which outlive the push (without it a direct push maps everything afresh and
    unmaps it at the end)."""
    if not isinstance(authkey, bytes):
        raise WeightSyncError(f"authkey must be bytes, got {type(authkey).__name__}")
    conn = connect(address, authkey, timeout_s)
    push = _Push(conn, storages, check_finite_values, timeout_s)
    try:
        loaded = push.receive(session)
        messages.send(conn, Done(loaded))
    except BaseException as e:
        push.release()
        _refuse(conn, e)
        conn.close()
        raise
    if push.sender is not None and storages is not None:
        storages.keep(push.sender, conn)  # the connection is now the lease on them
    else:
        push.release()
        conn.close()
    return loaded


def _refuse(conn: Connection, error: BaseException) -> None:
    with contextlib.suppress(WeightSyncError):  # the trainer is gone: nobody to tell
        messages.send(conn, Refusal(f"{type(error).__name__}: {error}"))


class _Push:
    """One push being received: its connection, buffers and (direct) storages."""

    def __init__(self, conn: Connection, storages: MappedStorages | None, finite: bool,
                 timeout_s: float) -> None:
        self.conn = conn
        self.cache = storages
        self.finite = finite
        self.timeout_s = timeout_s
        #: a direct push's sender's storages (None: a bucket push)
        self.sender: SenderStorages | None = None
        self.buffers: list[OpenedBuffer] = []

    def release(self) -> None:
        """Let go of whatever this push mapped (it failed, or nothing keeps it)."""
        if self.sender is not None:
            self.sender.release()

    def receive(self, session: Session) -> int:
        conn = self.conn
        begin = messages.receive(conn, self.timeout_s, waiting_for="the start of a push")
        if not isinstance(begin, Begin) or not isinstance(begin.buffers, tuple):
            raise WeightSyncError(f"a push must start with Begin, got {begin!r:.200}")
        if begin.protocol != PROTOCOL:
            raise WeightSyncError(f"the sender speaks weight-sync protocol "
                                  f"{begin.protocol!r}; this engine speaks {PROTOCOL}")
        if not isinstance(begin.sender, str):
            raise WeightSyncError(f"Begin.sender must be a string, got {begin.sender!r:.80}")
        if begin.sender:
            cache = self.cache if self.cache is not None else MappedStorages()
            self.sender = cache.take(begin.sender)
            messages.send(conn, Holding(tuple(self.sender.mapped)))
        self.buffers = [open_buffer(h) for h in begin.buffers if _is_handle(h)]
        try:
            with session("update_weights_from_ipc") as load:
                return self._messages(load)
        finally:
            for buffer in self.buffers:
                buffer.close()

    def _messages(self, load: Load) -> int:
        """Load every bucket and shared message up to End, acknowledging each after
        its copy; returns how many tensors loaded."""
        index, count, loaded, names = 0, 0, 0, set()
        unacked: list[int] = []  # shared messages whose copies are not yet waited for
        devices: set[torch.device] = set()
        while True:
            message = messages.receive(self.conn, self.timeout_s,
                                       waiting_for=f"bucket {index} or the end of the push")
            if isinstance(message, End):
                self._acknowledge(unacked, devices)
                if message.num_tensors != count:
                    raise WeightSyncError(f"the push ended announcing "
                                          f"{message.num_tensors!r} tensors; {count} arrived")
                return loaded
            if isinstance(message, Abort):
                raise WeightSyncError(f"the trainer gave the push up before bucket {index}: "
                                      f"{message.message}")
            where = f"bucket {index}"
            if not isinstance(message, Bucket | Shared):
                raise WeightSyncError(f"{where}: expected a Bucket, Shared or End, got "
                                      f"{message!r:.200}")
            if message.index != index:
                raise WeightSyncError(f"{where}: the message says it is number "
                                      f"{message.index!r}")
            pairs = (self._bucket(message, where) if isinstance(message, Bucket)
                     else self._shared(message, where))
            _note_names(names, [name for name, _ in pairs], where)
            if self.finite:
                check_finite(pairs, where)
            try:
                if isinstance(message, Shared) and not message.reply_now:
                    loaded += load(pairs)  # waited for before the acknowledgement
                    devices.update(t.device for _, t in pairs if t.is_cuda)
                    unacked.append(index)
                else:
                    loaded += copy_bucket(load, pairs)
                    self._acknowledge([*unacked, index], devices)
                    unacked = []
            except WeightUpdateError as e:  # a name or shape the model refused
                if isinstance(e, WeightSyncError):
                    raise
                raise WeightSyncError(f"{where}: {e}") from e
            count += len(pairs)
            index += 1

    def _acknowledge(self, indices: list[int], devices: set[torch.device]) -> None:
        wait_for_copies(devices)
        devices.clear()
        for index in indices:
            messages.send(self.conn, Ack(index))
        indices.clear()

    def _bucket(self, message: Bucket, where: str) -> Pairs:
        if not (isinstance(message.buffer, int) and 0 <= message.buffer < len(self.buffers)):
            raise WeightSyncError(f"{where}: buffer {message.buffer!r} is not one of the "
                                  f"{len(self.buffers)} the push began with")
        if not isinstance(message.layout, BucketLayout):
            raise WeightSyncError(f"{where}: layout is a {type(message.layout).__name__}")
        buffer = self.buffers[message.buffer]
        message.layout.check(buffer.nbytes, where=where)
        return message.layout.views(buffer.tensor)

    def _shared(self, message: Shared, where: str) -> Pairs:
        if self.sender is None:
            raise WeightSyncError(f"{where}: shared tensors in a push whose Begin named no "
                                  f"sender")
        self.sender.map(message.storages, where=where)
        return self.sender.views(message.tensors, where=where)


def _note_names(names: set[str], new: list[str], where: str) -> None:
    """Refuse a tensor pushed twice in one push (within ``new`` or after ``names``)."""
    twice = sorted(names.intersection(new))
    if twice or len(set(new)) < len(new):
        raise WeightSyncError(f"{where}: tensor(s) {twice or 'in this bucket'} pushed "
                              f"twice in one push")
    names.update(new)


def _is_handle(handle: object) -> bool:
    if not isinstance(handle, BufferHandle):
        raise WeightSyncError(f"Begin.buffers holds a {type(handle).__name__}, not a "
                              f"BufferHandle")
    return True
