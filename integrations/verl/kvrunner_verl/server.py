"""The rollout server verl talks to: one replica's rank 0 as a Ray actor, with the
methods verl's replica, client and load balancer call (token in, token out).

It holds a :class:`kvrunner.ray.EngineReplica` (the replica's ``AsyncLLM``); ranks > 0
are :class:`kvrunner.ray.EngineRank` actors started beside it.

- ``abort_all_requests`` pauses with ``"abort"``: every live request ends with the
  tokens it had (``stop_reason="aborted"``, a partial rollout verl's
  ``FullyAsyncLLMServerClient`` resumes), and requests arriving meanwhile wait for
  ``resume_generation`` (or, with ``reject_request=True``, come back aborted at once).
- Weights arrive by IPC buckets from a ``BucketSender`` in the trainer's process
  (``update_weights_from_ipc``: CUDA IPC on the same GPU, shared memory on the
  same node), or from another node bucket by bucket through Ray's object store
  (``load_weight_bucket``, then ``finish_weight_update``). Either way outputs then
  report the push's ``global_steps``; ``last_weight_update`` says which path the
  last push took.
- ``sleep`` frees what the layout (``mode``, verl's ``RolloutMode`` value) lets
  go: in ``hybrid`` the KV pool and the weights, discarded (the trainer pushes new
  ones before the next rollout); in ``colocated`` both, the weights kept in host
  memory (no push comes); in ``standalone`` the KV pool only.
"""

from __future__ import annotations

from typing import Any, Literal

from kvrunner.ray.rank_setup import RankSpec
from kvrunner.ray.replica_actor import EngineReplica

#: what ``sleep`` frees in each layout: (level, kwargs of ``AsyncLLM.sleep``)
_SLEEP: dict[str, tuple[int, dict[str, Any]]] = {
    "hybrid": (2, {"discard_weights": True}),
    "colocated": (2, {"discard_weights": False}),
    "standalone": (1, {}),
}


