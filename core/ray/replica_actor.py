"""An engine replica's rank 0 as a Ray actor: the ``AsyncLLM`` of the replica.

The actor is asynchronous (its methods run on one asyncio loop), so it serves many
requests at once; the engine itself runs on the ``AsyncLLM``'s engine thread. With
``tensor_parallel_size > 1`` it also serves its group's rendezvous store and runs
the engine over a :class:`~kvrunner.runner.ranks.broadcast_executor.BroadcastExecutor`,
the other ranks being :class:`~kvrunner.ray.rank_actor.EngineRank` actors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from kvrunner.ray.rank_setup import RankSpec, node_address, prepare_process

if TYPE_CHECKING:
    import torch

    from kvrunner.async_engine.stats import EngineStats
    from kvrunner.async_llm import AsyncLLM, Prompt
    from kvrunner.llm import LLM
    from kvrunner.outputs import RequestOutput
    from kvrunner.rl.sleep_state import CacheInfo
    from kvrunner.sampling_params import SamplingParams


class EngineReplica:
    """Rank 0 of one replica (plain class: the fleet makes it a Ray actor)."""

    def __init__(self, spec: RankSpec, index: int) -> None:
        self.spec = spec
        self.index = index
        self._store: Any = None
        self._llm: LLM | None = None
        self._engine: AsyncLLM | None = None

    # -- start-up ------------------------------------------------------------------------

    async def node_address(self) -> str:
        """The IP address of this actor's node."""
        return node_address()

    async def open_store(self, host: str) -> int:
        """Serve the group's rendezvous store on ``host`` (a free port); returns it."""
        from kvrunner.distributed.group import connect_store

        timeout_s = self.spec.engine_config().parallel.distributed_timeout_s
        self._store = connect_store(host, 0, timeout_s=timeout_s, is_master=True)
        return self._store.port

    async def start(self, *, loopback: bool) -> dict[str, Any]:
        """Load the model (joining the group with the other ranks, which are being
        started meanwhile) and start serving; returns what the replica serves."""
        await asyncio.to_thread(self._build, loopback)
        engine = self._live()
        info = await engine.cache_info()
        return {"num_blocks": info.num_blocks, "weight_version": engine.weight_version,
                "tensor_parallel_size": self.spec.tensor_parallel_size}

    def _build(self, loopback: bool) -> None:
        from kvrunner import process_heap
        from kvrunner.async_llm import AsyncLLM
        from kvrunner.launch import join_group
        from kvrunner.llm import LLM

        prepare_process(self.spec, loopback=loopback)
        if self.spec.tensor_parallel_size == 1:
            self._llm = LLM(self.spec.model, **self.spec.config)
        else:
            cfg = self.spec.engine_config()
            self._llm = join_group(cfg, store=self._store, rank=0,
                                   world=self.spec.tensor_parallel_size, local_rank=0)
        self._engine = AsyncLLM.from_llm(self._llm)
        process_heap.freeze_started_heap()  # the actor's process is the replica's own

    def _live(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError(f"replica {self.index} is not started (or was shut down)")
        return self._engine

    # -- requests --------------------------------------------------------------------------

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str
    ) -> RequestOutput:
        """``AsyncLLM.generate`` on this replica."""
        return await self._live().generate(prompt, params, request_id)

    async def abort(self, request_id: str) -> bool:
        """``AsyncLLM.abort``: False if no request with that id is live here."""
        return await self._live().abort(request_id)

    async def abort_all(self) -> int:
        """``AsyncLLM.abort_all``; returns how many were aborted."""
        return await self._live().abort_all()

    # -- control -------------------------------------------------------------------------

    async def pause(self, mode: Literal["abort", "keep", "wait"]) -> None:
        """``AsyncLLM.pause(mode)``."""
        await self._live().pause(mode)

    async def resume(self) -> None:
        """``AsyncLLM.resume()``."""
        await self._live().resume()

    async def wait_for_requests_to_drain(self, timeout: float | None) -> None:
        """``AsyncLLM.wait_for_requests_to_drain(timeout)``."""
        await self._live().wait_for_requests_to_drain(timeout)

    async def sleep(self, level: int, kwargs: dict[str, Any]) -> float:
        """``AsyncLLM.sleep(level, **kwargs)``; seconds."""
        return await self._live().sleep(level, **kwargs)

    async def wake_up(self, tags: Iterable[str] | str | None) -> float:
        """``AsyncLLM.wake_up(tags)``; seconds."""
        return await self._live().wake_up(tags)

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        weight_version: str | int | None,
        kwargs: dict[str, Any],
    ) -> int:
        """``AsyncLLM.update_weights``; how many tensors were loaded."""
        return await self._live().update_weights(
            weights, weight_version=weight_version, **kwargs)  # fmt: skip

    async def update_weights_from_ipc(
        self, address: tuple[str, int] | str, authkey: bytes, weight_version: str | int | None
    ) -> int:
        """``AsyncLLM.update_weights_from_ipc``: one whole push from a trainer's
        ``kvrunner.weight_sync.BucketSender`` on this node; tensors loaded."""
        return await self._live().update_weights_from_ipc(
            address, authkey=authkey, weight_version=weight_version)  # fmt: skip

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        kwargs: dict[str, Any],
    ) -> None:
        """``AsyncLLM.init_weights_update_group``: every rank of this replica joins the
        group as ``rank_offset + rank``; returns once the whole group has formed."""
        await self._live().init_weights_update_group(
            master_address, master_port, rank_offset, world_size, **kwargs)  # fmt: skip

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]],
        weight_version: str | int | None,
    ) -> int:
        """``AsyncLLM.update_weights_from_distributed``: receive one broadcast per
        tensor from the group's rank 0; tensors loaded."""
        return await self._live().update_weights_from_distributed(
            names, dtypes, shapes, weight_version=weight_version)  # fmt: skip

    async def destroy_weights_update_group(self) -> None:
        """``AsyncLLM.destroy_weights_update_group`` (idempotent)."""
        await self._live().destroy_weights_update_group()

    async def weights_checksum(self) -> dict[str, str]:
        """``AsyncLLM.weights_checksum()``: per-tensor digests, shards merged."""
        return await self._live().weights_checksum()

    async def reset_prefix_cache(self) -> int:
        """``AsyncLLM.reset_prefix_cache()``; blocks uncached."""
        return await self._live().reset_prefix_cache()

    async def cache_info(self) -> CacheInfo:
        """``AsyncLLM.cache_info()``."""
        return await self._live().cache_info()

    async def stats(self) -> EngineStats:
        """``AsyncLLM.stats()``: requests running and waiting, blocks, steps."""
        return self._live().stats()

    async def weight_version(self) -> str | int:
        """The version of the weights this replica serves."""
        return self._live().weight_version

    async def shutdown(self) -> None:
        """Abort every request, stop the engine thread and release the model (and
        with it the other ranks of the group). Idempotent."""
        engine, llm = self._engine, self._llm
        self._engine = self._llm = None
        if engine is not None:
            await engine.shutdown()
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
