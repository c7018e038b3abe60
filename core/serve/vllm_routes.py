"""The vLLM-shaped control routes SkyRL and prime-rl call, parameters in the query string::

    POST /pause?mode=keep        # abort | keep | wait
    POST /resume
    POST /sleep?level=1
    POST /wake_up?tags=weights&tags=kv_cache
    POST /reset_prefix_cache
    GET  /is_sleeping, GET /is_paused, GET /get_world_size

The state-changing ones answer 403 unless ``--enable-rl-endpoints``; the two reads
are open.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from kvrunner.serve.auth import require_rl_endpoints
from kvrunner.serve.errors import APIError, engine_call
from kvrunner.serve.state import ServerState

router = APIRouter()
control = APIRouter(dependencies=[Depends(require_rl_endpoints)])

PAUSE_MODES = ("abort", "keep", "wait")
SLEEP_LEVELS = (1, 2)
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _query(request: Request, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """The query string, each key's values; a 400 naming an unknown parameter."""
    values: dict[str, list[str]] = {}
    for key, value in request.query_params.multi_items():
        if key not in allowed:
            raise APIError(400, f"unknown query parameter {key!r} (this route takes "
                           f"{list(allowed) or 'none'})", param=key)
        values.setdefault(key, []).append(value)
    return values


def _one(values: dict[str, list[str]], key: str) -> str | None:
    got = values.get(key)
    if got is None:
        return None
    if len(got) > 1:
        raise APIError(400, f"{key} is given {len(got)} times", param=key)
    return got[0]


def _flag(values: dict[str, list[str]], key: str, default: bool) -> bool:
    text = _one(values, key)
    if text is None:
        return default
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise APIError(400, f"{key} must be true or false, got {text!r}", param=key)


def is_sleeping(stats: Any) -> bool:
    """Whether a stats record says any part of the engine is asleep."""
    state = stats.sleep_state
    return bool(state) and state not in ("awake", 0, "0")


@control.post("/pause")
async def pause(request: Request) -> dict[str, Any]:
    """Stop stepping: ``abort`` ends the requests in flight, ``keep`` parks them with their
    KV, ``wait`` lets them finish first; ``clear_cache=true`` then drops the prefix
    cache."""
    values = _query(request, ("mode", "clear_cache"))
    mode = _one(values, "mode") or "abort"
    if mode not in PAUSE_MODES:
        raise APIError(400, f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}",
                       param="mode")
    clear = _flag(values, "clear_cache", False)
    engine = _state(request).engine
    await engine_call(engine.pause(mode=mode))
    if clear:
        await engine_call(engine.reset_prefix_cache())
    return {"status": "ok", "mode": mode}


@control.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    """Resume stepping; parked requests continue."""
    _query(request, ())
    await engine_call(_state(request).engine.resume())
    return {"status": "ok"}


@control.post("/sleep")
async def sleep(request: Request) -> dict[str, Any]:
    """Free device memory: level 1 the KV pool and graphs, level 2 the weights too."""
    values = _query(request, ("level",))
    text = _one(values, "level") or "1"
    if text not in {str(level) for level in SLEEP_LEVELS}:
        raise APIError(400, f"level must be 1 or 2, got {text!r}", param="level")
    await engine_call(_state(request).engine.sleep(level=int(text)))
    return {"status": "ok", "level": int(text)}


@control.post("/wake_up")
async def wake_up(request: Request) -> dict[str, Any]:
    """Bring back the tagged parts (``weights``, ``kv_cache``; none given: both)."""
    tags = _query(request, ("tags",)).get("tags")
    await engine_call(_state(request).engine.wake_up(tags=tags))
    return {"status": "ok", "tags": tags}


@control.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    _query(request, ())
    await engine_call(_state(request).engine.reset_prefix_cache())
    return {"status": "ok"}


@router.get("/is_sleeping")
async def is_sleeping_route(request: Request) -> dict[str, bool]:
    return {"is_sleeping": is_sleeping(_state(request).engine.stats())}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, bool]:
    return {"is_paused": bool(_state(request).engine.is_paused)}


@router.get("/get_world_size")
async def get_world_size(request: Request) -> dict[str, int]:
    """The engine's ranks (tensor parallel; kvrunner has no data or pipeline parallelism,
    so vLLM's ``include_dp`` changes nothing)."""
    _query(request, ("include_dp",))
    return {"world_size": int(_state(request).engine.config.parallel.tensor_parallel_size)}


router.include_router(control)