class KvrunnerServer:
    """Rank 0 of a kvrunner replica, serving verl (the replica makes it a Ray actor)."""

    def __init__(self, spec: RankSpec, replica_rank: int, *, default_max_tokens: int,
                 free_cache_engine: bool, mode: str = "standalone",
                 routing_replay: bool = False) -> None:
        if mode not in _SLEEP:
            raise ValueError(f"mode={mode!r}: one of {sorted(_SLEEP)} (verl's RolloutMode)")
        self.replica = EngineReplica(spec, replica_rank)
        self.default_max_tokens = default_max_tokens
        self.free_cache_engine = free_cache_engine
        self.mode = mode
        #: every request returns its routed experts (verl's enable_rollout_routing_replay)
        self.routing_replay = routing_replay
        self.global_steps: int | None = None
        self._rejecting = False
        self._last_update: dict[str, Any] | None = None
        self._bucket_tensors = 0  # loaded by load_weight_bucket since the last finish

    # -- start-up, as kvrunner.ray.start_replica drives it --------------------------------

    async def node_address(self) -> str:
        return await self.replica.node_address()

    async def open_store(self, host: str) -> int:
        return await self.replica.open_store(host)

    async def start(self, *, loopback: bool) -> dict[str, Any]:
        return await self.replica.start(loopback=loopback)

    # -- requests --------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> Any:
        """Generate for ``prompt_ids``; verl's ``TokenOutput`` (``extra_fields`` holds
        ``global_steps``; ``routed_experts`` the ``[prompt + output - 1, layers, top_k]``
        expert ids under routing replay). Multimodal inputs are refused (text models
        only)."""
        from kvrunner.errors import RequestError
        from kvrunner_verl.requests import sampling_params as to_params
        from kvrunner_verl.requests import token_output

        if any(x is not None for x in (image_data, video_data, audio_data)) or kwargs:
            raise RequestError("kvrunner serves token prompts only (no multimodal inputs, "
                               f"no {sorted(kwargs)})")
        if self._rejecting:
            from verl.workers.rollout.replica import TokenOutput

            return TokenOutput(token_ids=[], stop_reason="aborted",
                               extra_fields={"global_steps": self.global_steps})
        params = to_params(sampling_params, default_max_tokens=self.default_max_tokens,
                           routed_experts=self.routing_replay)
        out = await self.replica.generate(list(prompt_ids), params, request_id)
        return token_output(out, global_steps=self.global_steps)

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True
                            ) -> dict[str, Any]:
        """End one request with the tokens it had."""
        return {"aborted": await self.replica.abort(request_id), "request_id": request_id}

    async def abort_all_requests(self, reset_prefix_cache: bool = True,
                                 reject_request: bool = False) -> dict[str, Any]:
        """Abort every live request and stay paused until :meth:`resume_generation`."""
        self._rejecting = reject_request
        live = await self.replica.abort_all()
        await self.replica.pause("abort")
        if reset_prefix_cache:
            await self.replica.reset_prefix_cache()
        return {"aborted_count": live}

    async def resume_generation(self) -> None:
        """Admit requests again (those held while paused first)."""
        self._rejecting = False
        await self.replica.resume()

    async def wait_for_requests_to_drain(self) -> None:
        await self.replica.wait_for_requests_to_drain(None)

    # -- memory and weights ----------------------------------------------------------------

    async def sleep(self) -> None:
        """Free what the layout lets go (module docstring), if ``free_cache_engine``;
        requests must have drained."""
        if self.free_cache_engine:
            level, kwargs = _SLEEP[self.mode]
            await self.replica.sleep(level, kwargs)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.replica.wake_up(tags)

    async def release_kv_cache(self) -> None:
        """Free the KV pool only (weights stay for a push into them)."""
        if self.free_cache_engine:
            await self.replica.sleep(1, {})

    async def resume_kv_cache(self) -> None:
        await self.replica.wake_up(["kv_cache"])

    async def clear_kv_cache(self) -> None:
        """Forget every cached prefix."""
        await self.replica.reset_prefix_cache()

    async def engine_stats(self) -> Any:
        """The engine's counters (``kvrunner.AsyncLLM.stats()``: requests running and
        waiting, KV blocks, steps), for a caller that watches the replica's load."""
        return await self.replica.stats()

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def load_weight_bucket(self, pairs: list[tuple[str, Any]],
                                 global_steps: int | None) -> int:
        """Load one bucket of ``(HF name, full tensor)`` pairs (a pause, or no
        requests, first); the weights are ``partial`` (nothing is served) until every
        tensor has come. Each bucket is one ``AsyncLLM.update_weights`` call, so the
        prefix cache is reset (and, on CUDA, the graphs recaptured) per bucket."""
        loaded = await self.replica.update_weights(pairs, global_steps, {})
        self._bucket_tensors += loaded
        return loaded

    async def update_weights_from_ipc(self, address: Any, authkey: bytes,
                                      global_steps: int | None, *,
                                      path: Literal["cuda_ipc", "shared_memory"]) -> int:
        """Receive one whole push from a ``BucketSender`` on this node (shared-memory
        or CUDA-IPC buckets, each acknowledged once copied; ``path`` names which, for
        :meth:`last_weight_update`); tensors loaded."""
        loaded = await self.replica.update_weights_from_ipc(address, authkey, global_steps)
        if global_steps is not None:
            self.global_steps = global_steps
        self._last_update = {"path": path, "loaded": loaded, "global_steps": global_steps}
        return loaded

    async def last_weight_update(self) -> dict[str, Any] | None:
        """The last push: ``path`` (``"cuda_ipc"``, ``"shared_memory"`` or
        ``"object_store"``), tensors ``loaded``, its ``global_steps``; None before
        any."""
        return None if self._last_update is None else dict(self._last_update)

    async def device_uuid(self) -> str | None:
        """The UUID of this server's GPU (None on the CPU): a trainer on the same
        card pushes by CUDA IPC."""
        import torch

        if not torch.cuda.is_available():
            return None
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    async def node_id(self) -> str:
        """The Ray node this server runs on (a push from the same node goes by IPC)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def finish_weight_update(self, global_steps: int | None) -> None:
        """Report ``global_steps`` in every output from now on."""
        if global_steps is not None:
            self.global_steps = global_steps
        if self._bucket_tensors:
            self._last_update = {"path": "object_store", "loaded": self._bucket_tensors,
                                 "global_steps": global_steps}
            self._bucket_tensors = 0

    async def start_profile(self, **kwargs: Any) -> None:
        """No profiler: a no-op verl may call."""

    async def stop_profile(self) -> None:
        """No profiler: a no-op verl may call."""

    async def shutdown(self) -> None:
        await self.replica.shutdown()
