"""The trainer's side of an IPC push: :class:`BucketSender`.

Usable from any torch process (a plain model, FSDP2, a Ray actor); it imports
nothing of the engine. A colocated training step::

    from kvrunner.weight_sync import BucketSender

    with BucketSender(device="cuda:0") as sender:    # once; listens on 127.0.0.1
        # hand sender.address and sender.authkey to the engine side once; every step:
        with ThreadPoolExecutor(1) as pool:          # the engine connects and receives
            done = pool.submit(llm_update_weights_from_ipc, sender.address, sender.authkey)
            sender.push(model.named_parameters())    # returns once the engine has all
            done.result()
    # the with-block's end closed it: the port and both buffers are freed

``close()`` (what the ``with`` block's end calls) stops listening and frees both
buffers; a sender never closed frees its shared memory when it is collected or its
process exits.

The engine side is ``LLM.update_weights_from_ipc(address, authkey=...)``,
``AsyncLLM.update_weights_from_ipc(...)`` or ``POST /update_weights_from_tensor``
(see docs/weight_sync.md). Either side may start first: the sender listens from
construction and waits in :meth:`~BucketSender.push` for the engine to connect.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvrunner.weight_sync.endpoint import Address, SenderEndpoint
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.layout import BucketLayout, plan_buckets
from kvrunner.weight_sync.messages import Begin, Bucket, Done, End
from kvrunner.weight_sync.shared_buffer import SharedBuffer

#: the default bucket size: 2 GiB, as verl's colocated push (two are allocated)
DEFAULT_BUCKET_BYTES = 2048 << 20


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (gathered with ``full_tensor()`` to push)."""
    return type(tensor).__name__ == "DTensor" and callable(getattr(tensor, "full_tensor", None))


def gathered(
    weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` pairs: a DTensor is gathered (``full_tensor()``) one
    parameter at a time, so at most one full parameter is alive beyond the model.

    Gathering is a collective over the DTensor's mesh: every rank of the mesh must
    iterate this (and drop what it gets) while the rank that sends passes it to
    :meth:`BucketSender.push`, which iterates it the same way."""
    if isinstance(weights, Mapping):
        weights = weights.items()
    for name, tensor in weights:
        if is_dtensor(tensor):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


class BucketSender:
    """Packs named tensors into two flat buffers and streams them to an engine.

    :param device: where the buffers live: the trainer's GPU (CUDA IPC: the engine
        must be on the same GPU) or ``"cpu"`` (shared memory: the same protocol, for
        CPU processes and tests).
    :param bucket_bytes: the size of each of the two buffers (default 2 GiB). A
        tensor larger than one is refused before anything is sent.
    :param address: where to listen: ``(host, port)`` (port 0: any free port) or a
        Unix socket path. Default ``("127.0.0.1", 0)``.
    :param authkey: the key an engine must present (default: 32 random bytes); see
        :attr:`authkey`.
    :param dtype: cast every tensor to this dtype while packing (e.g. bf16 from fp32
        master weights, halving what crosses); default: each tensor's own.
    :param timeout_s: how long :meth:`push` waits for the engine to connect, and then
        for each acknowledgement.

    The guarantees (docs/weight_sync.md): bucket ``k + 1`` is packed while bucket
    ``k`` is copied; a buffer is refilled only after the engine acknowledged the
    bucket in it, which the engine does only once its copy has completed on the
    device; :meth:`push` returns only when the engine has loaded every tensor and
    finished the push, and raises :class:`WeightSyncError` with the engine's reason
    otherwise (the engine then refuses to serve until a full push).
    """

    def __init__(
        self,
        *,
        device: torch.device | str = "cuda",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        address: Address = ("127.0.0.1", 0),
        authkey: bytes | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise WeightSyncError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.timeout_s = timeout_s
        #: the key the engine must present; pass ``authkey.hex()`` over HTTP
        self.authkey: bytes = authkey if authkey is not None else os.urandom(32)
        self._endpoint = SenderEndpoint(address, self.authkey, timeout_s)
        self._buffers = [SharedBuffer(bucket_bytes, self.device) for _ in range(2)]
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def address(self) -> Address:
        """Where the engine connects: ``(host, port)`` or a socket path."""
        return self._endpoint.address

    @property
    def address_text(self) -> str:
        """:attr:`address` as ``"host:port"`` or a path (what the HTTP route takes)."""
        return self._endpoint.address_text

    def push(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    ) -> int:
        """Send every ``(name, tensor)`` (Hugging Face names, full tensors; a DTensor
        is gathered, see :func:`gathered`) to the engine that connects; returns how
        many tensors it loaded. Waits up to ``timeout_s`` for the engine to connect.

        Raises :class:`WeightSyncError` if the engine refused a bucket or a tensor
        (its message), closed the connection, or did not answer in time."""
        loaded, conn = self._endpoint.push(lambda conn: self._stream_push(conn, weights))
        conn.close()
        return loaded

    def _stream_push(self, conn: Connection, weights: Any) -> int:
        endpoint = self._endpoint
        # a fresh handle per push: each CUDA IPC reference is released by one mapping
        endpoint.send(conn, Begin(tuple(b.share() for b in self._buffers)))
        unacked: list[int] = []  # bucket indices sent and not yet acknowledged
        count = 0
        for index, bucket in enumerate(plan_buckets(self._cast(gathered(weights)),
                                                    self.bucket_bytes)):
            while len(unacked) >= len(self._buffers):  # the buffer we need is still read
                endpoint.expect_ack(conn, unacked.pop(0))
            buffer = self._buffers[index % len(self._buffers)]
            self._fill(buffer.tensor, bucket)
            layout = BucketLayout(tuple(slot for slot, _ in bucket))
            endpoint.send(conn, Bucket(index, index % len(self._buffers), layout))
            unacked.append(index)
            count += len(bucket)
        for index in unacked:
            endpoint.expect_ack(conn, index)
        endpoint.send(conn, End(count))
        answer = endpoint.answer(conn, "the engine to finish the push")
        if not isinstance(answer, Done):
            raise WeightSyncError(f"the engine answered {answer!r:.200} to the end of a push")
        return answer.loaded

    def _cast(self, pairs: Iterator[tuple[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in pairs:
            yield name, (tensor if self.dtype is None else tensor.to(self.dtype))

    def _fill(self, flat: torch.Tensor, bucket: list[tuple[Any, torch.Tensor]]) -> None:
        """Copy ``bucket``'s tensors into ``flat`` and wait until the copies are done
        (the engine reads the buffer as soon as it hears of the bucket). On CUDA the
        copies run on a side stream that first waits for the trainer's stream, so
        they read what the trainer's last kernels wrote."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), (
                torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext()):
            for slot, tensor in bucket:
                view = flat[slot.offset : slot.offset + slot.nbytes]
                view.view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        """Stop listening and free both buffers (idempotent)."""
        self._endpoint.close()
        for buffer in self._buffers:
            buffer.close()

    def __enter__(self) -> BucketSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

