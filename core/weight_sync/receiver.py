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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from multiprocessing.connection import AuthenticationError, Client, Connection

import torch

from kvrunner.sleep_state import WeightUpdateError
from kvrunner.weight_push import tensor_problem
from kvrunner.weight_sync import messages
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.layout import BucketLayout
from kvrunner.weight_sync.messages import PROTOCOL, Abort, Ack, Begin, Bucket, Done, End, Refusal
from kvrunner.weight_sync.shared_buffer import BufferHandle, OpenedBuffer, open_buffer

Pairs = list[tuple[str, torch.Tensor]]
#: loads one bucket's checked pairs into the weights; returns how many loaded
Load = Callable[[Pairs], int]
#: the engine's push session: ``session(what)`` is a context that yields a Load
Session = Callable[[str], AbstractContextManager[Load]]


def parse_address(text: str | tuple[str, int]) -> tuple[str, int] | str:
    """``"host:port"`` -> ``(host, port)``; a tuple as it is; anything else is a Unix
    socket path."""
    if isinstance(text, tuple):
        return text
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and "/" not in text:
        return host, int(port)
    return text


def connect(address: tuple[str, int] | str, authkey: bytes, timeout_s: float) -> Connection:
    """A connection to the sender at ``address``, retried until it listens (at most
    ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(parse_address(address), authkey=authkey)
        except AuthenticationError:
            raise WeightSyncError(f"the sender at {address} refused the authkey") from None
        except (ConnectionRefusedError, FileNotFoundError) as e:
            if time.monotonic() > deadline:
                raise WeightSyncError(f"no sender listens at {address} ({e})") from None
            time.sleep(0.05)


def copy_bucket(load: Load, pairs: Pairs) -> int:
    """Load ``pairs`` (views of the trainer's buffer) and return only once every copy
    out of the buffer has completed on the device: after this the buffer may be
    refilled. Returns how many tensors loaded."""
    loaded = load(pairs)
    devices = {t.device for _, t in pairs if t.is_cuda}
    for device in devices:  # the copies read the buffer on the engine's streams
        torch.cuda.synchronize(device)
    return loaded


def check_finite(pairs: Pairs, where: str) -> None:
    """Refuse a bucket holding NaN or inf, naming the tensor: one min/max per tensor
    and a single wait for all of them."""
    flags = [torch.isfinite(torch.stack(torch.aminmax(t))).all() for _, t in pairs if t.numel()]
    if flags and not bool(torch.stack(flags).all()):
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
) -> int:
    """Receive one whole push from the sender at ``address`` into ``session``; returns
    how many tensors loaded. Raises :class:`WeightSyncError` (or the engine's
    refusal: asleep, busy) after telling the sender why."""
    if not isinstance(authkey, bytes):
        raise WeightSyncError(f"authkey must be bytes, got {type(authkey).__name__}")
    conn = connect(address, authkey, timeout_s)
    with conn:
        try:
            loaded = _receive(conn, session, check_finite_values, timeout_s)
        except BaseException as e:
            _refuse(conn, e)
            raise
        messages.send(conn, Done(loaded))
    return loaded


def _refuse(conn: Connection, error: BaseException) -> None:
    with contextlib.suppress(WeightSyncError):  # the trainer is gone: nobody to tell
        messages.send(conn, Refusal(f"{type(error).__name__}: {error}"))


def _receive(conn: Connection, session: Session, finite: bool, timeout_s: float) -> int:
    begin = messages.receive(conn, timeout_s, waiting_for="the start of a push")
    if not isinstance(begin, Begin) or not isinstance(begin.buffers, tuple):
        raise WeightSyncError(f"a push must start with Begin, got {begin!r:.200}")
    if begin.protocol != PROTOCOL:
        raise WeightSyncError(f"the sender speaks weight-sync protocol {begin.protocol!r}; "
                              f"this engine speaks {PROTOCOL}")
    buffers = [open_buffer(h) for h in begin.buffers if _is_handle(h)]
    try:
        with session("update_weights_from_ipc") as load:
            return _buckets(conn, buffers, load, finite, timeout_s)
    finally:
        for buffer in buffers:
            buffer.close()


def _is_handle(handle: object) -> bool:
    if not isinstance(handle, BufferHandle):
        raise WeightSyncError(f"Begin.buffers holds a {type(handle).__name__}, not a "
                              f"BufferHandle")
    return True


def _buckets(conn: Connection, buffers: list[OpenedBuffer], load: Load, finite: bool,
             timeout_s: float) -> int:
    """Load every bucket up to End, acknowledging each after its copy; returns how
    many tensors loaded."""
    index, count, loaded, names = 0, 0, 0, set()
    while True:
        message = messages.receive(conn, timeout_s,
                                   waiting_for=f"bucket {index} or the end of the push")
        if isinstance(message, End):
            if message.num_tensors != count:
                raise WeightSyncError(f"the push ended announcing {message.num_tensors!r} "
                                      f"tensors; {count} arrived")
            return loaded
        if isinstance(message, Abort):
            raise WeightSyncError(f"the trainer gave the push up before bucket {index}: "
                                  f"{message.message}")
        where = f"bucket {index}"
        if not isinstance(message, Bucket):
            raise WeightSyncError(f"{where}: expected a Bucket or End, got {message!r:.200}")
        if message.index != index:
            raise WeightSyncError(f"{where}: the bucket says it is number {message.index!r}")
        if not (isinstance(message.buffer, int) and 0 <= message.buffer < len(buffers)):
            raise WeightSyncError(f"{where}: buffer {message.buffer!r} is not one of the "
                                  f"{len(buffers)} the push began with")
        if not isinstance(message.layout, BucketLayout):
            raise WeightSyncError(f"{where}: layout is a {type(message.layout).__name__}")
        buffer = buffers[message.buffer]
        message.layout.check(buffer.nbytes, where=where)
        twice = sorted(names.intersection(s.name for s in message.layout.slots))
        if twice or len({s.name for s in message.layout.slots}) < len(message.layout.slots):
            raise WeightSyncError(f"{where}: tensor(s) {twice or 'in this bucket'} pushed "
                                  f"twice in one push")
        names.update(s.name for s in message.layout.slots)
        pairs = message.layout.views(buffer.tensor)
        if finite:
            check_finite(pairs, where)
        try:
            loaded += copy_bucket(load, pairs)
        except WeightUpdateError as e:  # a name or shape the model refused
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"{where}: {e}") from e
        messages.send(conn, Ack(index))
        count += len(pairs)
        index += 1
