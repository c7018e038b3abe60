"""Handing results from the engine thread to the asyncio side.

The engine thread never touches an event loop's objects directly: every result,
error and delta is scheduled onto its loop with ``call_soon_threadsafe``. Deltas
of one step are batched per loop (one wake-up of the loop per step, not one per
request), which keeps thousands of concurrent streams cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from typing import Any


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():  # its awaiter was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class Reply:
    """The asyncio future a command's caller awaits, settled from the engine thread.

    ``Reply(None, None)`` is a command nobody awaits (an abort after a cancel).
    """

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None, future: asyncio.Future | None):
        self.loop = loop
        self.future = future

    def ok(self, value: Any = None) -> None:
        self._post(value, None)

    def fail(self, error: BaseException) -> None:
        self._post(None, error)

    def _post(self, value: Any, error: BaseException | None) -> None:
        if self.loop is None or self.future is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
            self.loop.call_soon_threadsafe(_settle, self.future, value, error)


class Channel:
    """One request's deltas, in order, as its awaiter on ``loop`` reads them."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()


def _deliver(items: list[tuple[Channel, Any]]) -> None:
    for channel, item in items:
        channel.queue.put_nowait(item)


class Outbox:
    """Deltas gathered during one step, posted per loop by :meth:`flush`."""

    def __init__(self) -> None:
        self._items: dict[asyncio.AbstractEventLoop, list[tuple[Channel, Any]]] = (
            defaultdict(list)
        )

    def put(self, channel: Channel, item: Any) -> None:
        self._items[channel.loop].append((channel, item))

    def flush(self) -> None:
        if not self._items:
            return
        items, self._items = self._items, defaultdict(list)
        for loop, batch in items.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its awaiters are gone
                loop.call_soon_threadsafe(_deliver, batch)
