"""Reading a request's JSON body into its protocol model, every fault a 400 naming the field.

The routes parse their bodies here rather than through FastAPI's signature binding, so
that malformed JSON, a body that is not an object, an unknown field and a wrong type all
get the same error shape (:mod:`kvrunner.serve.errors`), and so that the control
routes SGLang clients call with no body at all accept an empty one.
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvrunner.serve.errors import APIError, validation_error

Model = TypeVar("Model", bound=BaseModel)

#: a body larger than this is refused before it is parsed (a prompt of a million
#: token ids is about 7 MB of JSON)
MAX_BODY_BYTES = 64 * 1024 * 1024


async def parse_body(request: Request, model: type[Model], *, optional: bool = False) -> Model:
    """The body as ``model``; an empty body is ``model()`` when ``optional``."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is larger than {MAX_BODY_BYTES} bytes", param="body")
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
