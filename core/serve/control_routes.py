"""The RL control routes in SGLang's shape, the ones slime and AReaL call around a
weight update::

    POST /pause_generation {"mode": "in_place"}      # or "abort"
    POST /flush_cache
    POST /update_weights_from_disk {"model_path": ..., "weight_version": "7"}
    POST /continue_generation

and ``/abort_request``, ``/release_memory_occupation``, ``/resume_memory_occupation``.
Every one answers 403 unless the server runs with ``--enable-rl-endpoints``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from kvrunner.errors import CheckpointError, KvrunnerError
from kvrunner.serve.auth import require_rl_endpoints
from kvrunner.serve.body import parse_body
from kvrunner.serve.errors import APIError, engine_call, engine_error, error_body
from kvrunner.serve.rl_protocol import (
    AbortRequest,
    ContinueGenerationRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
)
from kvrunner.serve.state import ServerState

router = APIRouter(dependencies=[Depends(require_rl_endpoints)])

#: SGLang's pause modes -> AsyncLLM's. "in_place" is "keep" (requests stay with their KV,
#: as in SGLang); "retract" frees the running requests' KV and recomputes it after
#: /continue_generation (under the new weights), as SGLang's does
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "retract"}


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.post("/abort_request")
async def abort_request(request: Request) -> dict[str, Any]:
    """End one request (``rid``) or every one (``abort_all``): finish reason ``abort``,
    with the tokens each had."""
    state = _state(request)
    body = await parse_body(request, AbortRequest)
    if body.abort_all:
        return {"success": True, "aborted": int(await state.engine.abort_all())}
    if not body.rid:
        raise APIError(400, "give rid, or abort_all=true", param="rid")
    aborted = int(bool(await state.engine.abort(body.rid)))
    if not aborted:  # the samples of an n > 1 request carry the suffixes -0, -1, ...
        for k in range(state.settings.max_n):
            aborted += int(bool(await state.engine.abort(f"{body.rid}-{k}")))
    return {"success": True, "aborted": aborted}


@router.post("/pause_generation")
async def pause_generation(request: Request) -> dict[str, Any]:
    """Stop stepping. ``abort`` ends the requests in flight; ``in_place`` parks them with
    their KV, ``retract`` sends them back to the queue with their KV freed, until
    ``/continue_generation``."""
    body = await parse_body(request, PauseGenerationRequest, optional=True)
    await engine_call(_state(request).engine.pause(mode=PAUSE_MODES[body.mode]))
    return {"message": f"generation paused (mode {body.mode})", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict[str, Any]:
    """Resume stepping; parked requests continue where they stopped."""
    await parse_body(request, ContinueGenerationRequest, optional=True)
    await engine_call(_state(request).engine.resume())
    return {"message": "generation continued", "status": "ok"}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> dict[str, Any]:
    """Drop the prefix cache (what a weight update makes stale)."""
    await engine_call(_state(request).engine.reset_prefix_cache())
    return {"success": True, "message": "cache flushed"}


def _release_level(tags: list[str] | None) -> int:
    """kvrunner's sleep level for SGLang's tags: the weights go only at level 2 (kept in
    host memory), which frees the KV pool too."""
    return 2 if tags is None or "weights" in tags else 1


def _wake_tags(tags: list[str] | None) -> list[str] | None:
    if tags is None:
        return None
    return list(dict.fromkeys("kv_cache" if t == "cuda_graph" else t for t in tags))


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request) -> dict[str, Any]:
    """Free device memory: ``kv_cache`` / ``cuda_graph`` (level 1) or also ``weights``
    (level 2, kept in host memory); no tags is all of it."""
    body = await parse_body(request, MemoryOccupationRequest, optional=True)
    level = _release_level(body.tags)
    await engine_call(_state(request).engine.sleep(level=level))
    return {"success": True, "message": f"memory released (sleep level {level})"}


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request) -> dict[str, Any]:
    """Bring back what ``/release_memory_occupation`` freed (the same pool size)."""
    body = await parse_body(request, MemoryOccupationRequest, optional=True)
    await engine_call(_state(request).engine.wake_up(tags=_wake_tags(body.tags)))
    return {"success": True, "message": "memory resumed"}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> JSONResponse:
    """Load a checkpoint's weights in place (same architecture and shapes) and set
    ``weight_version``; ``abort_all_requests`` ends the requests in flight first."""
    state = _state(request)
    body = await parse_body(request, UpdateWeightsFromDiskRequest)
    if body.load_format not in (None, "auto", "safetensors"):
        raise APIError(400, f"load_format {body.load_format!r} is not supported (kvrunner "
                       f"reads safetensors)", param="load_format")
    engine = state.engine
    if body.abort_all_requests:
        await engine.abort_all()
    try:
        await engine.load_weights(body.model_path, weight_version=body.weight_version,
                                  reset_prefix_cache=body.flush_cache)
    except (CheckpointError, FileNotFoundError) as e:
        return _update_failed(400, str(e), "model_path")
    except KvrunnerError as e:
        error = engine_error(e)
        return _update_failed(error.status, error.message, None)
    stats = engine.stats()
    return JSONResponse({
        "success": True,
        "message": f"weights loaded from {body.model_path}"
        + (f"; weight version {body.weight_version}" if body.weight_version else ""),
        "num_paused_requests": int(stats.num_waiting + stats.num_running)
        if stats.paused else 0,
    })


def _update_failed(status: int, message: str, param: str | None) -> JSONResponse:
    # SGLang's success/message fields beside the JSON error every route sends
    return JSONResponse(error_body(status, message, param)
                        | {"success": False, "message": message, "num_paused_requests": 0},
                        status_code=status)
