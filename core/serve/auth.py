"""The Bearer-token guard in front of every route.

A plain ASGI middleware rather than a FastAPI dependency: it runs before routing, so
an unknown path, ``/metrics`` and ``/health`` are guarded like the rest, and it never
wraps a streaming body (a ``BaseHTTPMiddleware`` would buffer one).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import Request

from kvrunner.serve.errors import APIError, error_body

Scope = dict[str, Any]


class BearerAuth:
    """Refuse, with a 401 JSON error, any HTTP request whose ``Authorization`` header is
    not ``Bearer <api_key>``; compared in constant time."""

    def __init__(self, app: Any, *, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan events carry no headers
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization")
        if given is not None and hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, _refusal(given))).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body", "body": body})


def _refusal(given: bytes | None) -> str:
    """Why ``given`` (the Authorization header, None when absent) is refused: a key
    sent without the ``Bearer`` scheme is told so, not that the key is wrong."""
    if given is None:
        return "the API key is missing: send the header 'Authorization: Bearer <key>'"
    if given[:7].lower() != b"bearer ":  # nothing of it is echoed: it may be the key
        return ("the Authorization header must be 'Bearer <key>': it does not start "
                "with 'Bearer ' (send the header 'Authorization: Bearer <key>')")
    return "the API key is wrong: send the header 'Authorization: Bearer <key>'"


def require_rl_endpoints(request: Request) -> None:
    """A route dependency: the control routes (weights, memory, pause, flush, abort) are
    403 unless the server was started with ``--enable-rl-endpoints``, because they can
    replace the model or stop everyone's generation."""
    if not request.app.state.server.settings.enable_rl_endpoints:
        raise APIError(403, f"{request.url.path} is a control route (it changes the "
                       f"engine's weights, memory or schedule) and is off; start the server "
                       f"with --enable-rl-endpoints to serve it")
