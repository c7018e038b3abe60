"""One engine replica as :class:`~kvrunner.ray.fleet.RolloutFleet` sees it: its
actors, whether it still serves, and, once it has failed, why.

A replica fails once, but every request in flight on it sees the failure: the first
caller starts the verdict (the cause's first line, and which of its rank actors no
longer answer: a rank killed without a word leaves rank 0 only a failed collective)
and every caller awaits that same verdict, so none reports the failure before the
dead ranks are named.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import attrs

#: how long a rank actor has to answer a ping before the verdict calls it gone
PING_TIMEOUT_S = 2.0


@attrs.define(kw_only=True)
class Replica:
    """One replica of the fleet.

    :ivar actor: rank 0's actor (the replica's ``AsyncLLM``).
    :ivar ranks: the actors of ranks 1 to ``tp - 1``.
    :ivar error: why the replica no longer serves; None while alive.
    """

    index: int
    actor: Any
    ranks: list[Any]
    alive: bool = True
    error: str | None = None
    _verdict: asyncio.Future[str] | None = attrs.field(default=None, init=False)

    async def fail(self, cause: BaseException) -> str:
        """Mark the replica dead (the first call; it stops serving at once), end its
        actors, and return why it failed; every caller gets the same verdict."""
        if self.alive:
            self.alive = False
            lines = str(cause).strip().splitlines()
            self.error = f"{type(cause).__name__}: {lines[0] if lines else ''}"
            self._verdict = asyncio.ensure_future(self._autopsy(self.error))
        if self._verdict is not None:
            # shielded: a caller cancelled while it waits must not cancel the others'
            self.error = await asyncio.shield(self._verdict)
        return str(self.error)

    def end(self, reason: str) -> None:
        """The replica stops serving without having failed (the fleet shuts down)."""
        self.alive, self.error = False, reason

    def kill(self) -> None:
        """End every actor of the replica (those already gone are skipped)."""
        import ray

        for actor in [self.actor, *self.ranks]:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    async def _autopsy(self, error: str) -> str:
        gone = await _unanswering(self.ranks)
        if gone:
            error += f" (the actors of rank(s) {[k + 1 for k in gone]} are gone)"
        self.kill()  # frees its bundles' processes
        return error


async def _unanswering(actors: list[Any], timeout_s: float = PING_TIMEOUT_S) -> list[int]:
    """The positions of the actors that do not answer a ping within ``timeout_s``."""
    async def answers(actor: Any) -> bool:
        try:
            await asyncio.wait_for(actor.node_address.remote(), timeout_s)
        except Exception:  # noqa: BLE001 - dead, unreachable or stuck: it does not answer
            return False
        return True

    alive = await asyncio.gather(*(answers(a) for a in actors))
    return [k for k, ok in enumerate(alive) if not ok]
