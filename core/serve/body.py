"""Reading a request's JSON body into its protocol model, every fault a 400 naming the field.

The routes parse their bodies here rather than through FastAPI's signature binding, so
that malformed JSON, a body that is not an object, an unknown field and a wrong type all
get the same error shape (:mod:`kvrunner.serve.errors`), and so that the control
routes SGLang clients call with no body at all accept an empty one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvrunner.serve.errors import APIError, validation_error

Model = TypeVar("Model", bound=BaseModel)
Parsed = TypeVar("Parsed")

#: bodies of this many bytes or more are parsed in a worker thread: json and pydantic
#: take some 50 ms a MB of token ids, which on the event loop would stall every stream
OFF_LOOP_BYTES = 1 << 20

def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {limit} "
                    f"bytes (set by --max-body-bytes)", param="body")


async def read_body(request: Request) -> bytes:
    """The raw body, read chunk by chunk and refused (413) as soon as it passes the
    server's ``max_body_bytes``: at once when ``Content-Length`` says so, else when
    the chunks read pass it, never holding more than the limit. Read once per
    request (kept on ``request.state``)."""
    kept = getattr(request.state, "raw_body", None)
    if kept is not None:
        return kept
    limit = request.app.state.server.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    request.state.raw_body = raw = b"".join(chunks)
    return raw


def parse_json(raw: bytes, model: type[Model], *, optional: bool = False) -> Model:
    """``raw`` as ``model``; an empty body is ``model()`` when ``optional``."""
    if not raw.strip():
        if optional:
            return model()
        raise APIError(400, "the request needs a JSON object body", param="body")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", param="body") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}",
                       param="body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


async def off_loop(raw: bytes, parse: Callable[[bytes], Parsed]) -> Parsed:
    """``parse(raw)``: in place for a small body, in a worker thread from
    :data:`OFF_LOOP_BYTES` on (the event loop keeps serving meanwhile)."""
    if len(raw) < OFF_LOOP_BYTES:
        return parse(raw)
    return await asyncio.to_thread(parse, raw)


async def parse_body(request: Request, model: type[Model], *, optional: bool = False) -> Model:
    """The body as ``model`` (:func:`read_body`, then :func:`parse_json`, off the
    event loop for a large body)."""
    return await off_loop(await read_body(request),
                          lambda raw: parse_json(raw, model, optional=optional))
