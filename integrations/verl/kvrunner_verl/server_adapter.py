"""verl's ``ServerAdapter`` for kvrunner: what a trainer-side process (a trainer
rank, or verl's checkpoint-engine worker) calls to wake, free and update a replica.

``update_weights`` packs the ``(name, tensor)`` stream into buckets of
``checkpoint_engine.update_weights_bucket_megabytes``. From the replica's own node
they go through a ``kvrunner.weight_sync.BucketSender`` in shared memory (two
buffers, each bucket acknowledged once the engine's copy is done); from another node,
each bucket goes through Ray's object store (moved to the CPU on the way). The
replica must not be generating meanwhile: verl aborts (partial rollouts) or sleeps
it first.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from kvrunner_verl.replica import server_name


class ServerAdapter(BaseRollout):
    """Talks to replica ``replica_rank``'s server (unset: from ``RANK`` and the
    rollout world size, as verl lays ranks out)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None,
                 replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        world = self.config.tensor_model_parallel_size
        rank = int(os.environ.get("RANK", 0))
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        #: only the replica's first rank talks to its server
        self.is_leader_rank = replica_rank != -1 or rank % world == 0
        self._server: Any = None

    def _handle(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        """Bring ``tags`` (``weights``, ``kv_cache``) back."""
        if self.is_leader_rank:
            await self._handle().wake_up.remote(tags)

    async def release(self) -> None:
        """Free the KV pool."""
        if self.is_leader_rank and self.config.free_cache_engine:
            await self._handle().sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                             global_steps: int | None = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """Push full tensors by HF name, bucket by bucket; then outputs report
        ``global_steps``."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"kvrunner-verl takes wire_format='named_tensors', "
                                      f"not {wire_format!r}")
        if not self.is_leader_rank:
            for _ in weights:  # the stream is consumed on every rank
                pass
            return
        server = self._handle()
        limit = self.config.checkpoint_engine.update_weights_bucket_megabytes << 20
        if await server.node_id.remote() == ray.get_runtime_context().get_node_id():
            await self._push_by_ipc(server, weights, limit, global_steps)
            return
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in weights:
            bucket.append((name, tensor.detach().to("cpu")))
            size += tensor.numel() * tensor.element_size()
            if size >= limit:
                await server.load_weight_bucket.remote(ray.put(bucket), global_steps)
                bucket, size = [], 0
        if bucket:
            await server.load_weight_bucket.remote(ray.put(bucket), global_steps)
        await server.finish_weight_update.remote(global_steps)

    async def _push_by_ipc(self, server: Any, weights: Iterable[tuple[str, torch.Tensor]],
                           bucket_bytes: int, global_steps: int | None) -> None:
        """One push through shared-memory buckets: the server connects while this
        process streams (the sender returns once every tensor is loaded)."""
        from kvrunner.weight_sync import BucketSender

        with BucketSender(device="cpu", bucket_bytes=bucket_bytes) as sender:
            receiving = server.update_weights_from_ipc.remote(
                sender.address, sender.authkey, global_steps)
            await asyncio.to_thread(sender.push, weights)
            await receiving
