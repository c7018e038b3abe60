"""A trainer in its own process, for the tests: it pushes a checkpoint's tensors to
the engine through a real :class:`~kvrunner.weight_sync.BucketSender` (shared memory
on the CPU), or breaks the protocol on purpose.

Commands arrive on a pipe, one per push; for each the trainer answers
``("listening", address, authkey)`` and then ``("pushed", n)`` or ``("failed", msg)``.

A direct job (``mode="direct"``) keeps its :class:`~kvrunner.weight_sync.DirectSender`
and its tensors for the jobs after it: ``in_place=True`` writes the next checkpoint's
values into the same tensors (as an optimizer step does) and pushes them again. It
answers ``("pushed", n, stats)``, stats being the sender's ``last_push`` as a dict.
"""

from __future__ import annotations

import os
import random
from multiprocessing.connection import Connection
from typing import Any

import attrs
import torch
from safetensors.torch import load_file

from kvrunner.weight_sync import BucketSender, DirectSender
from kvrunner.weight_sync import messages as m
from kvrunner.weight_sync.layout import BucketLayout, TensorSlot
from kvrunner.weight_sync.shared_buffer import SharedBuffer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_tensors(path: str, order_seed: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors directory, in an order drawn from ``order_seed``."""
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    pairs = sorted(tensors.items())
    random.Random(order_seed).shuffle(pairs)
    return pairs


def _dying_after(pairs: list[tuple[str, Any]], count: int):
    for index, pair in enumerate(pairs):
        if index == count:
            os._exit(3)  # the trainer is killed mid-push: no goodbye, no Abort
        yield pair


def push(conn: Connection, job: dict[str, Any]) -> None:
    pairs = checkpoint_tensors(job["path"], job.get("order_seed", 0))
    if job.get("die_after") is not None:
        pairs = _dying_after(pairs, job["die_after"])
    dtype = DTYPES[job["dtype"]] if job.get("dtype") else None
    with BucketSender(device="cpu", bucket_bytes=job["bucket_bytes"], dtype=dtype,
                      timeout_s=60) as sender:
        conn.send(("listening", sender.address, sender.authkey))
        try:
            conn.send(("pushed", sender.push(pairs)))
        except Exception as e:
            conn.send(("failed", str(e)))


def push_malformed(conn: Connection, job: dict[str, Any]) -> None:
    """One good bucket, then bucket 1 with the fault ``job["fault"]`` names (its layout,
    or for ``nan`` / ``inf`` one such value in a well-formed bucket); or, for
    ``first_bucket_wrong_shape``, bucket 0 holding a good tensor then one of a wrong
    shape."""
    from multiprocessing.connection import Listener

    pairs = checkpoint_tensors(job["path"], 0)
    listener = Listener(("127.0.0.1", 0), authkey=b"k" * 32)
    conn.send(("listening", listener.address, b"k" * 32))
    buffer = SharedBuffer(1 << 20, "cpu")
    with listener.accept() as engine:
        m.send(engine, m.Begin((buffer.share(),)))
        name, tensor = pairs[0]
        buffer.tensor[: tensor.numel() * 4].view(torch.float32).copy_(tensor.flatten())
        slot = TensorSlot(name, "float32", tuple(tensor.shape), 0)
        if job["fault"] == "first_bucket_wrong_shape":  # bucket 0: a good tensor, a bad one
            late = TensorSlot(pairs[1][0], "float32", (3, 5), tensor.numel() * 4)
            m.send(engine, m.Bucket(0, 0, BucketLayout((slot, late))))
            answer = m.receive(engine, 60, waiting_for="the refusal")
            conn.send(("failed", getattr(answer, "message", repr(answer))))
            buffer.close()
            listener.close()
            return
        m.send(engine, m.Bucket(0, 0, BucketLayout((slot,))))
        assert m.receive(engine, 60, waiting_for="ack") == m.Ack(0)
        name, tensor = pairs[1]
        good = TensorSlot(name, "float32", tuple(tensor.shape), 0)
        fault = job["fault"]
        if fault in ("nan", "inf"):  # a well-formed bucket whose values are not finite
            bad_value = tensor.flatten().clone()
            bad_value[tensor.numel() // 2] = float(fault)
            buffer.tensor[: tensor.numel() * 4].view(torch.float32).copy_(bad_value)
        bad: Any = {
            "past_the_end": m.Bucket(1, 0, BucketLayout((TensorSlot(name, "float32",
                                                                     (1 << 20,), 0),))),
            "unknown_dtype": m.Bucket(1, 0, BucketLayout((TensorSlot(name, "int8",
                                                                     good.shape, 0),))),
            "wrong_shape": m.Bucket(1, 0, BucketLayout((TensorSlot(name, "float32",
                                                                   (3, 5), 0),))),
            "wrong_name": m.Bucket(1, 0, BucketLayout((TensorSlot("model.nope.weight",
                                                                   "float32", good.shape, 0),))),
            "overlap": m.Bucket(1, 0, BucketLayout((good, TensorSlot(pairs[2][0], "float32",
                                                                     tuple(pairs[2][1].shape),
                                                                     0)))),
            "not_a_bucket": "hello",
            "nan": m.Bucket(1, 0, BucketLayout((good,))),
            "inf": m.Bucket(1, 0, BucketLayout((good,))),
        }[fault]
        m.send(engine, bad)
        answer = m.receive(engine, 60, waiting_for="the refusal")
        conn.send(("failed", getattr(answer, "message", repr(answer))))
    buffer.close()
    listener.close()


def push_malformed_direct(conn: Connection, job: dict[str, Any]) -> None:
    """A direct push: one good message, then message 1 with the fault ``job["fault"]``
    names (or, for ``direct_no_sender``, shared tensors in a push that named no
    sender, after a good bucket)."""
    from multiprocessing.connection import Listener

    from kvrunner.weight_sync.storage_share import share_storage

    pairs = checkpoint_tensors(job["path"], 0)
    listener = Listener(("127.0.0.1", 0), authkey=b"k" * 32)
    conn.send(("listening", listener.address, b"k" * 32))
    fault = job["fault"].removeprefix("direct_")
    buffer = SharedBuffer(1 << 20, "cpu")
    with listener.accept() as engine:
        name, tensor = pairs[0]
        slot = TensorSlot(name, "float32", tuple(tensor.shape), 0)
        if fault == "no_sender":
            m.send(engine, m.Begin((buffer.share(),)))
            buffer.tensor[: tensor.numel() * 4].view(torch.float32).copy_(tensor.flatten())
            m.send(engine, m.Bucket(0, 0, BucketLayout((slot,))))
        else:
            m.send(engine, m.Begin((), sender="malformed"))
            assert isinstance(m.receive(engine, 60, waiting_for="Holding"), m.Holding)
            handle = share_storage(tensor.untyped_storage(), 1)
            m.send(engine, m.Shared(0, (handle,), (m.SharedTensor(1, slot),), reply_now=True))
        assert m.receive(engine, 60, waiting_for="ack") == m.Ack(0)
        name, tensor = pairs[1]
        good = TensorSlot(name, "float32", tuple(tensor.shape), 0)
        bad = {
            "unmapped": m.SharedTensor(99, good),
            "past_the_end": m.SharedTensor(1, TensorSlot(name, "float32", (1 << 20,), 0)),
            "no_sender": m.SharedTensor(1, good),
        }[fault]
        m.send(engine, m.Shared(1, (), (bad,)))
        answer = m.receive(engine, 60, waiting_for="the refusal")
        conn.send(("failed", getattr(answer, "message", repr(answer))))
    buffer.close()
    listener.close()


def broadcast_job(conn: Connection, job: dict[str, Any]) -> None:
    """Rank 0 of a weight-update group: join, then broadcast every tensor in order."""
    from kvrunner.weight_sync.broadcaster import WeightBroadcaster

    pairs = checkpoint_tensors(job["path"], job.get("order_seed", 0))
    if job.get("resize") is not None:  # a trainer bug: one tensor of another size
        index, kind = job["resize"]
        name, tensor = pairs[index]
        flat = tensor.flatten()
        pairs[index] = (name, torch.cat([flat, flat]) if kind == "longer" else flat[:-1])
    if job.get("die_after") is not None:
        pairs = _dying_after(pairs, job["die_after"])
    sender = WeightBroadcaster("127.0.0.1", job["port"], world_size=job["world_size"],
                               timeout_s=30)
    sender.connect()
    conn.send(("joined", None, None))
    try:
        sender.broadcast(pairs)
    except Exception as e:  # the engine refused and left the group
        conn.send(("failed", str(e)))
        return
    finally:
        sender.close()  # the next job joins a group of the same name
    conn.send(("broadcast", job["world_size"]))


def trainer_tensors(pairs: list[tuple[str, torch.Tensor]], dtype: torch.dtype,
                    layout_seed: int) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as a trainer might hold them, in ``dtype``: each drawn
    (from ``layout_seed``) to own its storage, to be a view at an offset into one
    flat storage shared with others, or to be non-contiguous."""
    rng = random.Random(layout_seed)
    kinds = [rng.choice(["own", "view", "strided"]) for _ in pairs]
    views = [(i, t) for i, ((_, t), k) in enumerate(zip(pairs, kinds, strict=True))
             if k == "view"]
    flat = torch.zeros(sum(t.numel() + 3 for _, t in views), dtype=dtype)
    out: list[Any] = [None] * len(pairs)
    offset = 0
    for i, t in views:
        offset += rng.randint(0, 3)  # some views start at an odd element
        out[i] = flat[offset : offset + t.numel()].view(t.shape)
        offset += t.numel()
    for i, ((_, t), kind) in enumerate(zip(pairs, kinds, strict=True)):
        if kind == "own":
            out[i] = torch.empty(t.shape, dtype=dtype)
        elif kind == "strided":
            out[i] = torch.empty(*t.shape, 2, dtype=dtype)[..., 0]
        out[i].copy_(t)
    return [(name, tensor) for (name, _), tensor in zip(pairs, out, strict=True)]


class DirectTrainer:
    """The direct jobs' sender and tensors, kept from one job to the next."""

    def __init__(self) -> None:
        self.sender: DirectSender | None = None
        self.pairs: list[tuple[str, torch.Tensor]] = []

    def push(self, conn: Connection, job: dict[str, Any]) -> None:
        source = checkpoint_tensors(job["path"], job.get("order_seed", 0))
        if job.get("in_place"):  # an optimizer step: the same storages, new values
            values = dict(source)
            every = job.get("replace_every")
            with torch.no_grad():
                for i, (name, tensor) in enumerate(self.pairs):
                    if every and i % every == 0:  # re-allocated: a new storage
                        self.pairs[i] = (name, torch.empty_like(tensor))
                    self.pairs[i][1].copy_(values[name])
        else:
            self.close()
            held = DTYPES[job.get("dtype", "float32")]
            cast = DTYPES[job["cast"]] if job.get("cast") else None
            self.pairs = trainer_tensors(source, held, job.get("layout_seed", 0))
            self.sender = DirectSender(device="cpu", chunk_bytes=job.get("chunk_bytes", 1 << 30),
                                       bucket_bytes=job.get("bucket_bytes", 1 << 20),
                                       dtype=cast, timeout_s=60)
        pairs: Any = self.pairs
        if job.get("die_after") is not None:
            pairs = _dying_after(pairs, job["die_after"])
        assert self.sender is not None
        conn.send(("listening", self.sender.address, self.sender.authkey))
        try:
            loaded = self.sender.push(pairs)
            stats = attrs.asdict(self.sender.last_push)
            conn.send(("pushed", loaded, {**stats, "sender": self.sender.sender_id}))
        except Exception as e:
            conn.send(("failed", str(e)))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def close_and_free(self, conn: Connection) -> None:
        """Close the sender, drop every tensor, and answer ``("closed", the shared
        memory segments the tensors lived in)``."""
        segments = {t.untyped_storage()._share_filename_cpu_()[1].decode()
                    for _, t in self.pairs}
        self.close()
        self.pairs = []
        conn.send(("closed", sorted(segments)))


def serve(conn: Connection) -> None:
    """Run pushes until told to stop (the target of the spawned process)."""
    torch.set_num_threads(1)
    direct = DirectTrainer()
    while True:
        job = conn.recv()
        if job is None:
            direct.close()
            return
        if job.get("mode") == "direct":
            direct.push(conn, job)
        elif job.get("mode") == "close":
            direct.close_and_free(conn)
        elif str(job.get("fault", "")).startswith("direct_"):
            push_malformed_direct(conn, job)
        elif "port" in job:
            broadcast_job(conn, job)
        else:
            (push_malformed if job.get("fault") else push)(conn, job)
