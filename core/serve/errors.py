"""Every 4xx/5xx the server sends is one JSON shape, OpenAI's, naming the field at fault::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": 400}}

FastAPI's own 422 for a body that does not match its model becomes a 400 naming the
first field pydantic rejected (``sampling_params.max_new_tokens``); malformed JSON
names ``body``. Errors kvrunner raises for a request (:class:`RequestError`) are 400s,
an order the sleep state forbids (:class:`SleepStateError`) a 409.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrunner.async_engine.errors import EngineBusyError, EngineDeadError
from kvrunner.errors import KvrunnerError, RequestError, SleepStateError, WakeError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}
# pydantic puts the union member or validator it tried into an error's location
# ("prompt", "list[int]", 0); those are not the client's field names
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


class APIError(Exception):
    """An HTTP error with the JSON body above.

    :param status: the HTTP status (4xx for the client's faults).
    :param param: the request field at fault, dotted (``sampling_params.top_p``), or None.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def field_path(loc: tuple[Any, ...]) -> str:
    """``("body", "sampling_params", "max_new_tokens")`` -> ``sampling_params.max_new_tokens``;
    list positions are kept (``prompt.3``), pydantic's union-member tags are dropped."""
    if loc[:1] in (("body",), ("query",)):
        loc = loc[1:]
    return ".".join(str(p) for p in loc if not _is_type_tag(p)) or "body"


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        "[" in part or part.lower() in _TYPE_TAGS or part.startswith("function-")
    )


def _validation_message(error: dict[str, Any]) -> tuple[str, str]:
    kind = error.get("type", "")
    if kind == "json_invalid":
        return "body", f"the body is not valid JSON: {error.get('ctx', {}).get('error', '')}"
    path = field_path(tuple(error.get("loc", ())))
    if kind == "extra_forbidden":
        return path, f"unknown field {path!r}"
    if kind == "missing":
        return path, f"field {path!r} is required"
    got = error.get("input")
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    return path, f"{path}: {error.get('msg', 'invalid value')} (got {shown})"


def validation_error(errors: list[Any]) -> APIError:
    """A 400 naming the first field pydantic rejected (and counting the others)."""
    if not errors:
        return APIError(400, "the request body is invalid", param="body")
    # of a union's failed members, the deepest location is the one that says what is
    # wrong (``prompt.0`` not an integer, rather than ``prompt`` not a string)
    first = max(errors, key=lambda e: len(tuple(e.get("loc", ()))))
    param, message = _validation_message(first)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return APIError(400, message, param=param)


def engine_error(error: KvrunnerError, *, fields: Mapping[str, str] | None = None
                 ) -> APIError:
    """The HTTP error for an error the engine raised while taking a request.

    A ``RequestError`` is the client's (400); ``fields`` maps words of its message to
    the route's field names (``{"stop_token_ids": "sampling_params.stop_token_ids",
    "prompt": "input_ids"}``), and the first one found names the field. An order the
    sleep state forbids, or one the requests in the engine forbid (``EngineBusyError``:
    sleep with requests parked), is a 409, a bad checkpoint or weight a 400, a dead
    engine a 503 (the server is exiting), anything else the server's (500).
    """
    text = str(error)
    if isinstance(error, RequestError):
        param = next((name for word, name in (fields or {}).items() if word in text), None)
        return APIError(400, text, param=param)
    if isinstance(error, EngineDeadError):  # the server exits: try another replica
        return APIError(503, f"{text}; the server is exiting")
    if isinstance(error, SleepStateError | WakeError | EngineBusyError):
        return APIError(409, text)
    if isinstance(error, ValueError):  # a checkpoint or pushed weight the client named
        return APIError(400, text)
    return APIError(500, f"{type(error).__name__}: {text}")


async def engine_call(coro: Any) -> Any:
    """Await an engine control call; its refusal is the HTTP error (409 for an order the
    sleep state forbids, 400 for a bad value)."""
    try:
        return await coro
    except KvrunnerError as e:
        raise engine_error(e) from None
    except ValueError as e:  # unknown tags and the like, checked by the engine
        raise APIError(400, str(e)) from None


async def _on_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
    error = validation_error(list(exc.errors()))
    return error_response(error.status, error.message, error.param)


async def _on_api_error(_request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def _on_http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


async def _on_kvrunner(_request: Request, exc: KvrunnerError) -> JSONResponse:
    error = engine_error(exc)
    return error_response(error.status, error.message, error.param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise to the JSON shape above."""
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(KvrunnerError, _on_kvrunner)
