"""The rollout server verl talks to: one replica's rank 0 as a Ray actor, with the
methods verl's replica, client and load balancer call (token in, token out).

It holds a :class:`kvrunner.ray.EngineReplica` (the replica's ``AsyncLLM``); ranks > 0
are :class:`kvrunner.ray.EngineRank` actors started beside it.

- ``abort_all_requests`` pauses with ``"abort"``: every live request ends with the
  tokens it had (``stop_reason="aborted"``, a partial rollout verl's
  ``FullyAsyncLLMServerClient`` resumes), and requests arriving meanwhile wait for
  ``resume_generation`` (or, with ``reject_request=True``, come back aborted at once).
- Weights arrive in buckets (``load_weight_bucket``), each loaded as it comes;
  ``finish_weight_update(global_steps)`` sets the ``global_steps`` every output
  reports.
"""

from __future__ import annotations

from typing import Any

from kvrunner.ray.rank_setup import RankSpec
from kvrunner.ray.replica_actor import EngineReplica


class KvrunnerServer:
    """Rank 0 of a kvrunner replica, serving verl (the replica makes it a Ray actor)."""

    def __init__(self, spec: RankSpec, replica_rank: int, *, default_max_tokens: int,
                 free_cache_engine: bool) -> None:
        self.replica = EngineReplica(spec, replica_rank)
        self.default_max_tokens = default_max_tokens
        self.free_cache_engine = free_cache_engine
        self.global_steps: int | None = None
        self._rejecting = False

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
        ``global_steps``). Multimodal inputs are refused (text models only)."""
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
        params = to_params(sampling_params, default_max_tokens=self.default_max_tokens)
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
        """Free the KV pool (``free_cache_engine``); requests must have drained."""
        if self.free_cache_engine:
            await self.replica.sleep(1, {})

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.replica.wake_up(tags)

    async def release_kv_cache(self) -> None:
        await self.sleep()

    async def resume_kv_cache(self) -> None:
        await self.replica.wake_up(["kv_cache"])

    async def clear_kv_cache(self) -> None:
        """Forget every cached prefix."""
        await self.replica.reset_prefix_cache()

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def load_weight_bucket(self, pairs: list[tuple[str, Any]],
                                 global_steps: int | None) -> int:
        """Load one bucket of ``(HF name, full tensor)`` pairs (a pause, or no
        requests, first); the weights are ``partial`` (nothing is served) until every
        tensor has come. Each bucket is one ``AsyncLLM.update_weights`` call, so the
        prefix cache is reset (and, on CUDA, the graphs recaptured) per bucket."""
        return await self.replica.update_weights(pairs, global_steps, {})

    async def update_weights_from_ipc(self, address: Any, authkey: bytes,
                                      global_steps: int | None) -> int:
        """Receive one whole push from a ``BucketSender`` on this node (shared-memory
        or CUDA-IPC buckets, each acknowledged once copied); tensors loaded."""
        loaded = await self.replica.update_weights_from_ipc(address, authkey, global_steps)
        if global_steps is not None:
            self.global_steps = global_steps
        return loaded

    async def node_id(self) -> str:
        """The Ray node this server runs on (a push from the same node goes by IPC)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def finish_weight_update(self, global_steps: int | None) -> None:
        """Report ``global_steps`` in every output from now on."""
        if global_steps is not None:
            self.global_steps = global_steps

    async def start_profile(self, **kwargs: Any) -> None:
        """No profiler: a no-op verl may call."""

    async def stop_profile(self) -> None:
        """No profiler: a no-op verl may call."""

    async def shutdown(self) -> None:
        await self.replica.shutdown()
