"""verl's ``ServerAdapter`` for kvrunner: what a trainer-side process calls to wake,
free and update a replica. In the hybrid layout it lives in the trainer worker
(verl's ``ActorRolloutRefWorker`` builds it as its ``rollout``); elsewhere in
verl's ``CheckpointEngineWorker`` or any process that names a replica.

``update_weights`` streams the ``(name, full tensor)`` pairs to the replica's
server in buckets of ``checkpoint_engine.update_weights_bucket_megabytes``, by the
nearest path:

* **CUDA IPC** when this process's GPU is the server's (the hybrid layout on GPUs):
  a ``kvrunner.weight_sync.BucketSender`` with two buckets on that GPU, the server
  copying each out and acknowledging it once the copy is done.
* **shared memory** on the server's node otherwise (the hybrid layout on the CPU, a
  trainer on another GPU of the node): the same protocol, buckets in host memory.
* **Ray's object store** from another node: one ``load_weight_bucket`` per bucket.

Only the replica's first rank pushes; the others iterate the stream (gathering a
DTensor is a collective every rank joins). The replica must not be generating
meanwhile: verl aborts it (partial rollouts) or puts it to sleep first.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner_verl.replica import server_name


def _device_uuid() -> str | None:
    """This process's current GPU's UUID (None without one)."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


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
        """Free what the replica's layout lets go (``KvrunnerServer.sleep``)."""
        if self.is_leader_rank and self.config.free_cache_engine:
            await self._handle().sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                             global_steps: int | None = None,
                             wire_format: str = "named_tensors", *,
                             peft_config: Any = None, base_sync_done: bool = True,
                             **kwargs: Any) -> None:
        """Push full tensors by HF name (module docstring for the path); outputs then
        report ``global_steps``. ``peft_config`` (a LoRA adapter) and other wire
        formats are refused: kvrunner takes merged full weights."""
        from kvrunner.weight_sync import gathered

        if wire_format != "named_tensors":
            raise WeightSyncError(f"kvrunner-verl takes wire_format='named_tensors', "
                                  f"not {wire_format!r}")
        if peft_config is not None:
            raise WeightSyncError("kvrunner-verl takes merged weights, not a LoRA adapter: "
                                  "set actor_rollout_ref.model.lora.merge=True")
        if kwargs:
            raise WeightSyncError(f"kvrunner-verl's update_weights does not take {sorted(kwargs)}")
        if not self.is_leader_rank:
            for _ in gathered(weights):  # the stream is consumed on every rank
                pass
            return
        server = self._handle()
        limit = self.config.checkpoint_engine.update_weights_bucket_megabytes << 20
        node, uuid = await asyncio.gather(server.node_id.remote(), server.device_uuid.remote())
        if node == ray.get_runtime_context().get_node_id():
            mine = _device_uuid()
            device = "cuda" if uuid is not None and uuid == mine else "cpu"
            await self._push_by_ipc(server, weights, device, limit, global_steps)
            return
        await self._push_by_object_store(server, weights, limit, global_steps)

    async def _push_by_ipc(self, server: Any, weights: Iterable[tuple[str, torch.Tensor]],
                           device: str, bucket_bytes: int, global_steps: int | None) -> None:
        """One push through two IPC buckets on ``device`` (``"cuda"``: this process's
        GPU, the server's too; ``"cpu"``: shared memory): the server connects while
        this process streams; the sender returns once every tensor is loaded."""
        from kvrunner.weight_sync import BucketSender

        path = "cuda_ipc" if device == "cuda" else "shared_memory"
        where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu"
        with BucketSender(device=where, bucket_bytes=bucket_bytes) as sender:
            receiving = server.update_weights_from_ipc.remote(
                sender.address, sender.authkey, global_steps, path=path)
            await asyncio.to_thread(sender.push, weights)
            await receiving

    async def _push_by_object_store(self, server: Any,
                                    weights: Iterable[tuple[str, torch.Tensor]],
                                    bucket_bytes: int, global_steps: int | None) -> None:
        """Bucket by bucket through Ray's object store (moved to the CPU on the way);
        each bucket is one engine update."""
        from kvrunner.weight_sync import gathered

        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in gathered(weights):
            bucket.append((name, tensor.to("cpu")))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                await server.load_weight_bucket.remote(ray.put(bucket), global_steps)
                bucket, size = [], 0
        if bucket:
            await server.load_weight_bucket.remote(ray.put(bucket), global_steps)
        await server.finish_weight_update.remote(global_steps)
