"""The trainer's side of a one-copy push: :class:`DirectSender`.

:class:`~kvrunner.weight_sync.BucketSender` packs every tensor into a bucket and the
engine copies the bucket into its weights: two copies through the same memory.
A ``DirectSender`` packs nothing: it hands the engine the trainer tensors' own
storages (CUDA IPC handles on a GPU, shared memory on the CPU) and the engine copies
each tensor straight from the trainer's memory into its weight. The engine keeps
the storages mapped across pushes, so a steady-state push (the optimizer updated
the parameters in place) sends only names, dtypes, shapes and offsets::

    from kvrunner.weight_sync import DirectSender

    with DirectSender(device="cuda:0") as sender:   # once; listens on 127.0.0.1
        # every step, while the engine runs llm.update_weights_from_ipc(address, authkey=key):
        sender.push(model.named_parameters())       # returns once the engine has all
    # the with-block's end closed it: the engine unmapped, the memory can be freed

The engine side is the same as for buckets (``LLM.update_weights_from_ipc``,
``AsyncLLM.update_weights_from_ipc``, ``POST /update_weights_from_tensor``). What is
shared and what is packed, and the rules of the mapped storages: docs/weight_sync.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from multiprocessing.connection import Connection

import attrs
import torch

from kvrunner.weight_sync import messages
from kvrunner.weight_sync.endpoint import Address, SenderEndpoint
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.layout import TensorSlot, aligned, dtype_name
from kvrunner.weight_sync.messages import (
    Begin,
    Done,
    End,
    Holding,
    Release,
    Released,
    Shared,
    SharedTensor,
)
from kvrunner.weight_sync.sender import is_dtensor
from kvrunner.weight_sync.shared_storages import SharedStorages
from kvrunner.weight_sync.storage_share import StorageHandle

#: bytes of shared tensors per message (the engine checks and queues one message's
#: copies while the next arrives; each message costs one wait with ``check_finite``)
DEFAULT_CHUNK_BYTES = 4096 << 20
#: the size of each of the two buffers tensors that cannot be shared are packed into
DEFAULT_FALLBACK_BYTES = 256 << 20


@attrs.frozen
class DirectPushStats:
    """What one push sent: tensors read in place, tensors packed into a bucket,
    storages named (what the engine keeps mapped after it), storages whose handles
    travelled (0 in a steady-state push), messages."""

    shared: int
    packed: int
    storages: int
    new_storages: int
    messages: int


def packed_reason(tensor: torch.Tensor, device: torch.device,
                  dtype: torch.dtype | None) -> str | None:
    """Why ``tensor`` is packed into a bucket rather than read in place (None: it is
    shared): it lives on another device than the sender's, is not contiguous (a
    transposed or strided view), or must be cast to the sender's ``dtype``. A
    contiguous view at an offset into a larger storage is shared (the offset
    travels)."""
    if tensor.device != device:
        return f"it lives on {tensor.device}, not the sender's {device}"
    if not tensor.is_contiguous():
        return "it is not contiguous"
    if dtype is not None and tensor.dtype != dtype:
        return f"it is cast to {dtype}"
    return None


class DirectSender:
    """Shares named trainer tensors in place with an engine (one copy per byte).

    :param device: the trainer's device: a GPU (CUDA IPC: the engine must be on the
        same GPU) or ``"cpu"`` (shared memory: the same protocol, for CPU processes
        and tests). A tensor elsewhere is packed into a bucket.
    :param chunk_bytes: bytes of shared tensors per message (default 4 GiB).
    :param bucket_bytes: the size of each of the two fallback buffers (allocated on
        the first tensor that cannot be shared; default 256 MiB); a tensor that must
        be packed and is larger is refused before anything is sent.
    :param address: where to listen: ``(host, port)`` (port 0: any free port) or a
        Unix socket path. Default ``("127.0.0.1", 0)``.
    :param authkey: the key an engine must present (default: 32 random bytes).
    :param dtype: the dtype the engine should receive; a tensor of another dtype is
        cast while packed into a bucket. Default: each tensor as it is (the engine's
        copy casts to the engine's dtype, which costs nothing extra).
    :param timeout_s: how long :meth:`push` waits for the engine to connect, and then
        for each answer.

    The guarantees are the bucket path's (docs/weight_sync.md): every tensor is
    checked by the engine before it is written; :meth:`push` returns only when the
    engine's copies out of the trainer's memory have completed on the device (the
    trainer may then write its tensors) and raises :class:`WeightSyncError` with the
    engine's reason otherwise (the engine then refuses to serve until a full push).
    Between pushes the engine keeps the storages mapped; :meth:`close` has it
    unmap them, after which the trainer's memory can be freed.
    """

    def __init__(
        self,
        *,
        device: torch.device | str = "cuda",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        bucket_bytes: int = DEFAULT_FALLBACK_BYTES,
        address: Address = ("127.0.0.1", 0),
        authkey: bytes | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        for field, value in (("chunk_bytes", chunk_bytes), ("bucket_bytes", bucket_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise WeightSyncError(f"{field} must be a positive int, got {value!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cuda", "cpu"):
            raise WeightSyncError(f"a DirectSender shares CUDA or CPU tensors, not "
                                  f"{self.device}")
        self.chunk_bytes = chunk_bytes
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.timeout_s = timeout_s
        #: the key the engine must present; pass ``authkey.hex()`` over HTTP
        self.authkey: bytes = authkey if authkey is not None else os.urandom(32)
        #: what the engine keeps this sender's storages under
        self.sender_id = os.urandom(16).hex()
        #: what the last successful push sent
        self.last_push: DirectPushStats | None = None
        #: the listening socket and the exchange's message rules
        self.endpoint = SenderEndpoint(address, self.authkey, timeout_s)
        self._storages = SharedStorages()
        self._fallback: list[torch.Tensor] = []  # the two packing buffers, once needed
        self._lease: Connection | None = None

    @property
    def address(self) -> Address:
        """The engine connects here (:attr:`SenderEndpoint.address`)."""
        return self.endpoint.address

    @property
    def address_text(self) -> str:
        """The address for the HTTP route (:attr:`SenderEndpoint.address_text`)."""
        return self.endpoint.address_text

    def push(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    ) -> int:
        """Send every ``(name, tensor)`` (Hugging Face names, full tensors) to the
        engine that connects; returns how many tensors it loaded. Pass the trainer's
        own tensors (``model.named_parameters()``): a temporary is shared too, but
        each push then maps it anew. A DTensor is gathered and packed. Waits up to
        ``timeout_s`` for the engine to connect.

        Raises :class:`WeightSyncError` if the engine refused a message or a tensor
        (its message), closed the connection, or did not answer in time."""
        if isinstance(weights, Mapping):
            weights = weights.items()
        if self.device.type == "cuda":  # the trainer's kernels have written the tensors
            torch.cuda.synchronize(self.device)
        try:
            loaded, conn = self.endpoint.push(lambda conn: self._exchange(conn, weights))
        except BaseException:
            self._storages.forget()  # the engine lets go of everything on a failure
            raise
        self._end_lease()
        self._lease = conn  # the engine holds the storages while this stays open
        return loaded

    def _exchange(self, conn: Connection, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        endpoint = self.endpoint
        endpoint.send(conn, Begin((), sender=self.sender_id))
        holding = endpoint.answer(conn, "the engine's list of mapped storages")
        if not (isinstance(holding, Holding) and isinstance(holding.ids, tuple)):
            raise WeightSyncError(f"the engine answered {holding!r:.200} to a direct push")
        self._storages.begin(holding.ids)
        push = _Push(self, conn)
        for name, tensor in weights:
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise WeightSyncError(f"push takes (name, tensor) pairs; got "
                                      f"({type(name).__name__}, {type(tensor).__name__})")
            fresh = is_dtensor(tensor)
            tensor = (tensor.full_tensor() if fresh else tensor).detach()
            reason = "it was gathered" if fresh else packed_reason(tensor, self.device,
                                                                   self.dtype)
            if reason is None:
                push.share(name, tensor)
            else:
                push.pack(name, tensor, reason)
        loaded = push.finish()
        self.last_push = DirectPushStats(push.shared, push.packed, len(push.named),
                                         self._storages.new_storages, push.index)
        return loaded

    def fallback_buffer(self, number: int) -> torch.Tensor:
        """Packing buffer ``number`` (0 or 1), allocated on first use and kept."""
        while len(self._fallback) <= number:
            self._fallback.append(torch.empty(self.bucket_bytes, dtype=torch.uint8,
                                              device=self.device))
        return self._fallback[number]

    def locate(self, tensor: torch.Tensor) -> tuple[int, StorageHandle | None]:
        """See :meth:`SharedStorages.locate`."""
        return self._storages.locate(tensor)

    def _end_lease(self) -> None:
        if self._lease is not None:
            self._lease.close()
            self._lease = None

    def close(self) -> None:
        """Have the engine unmap every storage of this sender (waiting up to
        ``timeout_s`` for it to say so), stop listening and free the packing buffers
        (idempotent). On CUDA, memory the trainer dropped while the engine still
        mapped it (torch keeps such blocks until the consumer lets go) is then
        freed (``torch.cuda.ipc_collect()``)."""
        if self._lease is not None:
            with contextlib.suppress(WeightSyncError):
                messages.send(self._lease, Release())
                answer = messages.receive(self._lease, self.timeout_s,
                                          waiting_for="the engine to release the storages")
                if not isinstance(answer, Released):
                    raise WeightSyncError(f"expected Released, got {answer!r:.80}")
            self._end_lease()
        self._storages.forget()
        self._fallback = []
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()
        self.endpoint.close()

    def __enter__(self) -> DirectSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Push:
    """One push's messages: shared tensors gathered into chunks, the others packed
    into the two fallback buffers; every message numbered, acknowledged in order."""

    def __init__(self, sender: DirectSender, conn: Connection) -> None:
        self.sender = sender
        self.endpoint = sender.endpoint
        self.conn = conn
        self.index = 0  # the next message's number
        self.shared = 0
        self.packed = 0
        self._unacked: list[int] = []
        #: the storages this push named
        self.named: set[int] = set()
        self._buffer_use: dict[int, int] = {}  # fallback buffer -> message that uses it
        self._handles: list[StorageHandle] = []
        self._tensors: list[SharedTensor] = []
        self._chunk = 0
        self._bucket: list[tuple[TensorSlot, torch.Tensor]] = []
        self._bucket_used = 0
        self._buffer = 0  # the fallback buffer being filled

    def share(self, name: str, tensor: torch.Tensor) -> None:
        storage_id, handle = self.sender.locate(tensor)
        if handle is not None:
            self._handles.append(handle)
        offset = tensor.storage_offset() * tensor.element_size()
        slot = TensorSlot(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset)
        self._tensors.append(SharedTensor(storage_id, slot))
        self.named.add(storage_id)
        self._chunk += slot.nbytes
        self.shared += 1
        if self._chunk >= self.sender.chunk_bytes:
            self._send_chunk()

    def pack(self, name: str, tensor: torch.Tensor, reason: str) -> None:
        dtype = self.sender.dtype or tensor.dtype
        slot = TensorSlot(name, dtype_name(dtype), tuple(tensor.shape), 0)
        limit = self.sender.bucket_bytes
        if slot.nbytes > limit:
            raise WeightSyncError(f"tensor {name!r} ({slot.nbytes} bytes) is packed ({reason}) "
                                  f"and does not fit a bucket of {limit} bytes; raise "
                                  f"bucket_bytes")
        if self._bucket and aligned(self._bucket_used) + slot.nbytes > limit:
            self._send_bucket()
        slot = attrs.evolve(slot, offset=aligned(self._bucket_used))
        self._bucket.append((slot, tensor))
        self._bucket_used = slot.offset + slot.nbytes
        self.packed += 1

    def finish(self) -> int:
        """Send what is left and End; returns how many tensors the engine loaded."""
        self._send_chunk()
        self._send_bucket()
        self.endpoint.send(self.conn, End(self.shared + self.packed))
        self._acked_through(self.index - 1)
        answer = self.endpoint.answer(self.conn, "the engine to finish the push")
        if not isinstance(answer, Done):
            raise WeightSyncError(f"the engine answered {answer!r:.200} to the end of a push")
        return answer.loaded

    def _send(self, message: Shared) -> None:
        self.endpoint.send(self.conn, message)
        self._unacked.append(message.index)
        self.index += 1

    def _send_chunk(self) -> None:
        if self._tensors:
            self._send(Shared(self.index, tuple(self._handles), tuple(self._tensors)))
            self._handles, self._tensors, self._chunk = [], [], 0

    def _send_bucket(self) -> None:
        if not self._bucket:
            return
        number = self._buffer
        if number in self._buffer_use:  # its last bucket must be copied before refilling
            self._acked_through(self._buffer_use.pop(number))
        flat = self.sender.fallback_buffer(number)
        with torch.no_grad():
            for slot, tensor in self._bucket:
                slot.view(flat).copy_(tensor)
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()
        storage_id, handle = self.sender.locate(flat)
        tensors = tuple(SharedTensor(storage_id, slot) for slot, _ in self._bucket)
        self.named.add(storage_id)
        self._buffer_use[number] = self.index
        self._send(Shared(self.index, (handle,) if handle else (), tensors, reply_now=True))
        self._bucket, self._bucket_used, self._buffer = [], 0, 1 - number

    def _acked_through(self, index: int) -> None:
        """Wait for the acknowledgements of every message up to ``index`` (the
        engine sends them in order)."""
        while self._unacked and self._unacked[0] <= index:
            self.endpoint.expect_ack(self.conn, self._unacked.pop(0))
