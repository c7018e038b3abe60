"""Running a route's requests on the engine: one prompt or several, one sample or ``n``,
whole or streamed; and ending them when the client goes away.

A client that disconnects cancels its requests: the awaiting task is cancelled, and
``AsyncLLM`` aborts a request whose caller was cancelled, so no abandoned request keeps
a batch slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import Request

from kvrunner.engine.llm_engine import group_size
from kvrunner.errors import KvrunnerError
from kvrunner.sampling_params import SamplingParams
from kvrunner.serve.errors import engine_error

#: one request of a call: its prompt's token ids and its sampling parameters
Job = tuple[list[int], SamplingParams]


#: a call's request id (``<id>-<job>`` per job of several), or one id per job
RequestIds = str | Sequence[str]


#: a call's prefix-cache salt (vLLM's ``cache_salt``, SGLang's ``extra_key``): one for
#: every job, or one per job; None for none
Salts = str | None | Sequence[str | None]


def _salt(cache_salt: Salts, index: int) -> str | None:
    if cache_salt is None or isinstance(cache_salt, str):
        return cache_salt
    return cache_salt[index]


def _rid(request_id: RequestIds, jobs: Sequence[Job], index: int) -> str:
    if not isinstance(request_id, str):
        return request_id[index]
    return request_id if len(jobs) == 1 else f"{request_id}-{index}"


async def outputs(engine: Any, jobs: Sequence[Job], request_id: RequestIds,
                  request: Request, cache_salt: Salts = None) -> list[list[Any]]:
    """Every job's outputs (``n`` each), cancelled if the client disconnects.

    :raises RequestError: a prompt or its parameters cannot be served.
    """
    async def one(index: int, ids: list[int], params: SamplingParams) -> list[Any]:
        rid, salt = _rid(request_id, jobs, index), _salt(cache_salt, index)
        if group_size(params) > 1:
            return list(await engine.generate_group(ids, params, request_id=rid,
                                                    cache_salt=salt))
        return [await engine.generate(ids, params, request_id=rid, cache_salt=salt)]

    work = asyncio.ensure_future(
        asyncio.gather(*(one(i, ids, params) for i, (ids, params) in enumerate(jobs)))
    )
    return await _unless_disconnected(work, request)


async def _unless_disconnected(work: asyncio.Future, request: Request) -> Any:
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if not work.done():  # the client left: end its requests
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await work
        raise asyncio.CancelledError("the client disconnected")
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def streams(engine: Any, jobs: Sequence[Job], request_id: RequestIds,
            cache_salt: Salts = None) -> list[AsyncIterator[Any]]:
    """One delta stream per (job, sample), in choice order (job-major)."""
    out = []
    for index, (ids, params) in enumerate(jobs):
        n = group_size(params)
        for k in range(n):
            rid = _rid(request_id, jobs, index) + (f"-{k}" if n > 1 else "")
            sample = params.for_sample(k) if n > 1 else params
            out.append(engine.generate_stream(ids, sample, request_id=rid,
                                              cache_salt=_salt(cache_salt, index)))
    return out


async def merged(sources: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``(choice index, delta)`` from every stream as each comes; the first stream's first
    delta (or its error) is awaited before anything is yielded, so that a request the
    engine refuses fails the HTTP call (a 400) rather than its stream."""
    if len(sources) == 1:
        try:
            async for delta in sources[0]:
                yield 0, delta
        finally:  # a client gone mid-stream: close the engine's stream now (it aborts)
            await _close(sources[0])
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(index: int, source: AsyncIterator[Any]) -> None:
        error: BaseException | None = None
        try:
            async for delta in source:
                await queue.put((index, delta, None))
        except Exception as e:  # reaches the consumer, which re-raises it
            error = e
        finally:
            await _close(source)
        await queue.put((index, done, error))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    try:
        live = len(tasks)
        while live:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is done:
                live -= 1
                continue
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def primed(stream: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``stream`` with its first item already fetched (errors raised here, before any
    HTTP response starts); iterate the result to get every item, the first included."""
    try:
        first = await stream.__anext__()
    except BaseException:
        await _close(stream)
        raise

    async def rest() -> AsyncIterator[tuple[int, Any]]:
        try:
            yield first
            async for item in stream:
                yield item
        finally:
            await _close(stream)

    return rest()


async def _close(stream: AsyncIterator[Any]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


async def run(engine: Any, jobs: Sequence[Job], request_id: RequestIds, request: Request, *,
              fields: Mapping[str, str], cache_salt: Salts = None) -> list[list[Any]]:
    """:func:`outputs`, an engine's refusal turned into the HTTP error naming the field
    (``fields``: see :func:`~kvrunner.serve.errors.engine_error`)."""
    try:
        return await outputs(engine, jobs, request_id, request, cache_salt)
    except KvrunnerError as e:
        raise engine_error(e, fields=fields) from None


async def start_stream(engine: Any, jobs: Sequence[Job], request_id: RequestIds, *,
                       fields: Mapping[str, str], cache_salt: Salts = None
                       ) -> AsyncIterator[tuple[int, Any]]:
    """The merged, primed delta streams of ``jobs``: a request the engine refuses is
    an HTTP error here, before the response starts."""
    try:
        return await primed(merged(streams(engine, jobs, request_id, cache_salt)))
    except KvrunnerError as e:
        raise engine_error(e, fields=fields) from None
