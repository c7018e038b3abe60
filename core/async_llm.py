"""The asyncio front of the engine, shaped as RL frameworks drive a rollout server.

::

    async with AsyncLLM("tiny-qwen3") as llm:
        out = await llm.generate([1, 2, 3], SamplingParams(max_tokens=8, seed=0))
        async for delta in llm.generate_stream("Hello", SamplingParams(max_tokens=8)):
            print(delta.text, end="")
        await llm.pause("keep")            # partial rollouts park with their KV
        await llm.update_weights(state_dict, weight_version="step-12")
        await llm.resume()                 # they continue on the new weights
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs

from kvrunner.async_engine.delta import StreamDelta
from kvrunner.async_engine.engine_loop import Command, EngineLoop
from kvrunner.async_engine.errors import EngineBusyError, EngineClosedError, EngineDeadError
from kvrunner.async_engine.handoff import Channel, Reply
from kvrunner.async_engine.stats import EngineStats
from kvrunner.engine.llm_engine import group_size
from kvrunner.errors import RequestError
from kvrunner.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from kvrunner.llm import LLM
    from kvrunner.outputs import RequestOutput
    from kvrunner.rl.sleep_state import CacheInfo

Prompt = str | Seq[int]


class AsyncLLM:
    """An ``LLM`` served to many concurrent asyncio callers.

    One engine thread owns the ``LLM`` and is the only thread that touches it
    (``async_engine/engine_loop.py``): every method here queues a command for it and
    awaits the answer, which comes back through ``loop.call_soon_threadsafe``. The
    thread steps while any request can progress and blocks on its queue otherwise.
    Measured on a shared 2-core CPU (tiny-qwen3, 8 concurrent greedy requests of 128
    tokens, one intra-op thread), a step took 1.77-1.95 ms through the thread and
    1.72-2.09 ms through ``LLM.generate``: the thread's cost was below the run-to-run
    noise of about 0.2 ms per step.

    Tokens and logprobs equal the synchronous ``LLM``'s for the same weights and
    seeds: a request with ``SamplingParams.seed`` draws the same whatever else runs.
    A request without one is keyed by the engine's seed and the engine's request
    number, which counts every request submitted to this engine, from 0, in
    submission order, as ``LLM.generate`` numbers its prompts (so a fresh ``LLM``
    given the same requests in the same order draws the same tokens). Logprobs agree
    to float rounding across batch compositions (CPU matrix products are not
    bit-identical across batch sizes), as they do for ``LLM.generate`` itself.

    Rules for calls while requests are live (see ``engine_loop.py``): ``sleep``
    needs no request in the engine (``pause("abort")`` / ``pause("wait")`` or a
    drain first); ``update_weights``, ``load_weights`` and ``reset_prefix_cache``
    need a pause (or no requests) and keep requests parked by ``pause("keep")``
    intact; ``wake_up`` and ``cache_info`` are always allowed. A refusal is an
    :class:`~kvrunner.errors.EngineBusyError` and changes nothing.

    :param model: as for :class:`~kvrunner.LLM` (with ``dtype``, ``config_file`` and
        the flat ``config`` overrides); the ``LLM`` is built here, in the caller's
        thread, and shut down by :meth:`shutdown`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | None = None,
        config_file: str | Path | None = None,
        **config: Any,
    ) -> None:
        from kvrunner.llm import LLM

        self._attach(LLM(model, dtype=dtype, config_file=config_file, **config), owns_llm=True)

    @classmethod
    def from_llm(cls, llm: LLM) -> AsyncLLM:
        """Serve an existing, idle ``LLM`` (tests; an engine built by a TP launcher).

        The caller keeps the ``LLM``: :meth:`shutdown` stops the engine thread and
        leaves it idle and usable synchronously again. Until then only the engine
        thread may touch it.
        """
        self = cls.__new__(cls)
        self._attach(llm, owns_llm=False)
        return self

    def _attach(self, llm: LLM, *, owns_llm: bool) -> None:
        if llm.engine.has_unfinished():
            raise EngineBusyError("AsyncLLM.from_llm: the LLM has unfinished requests")
        self.config = llm.config
        self.tokenizer = llm.tokenizer
        self.default_sampling_params: SamplingParams = llm.default_sampling_params
        self.model_name: str = str(llm.config.model)
        described = llm.executor.describe_ranks()[0]
        #: the dtype the ranks resolved (``bfloat16``, ``float32`` ...), read once
        self.dtype: str = described["dtype"]
        #: the device of rank 0 (``cpu``, ``cuda:0`` ...), read once
        self.device: str = described["device"]
        self._engine = EngineLoop(llm, owns_llm=owns_llm)

    # -- requests ------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Generate for one prompt (text or token ids); returns its output when it ends.

        Raises :class:`~kvrunner.errors.RequestError` for a bad prompt or params (or
        an id already live), before anything is queued. Cancelling the awaiting task
        aborts the request. An aborted request returns with finish reason
        ``"abort"`` and the tokens it had. ``cache_salt`` scopes its prefix-cache
        hits to requests of the same salt (vLLM's field; see ``LLM.generate``).
        """
        params = self._params(params, "generate")
        request_id, channel = await self._start(prompt, params, request_id, stream=False,
                                                cache_salt=cache_salt)
        try:
            item = await channel.queue.get()
        except asyncio.CancelledError:
            self._abort_soon(request_id, channel)
            raise
        if isinstance(item, BaseException):
            raise item
        return item.output

    async def generate_stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Yield the request's output as it grows, one :class:`StreamDelta` per engine
        step that gave it tokens; the last has ``finish_reason`` and ``output``.

        Leaving the iteration early (``break``, cancellation, ``aclose()``) aborts
        the request; wrap it in ``contextlib.aclosing`` for the abort to happen at
        once rather than when the generator is collected. ``cache_salt`` as for
        :meth:`generate`.
        """
        params = self._params(params, "generate_stream")
        request_id, channel = await self._start(prompt, params, request_id, stream=True,
                                                cache_salt=cache_salt)
        ended = False
        try:
            while True:
                item = await channel.queue.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                ended = item.finish_reason is not None
                yield item
                if ended:
                    return
        finally:
            if not ended:
                self._abort_soon(request_id, channel)

    async def generate_group(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """The ``params.n`` samples of one prompt, in sample order: sample ``k`` is
        drawn with ``params.for_sample(k)`` under the id ``<request_id>-<k>`` (each
        abortable alone) and shares the prompt's KV, as ``LLM.generate`` does.
        Cancelling the call aborts every sample. ``cache_salt`` as for
        :meth:`generate`, on every sample."""
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"generate_group: params must be a SamplingParams, got {type(params).__name__}"
            )
        base = self._request_id(request_id)
        ids = [f"{base}-{k}" for k in range(group_size(params))]
        loop = asyncio.get_running_loop()
        channels = [Channel(loop) for _ in ids]
        await self._add(ids, prompt, params, channels, stream=False, cache_salt=cache_salt)
        outputs = []
        try:
            for k, channel in enumerate(channels):
                item = await channel.queue.get()
                if isinstance(item, BaseException):
                    raise item
                outputs.append(attrs.evolve(item.output, sample_index=k))
        except BaseException:
            for request_id_k, channel in zip(ids[len(outputs) :], channels[len(outputs) :],
                                             strict=True):  # fmt: skip
                self._abort_soon(request_id_k, channel)
            raise
        return outputs

    def _params(self, params: SamplingParams | None, what: str) -> SamplingParams:
        if params is None:
            params = self.default_sampling_params
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"{what}: params must be a SamplingParams, got {type(params).__name__}"
            )
        if group_size(params) > 1:
            raise RequestError(
                f"{what}: SamplingParams.n = {params.n} asks for several samples; use "
                f"generate_group(), which returns one output per sample"
            )
        return params

    @staticmethod
    def _request_id(request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}")
        return request_id

    async def _start(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None, *, stream: bool,
        cache_salt: str | None,
    ) -> tuple[str, Channel]:
        request_id = self._request_id(request_id)
        channel = Channel(asyncio.get_running_loop())
        await self._add([request_id], prompt, params, [channel], stream=stream,
                        cache_salt=cache_salt)
        return request_id, channel

    async def _add(
        self, ids: list[str], prompt: Prompt, params: SamplingParams, channels: list[Channel],
        *, stream: bool, cache_salt: str | None = None,
    ) -> None:
        try:
            await self._call(self._engine.add(ids, prompt, params, channels, stream,
                                              cache_salt))
        except asyncio.CancelledError:
            for request_id, channel in zip(ids, channels, strict=True):
                self._abort_soon(request_id, channel)
            raise

    def _abort_soon(self, request_id: str, channel: Channel) -> None:
        """Abort from a cancelled awaiter, without waiting (only the request that
        answers to ``channel``: the id may have been refused as a duplicate)."""
        with contextlib.suppress(EngineClosedError):  # shut down: every request was aborted
            self._engine.submit(self._engine.abort(request_id, channel), Reply(None, None))

    async def abort(self, request_id: str) -> bool:
        """End a request with finish reason ``"abort"`` and the tokens it had; False
        if no request with that id is live."""
        return await self._call(self._engine.abort(request_id))

    async def abort_all(self) -> int:
        """Abort every live request (held ones too); returns how many."""
        return await self._call(self._engine.abort_all())

    # -- pause / resume ------------------------------------------------------------------

    async def pause(self, mode: Literal["abort", "keep", "retract", "wait"] = "abort") -> None:
        """Stop generating; new requests are held (not refused) until :meth:`resume`.

        - ``"abort"``: every live request ends with finish reason ``"abort"``.
        - ``"keep"``: running requests park with their KV blocks and state slots
          (nothing is recomputed) and continue after ``resume()``, also across a
          weight update; returns once no step is in flight.
        - ``"retract"``: running requests go back to the queue with their KV blocks
          and state slots freed; after ``resume()`` each is recomputed from its prompt
          and the tokens it has, so a weight update in between applies to its whole
          context. Returns once no step is in flight.
        - ``"wait"``: requests already submitted run to their end; returns then.
        """
        await self._call(self._engine.pause(mode))

    async def resume(self) -> None:
        """Continue parked requests and admit the held ones. Raises
        :class:`~kvrunner.errors.SleepStateError` (still paused) if there are any
        and the engine cannot serve them (asleep, weights not all pushed)."""
        await self._call(self._engine.resume())

    @property
    def is_paused(self) -> bool:
        return self._engine.stats.paused

    async def wait_for_requests_to_drain(self, timeout: float | None = None) -> None:
        """Return once no request is live; ``TimeoutError`` after ``timeout`` seconds."""
        await asyncio.wait_for(self._call(self._engine.wait_drained()), timeout)

    # -- what the engine serves ------------------------------------------------------------

    async def sleep(self, level: int = 1, **kwargs: Any) -> float:
        """``LLM.sleep`` (``discard_weights=``...) on the engine thread; refused while
        any request is in the engine. Returns seconds."""
        llm = self._engine.llm
        return await self._call(self._engine.call(
            "sleep", "empty", lambda: llm.sleep(level, **kwargs)))  # fmt: skip

    async def wake_up(self, tags: Iterable[str] | str | None = None) -> float:
        """``LLM.wake_up(tags)`` on the engine thread; returns seconds."""
        llm = self._engine.llm
        return await self._call(self._engine.call("wake_up", "any", lambda: llm.wake_up(tags)))

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        weight_version: str | int | None = None,
        **kwargs: Any,
    ) -> int:
        """``LLM.update_weights`` on the engine thread, then the served version becomes
        ``weight_version`` (unset: the count of updates so far, 1, 2, ...), recorded
        on every live request; refused while requests run unpaused. Returns how many
        tensors were loaded. ``reset_prefix_cache=False`` keeps the prefix cache (see
        ``LLM.update_weights``)."""
        llm = self._engine.llm

        def push() -> int:
            loaded = llm.update_weights(weights, weight_version=weight_version, **kwargs)
            self._engine.weights_changed()
            return loaded

        return await self._call(self._engine.call("update_weights", "quiet", push))

    async def update_weights_from_ipc(
        self,
        address: tuple[str, int] | str,
        *,
        authkey: bytes,
        weight_version: str | int | None = None,
        **kwargs: Any,
    ) -> int:
        """``LLM.update_weights_from_ipc`` (one whole push from a trainer's
        ``BucketSender``) on the engine thread, versioned and refused as
        :meth:`update_weights`."""
        llm = self._engine.llm

        def push() -> int:
            loaded = llm.update_weights_from_ipc(address, authkey=authkey,
                                                 weight_version=weight_version, **kwargs)
            self._engine.weights_changed()
            return loaded

        return await self._call(self._engine.call("update_weights", "quiet", push))

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str | bytes], load_format: str | None = None,
        *, weight_version: str | int | None = None, **kwargs: Any,
    ) -> int:
        """``LLM.update_weights_from_tensor`` (SGLang's payloads, each rank opening its
        own entry) on the engine thread, versioned and refused as
        :meth:`update_weights`."""
        llm = self._engine.llm

        def push() -> int:
            loaded = llm.update_weights_from_tensor(serialized_named_tensors, load_format,
                                                    weight_version=weight_version, **kwargs)
            self._engine.weights_changed()
            return loaded

        return await self._call(self._engine.call("update_weights", "quiet", push))

    async def update_weights_from_ipc_handles(
        self, names: list[str], dtype_names: list[str], shapes: list[list[int]],
        ipc_handles: Any = None, *, weight_version: str | int | None = None, **kwargs: Any,
    ) -> int:
        """``LLM.update_weights_from_ipc_handles`` (vLLM's CUDA IPC handles, each rank
        opening those of its own GPU) on the engine thread, refused as
        :meth:`update_weights`; versioned unless it is a part of an open update (whose
        :meth:`finish_weight_update` moves the version)."""
        llm = self._engine.llm

        def push() -> int:
            loaded = llm.update_weights_from_ipc_handles(
                names, dtype_names, shapes, ipc_handles, weight_version=weight_version,
                **kwargs)
            self._engine.weights_changed()
            return loaded

        return await self._call(self._engine.call("update_weights", "quiet", push))

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        **kwargs: Any) -> None:
        """``LLM.init_weights_update_group`` on the engine thread (between steps)."""
        llm = self._engine.llm
        await self._call(self._engine.call("init_weights_update_group", "any", lambda:
            llm.init_weights_update_group(master_address, master_port, rank_offset,
                                          world_size, **kwargs)))

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
        weight_version: str | int | None = None, packed_bytes: int | None = None,
        reset_prefix_cache: bool = True,
    ) -> int:
        """``LLM.update_weights_from_distributed`` on the engine thread, refused as
        :meth:`update_weights`; versioned unless it is a part of an open update (whose
        :meth:`finish_weight_update` moves the version)."""
        llm = self._engine.llm

        def push() -> int:
            loaded = llm.update_weights_from_distributed(
                names, dtypes, shapes, packed_bytes=packed_bytes,
                weight_version=weight_version, reset_prefix_cache=reset_prefix_cache)
            self._engine.weights_changed()
            return loaded

        return await self._call(self._engine.call("update_weights", "quiet", push))

    async def start_weight_update(self) -> None:
        """``LLM.start_weight_update`` on the engine thread, refused while requests run
        unpaused (parked ones wait for the end of the update)."""
        await self._call(self._engine.call("start_weight_update", "quiet",
                                           self._engine.llm.start_weight_update))

    async def finish_weight_update(self, *, weight_version: str | int | None = None) -> None:
        """``LLM.finish_weight_update`` on the engine thread; the served version becomes
        ``weight_version`` (unset: the count of updates so far)."""
        llm = self._engine.llm

        def finish() -> None:
            llm.finish_weight_update(weight_version=weight_version)
            self._engine.weights_changed()

        await self._call(self._engine.call("finish_weight_update", "any", finish))

    async def destroy_weights_update_group(self) -> None:
        """``LLM.destroy_weights_update_group`` on the engine thread."""
        llm = self._engine.llm
        await self._call(self._engine.call("destroy_weights_update_group", "any",
                                           llm.destroy_weights_update_group))

    async def weights_checksum(self) -> dict[str, str]:
        """``LLM.weights_checksum()`` from the engine thread (between steps)."""
        return await self._call(self._engine.call("weights_checksum", "any",
                                                  self._engine.llm.weights_checksum))

    async def load_weights(
        self, path: str | Path, *, weight_version: str | int | None = None, **kwargs: Any
    ) -> int:
        """``LLM.load_weights(path)`` on the engine thread, versioned as
        :meth:`update_weights`."""
        llm = self._engine.llm

        def load() -> int:
            loaded = llm.load_weights(path, weight_version=weight_version, **kwargs)
            self._engine.weights_changed()
            return loaded

        return await self._call(self._engine.call("load_weights", "quiet", load))

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (refused while requests run unpaused); returns
        how many blocks were uncached."""
        llm = self._engine.llm
        return await self._call(self._engine.call(
            "reset_prefix_cache", "quiet", llm.reset_prefix_cache))  # fmt: skip

    async def cache_info(self) -> CacheInfo:
        """``LLM.cache_info()``, from the engine thread."""
        return await self._call(self._engine.call("cache_info", "any", self._engine.llm.cache_info))

    def stats(self) -> EngineStats:
        """The counters as of the last step or command; never waits for the loop."""
        return self._engine.stats

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine can serve nothing more (a rank died, the engine thread
        failed), or None while it serves; once set, every call raises it."""
        return self._engine.dead

    @property
    def errored(self) -> bool:
        """Whether the engine is dead (:attr:`dead_error`), as vLLM's engine client
        names it."""
        return self._engine.dead is not None

    @property
    def weight_version(self) -> str | int:
        return self._engine.stats.weight_version

    # -- lifetime ------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Abort every live request, stop the engine thread and (unless built by
        :meth:`from_llm`) release the model. Idempotent; later calls raise
        :class:`~kvrunner.errors.EngineClosedError`."""
        with contextlib.suppress(EngineClosedError):  # stopped already
            await self._call(self._engine.stop())
        await asyncio.to_thread(self._engine.join)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def _call(self, command: Command) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._engine.submit(command, Reply(loop, future))
        return await future
