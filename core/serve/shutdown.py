"""What SIGTERM does: stop admission, end or finish the requests in flight, then stop.

The order matters. Admission closes first, so nothing new reaches the engine while it
empties; then every request either ends now (``abort``: finish reason ``"abort"``, with
the tokens it had) or is given ``drain_timeout_s`` to finish (``drain``), after which
what is left is aborted. Only then is the HTTP server told to exit: its streams have
all received their last event, so no client is left waiting on a closed socket. The
engine is shut down last (:func:`kvrunner.serve.server.serve_forever`), which frees the
device and stops the tensor-parallel ranks.
"""

from __future__ import annotations

import sys
from typing import Any

from kvrunner.serve.errors import APIError


class Admission:
    """Whether the server takes new generation requests."""

    def __init__(self) -> None:
        self.open = True

    def require_open(self) -> None:
        """A 503 once shutdown began: the client should go to another replica."""
        if not self.open:
            raise APIError(503, "the server is shutting down and takes no new requests")


class GracefulShutdown:
    """Empties the engine on SIGTERM, per the server's ``shutdown_mode``."""

    def __init__(self, engine: Any, admission: Admission, *, mode: str,
                 drain_timeout_s: float) -> None:
        self.engine = engine
        self.admission = admission
        self.mode = mode
        self.drain_timeout_s = drain_timeout_s
        self.started = False

    async def empty_engine(self) -> int:
        """Close admission and end every request; returns how many were aborted."""
        self.started = True
        self.admission.open = False
        if self.mode == "drain" and not self.engine.is_paused:
            try:
                await self.engine.wait_for_requests_to_drain(timeout=self.drain_timeout_s)
            except TimeoutError:
                print(f"kvrunner serve: requests still running after "
                      f"{self.drain_timeout_s:g} s of draining; aborting them", file=sys.stderr)
        # A paused engine never drains (its requests are parked): they are aborted too.
        return await self.engine.abort_all()
