"""Server-sent events as the OpenAI and SGLang clients read them: ``data: <json>`` lines
separated by a blank line, the stream closed by ``data: [DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi.responses import StreamingResponse

from kvrunner.errors import KvrunnerError
from kvrunner.serve.errors import engine_error, error_body

DONE = "data: [DONE]\n\n"


def event(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def guarded(events: AsyncIterator[str], *, fields: Mapping[str, str]) -> AsyncIterator[str]:
    """``events``, then ``[DONE]``; an engine error mid-stream (the headers are sent, so
    no status can change) becomes one error event in the JSON error shape."""
    try:
        async for item in events:
            yield item
    except KvrunnerError as e:
        error = engine_error(e, fields=fields)
        yield event(error_body(error.status, error.message, error.param))
    yield DONE
