"""A trainer in its own process, for the tests: it pushes a checkpoint's tensors to
the engine through a real :class:`~kvrunner.weight_sync.BucketSender` (shared memory
on the CPU), or breaks the protocol on purpose.

Commands arrive on a pipe, one per push; for each the trainer answers
``("listening", address, authkey)`` and then ``("pushed", n)`` or ``("failed", msg)``.
"""

from __future__ import annotations

import os
import random
from multiprocessing.connection import Connection
from typing import Any

import torch
from safetensors.torch import load_file

from kvrunner.weight_sync import BucketSender
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
    """One good bucket, then bucket 1 with the fault ``job["fault"]`` names."""
    from multiprocessing.connection import Listener

    pairs = checkpoint_tensors(job["path"], 0)
    listener = Listener(("127.0.0.1", 0), authkey=b"k" * 32)
    conn.send(("listening", listener.address, b"k" * 32))
    buffer = SharedBuffer(1 << 20, "cpu")
    with listener.accept() as engine:
        m.send(engine, m.Begin((buffer.handle,)))
        name, tensor = pairs[0]
        buffer.tensor[: tensor.numel() * 4].view(torch.float32).copy_(tensor.flatten())
        slot = TensorSlot(name, "float32", tuple(tensor.shape), 0)
        m.send(engine, m.Bucket(0, 0, BucketLayout((slot,))))
        assert m.receive(engine, 60, waiting_for="ack") == m.Ack(0)
        name, tensor = pairs[1]
        good = TensorSlot(name, "float32", tuple(tensor.shape), 0)
        fault = job["fault"]
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
        }[fault]
        m.send(engine, bad)
        answer = m.receive(engine, 60, waiting_for="the refusal")
        conn.send(("failed", getattr(answer, "message", repr(answer))))
    buffer.close()
    listener.close()


def broadcast_job(conn: Connection, job: dict[str, Any]) -> None:
    """Rank 0 of a weight-update group: join, then broadcast every tensor in order."""
    from kvrunner.weight_sync.broadcaster import WeightBroadcaster

    pairs = checkpoint_tensors(job["path"], job.get("order_seed", 0))
    if job.get("die_after") is not None:
        pairs = _dying_after(pairs, job["die_after"])
    sender = WeightBroadcaster("127.0.0.1", job["port"], world_size=job["world_size"],
                               timeout_s=30)
    sender.connect()
    conn.send(("joined", None, None))
    sender.broadcast(pairs)
    conn.send(("broadcast", job["world_size"]))


def serve(conn: Connection) -> None:
    """Run pushes until told to stop (the target of the spawned process)."""
    torch.set_num_threads(1)
    while True:
        job = conn.recv()
        if job is None:
            return
        if "port" in job:
            broadcast_job(conn, job)
        else:
            (push_malformed if job.get("fault") else push)(conn, job)
