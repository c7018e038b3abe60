"""The RL API in SGLang's shape: ``/generate`` and the control routes slime and AReaL call.

Names and JSON fields are SGLang's, so a client written for SGLang's http_server works
unchanged. A weight update is, as slime does it::

    POST /pause_generation {"mode": "in_place"}      # or "abort"
    POST /flush_cache
    POST /update_weights_from_disk {"model_path": ..., "weight_version": "7"}
    POST /continue_generation

Every control route answers 403 unless the server runs with ``--enable-rl-endpoints``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from kvrunner.errors import CheckpointError, KvrunnerError
from kvrunner.serve import generation, sse
from kvrunner.serve.app import ServerState, new_id
from kvrunner.serve.auth import require_rl_endpoints
from kvrunner.serve.body import parse_body
from kvrunner.serve.errors import APIError, engine_call, engine_error, error_body
from kvrunner.serve.request_params import (
    build_params,
    max_new_tokens,
    refuse_unsupported,
    stops,
    top_k,
)
from kvrunner.serve.rl_protocol import (
    AbortRequest,
    ContinueGenerationRequest,
    GenerateRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    SGLangSamplingParams,
    UpdateWeightsFromDiskRequest,
)
from kvrunner.serve.sse import event

router = APIRouter()
control = APIRouter(dependencies=[Depends(require_rl_endpoints)])

#: SGLang's pause modes -> AsyncLLM's. "in_place" is "keep" (requests stay with their KV,
#: as in SGLang). SGLang's "retract" instead frees the running requests' KV and
#: recomputes it after /continue_generation (under the new weights); kvrunner has no
#: recompute-on-resume for a paused request, so "retract" keeps them parked as well:
#: they survive and continue the same way, their earlier tokens' KV stays the old
#: weights', and /release_memory_occupation is refused (409) while they are parked,
#: where SGLang would allow it
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}

_NEUTRAL = {"min_new_tokens": 0, "min_p": 0.0, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "repetition_penalty": 1.0, "regex": None,
            "json_schema": None, "ebnf": None, "logit_bias": None}
_NAMES = {"max_tokens": "sampling_params.max_new_tokens", "seed": "sampling_params.sampling_seed",
          "logprobs": "top_logprobs_num"} | {
    f: f"sampling_params.{f}" for f in ("temperature", "top_p", "top_k", "stop",
                                        "stop_token_ids", "ignore_eos", "n")}


def _fields(prompt_field: str) -> dict[str, str]:
    """Words of an engine's refusal -> the field it is about (see errors.engine_error)."""
    return {"stop_token_ids": "sampling_params.stop_token_ids", "token id": prompt_field,
            "prompt": prompt_field}


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _params(state: ServerState, body: GenerateRequest, prompt_len: int) -> Any:
    sp: SGLangSamplingParams = body.sampling_params
    refuse_unsupported(sp, _NEUTRAL, prefix="sampling_params.")
    settings = state.settings
    if sp.n > settings.max_n:
        raise APIError(400, f"sampling_params.n={sp.n} is above this server's limit of "
                       f"{settings.max_n} samples per request (--max-n)",
                       param="sampling_params.n")
    if body.top_logprobs_num > settings.max_logprobs:
        raise APIError(400, f"top_logprobs_num={body.top_logprobs_num} is above this "
                       f"server's limit of {settings.max_logprobs} (--max-logprobs)",
                       param="top_logprobs_num")
    given = sp.model_fields_set
    values: dict[str, Any] = {
        "max_tokens": max_new_tokens(sp.max_new_tokens, prompt_len, state.max_model_len),
        "seed": sp.sampling_seed,
        "stop": stops(sp.stop),
        "stop_token_ids": tuple(sp.stop_token_ids) if sp.stop_token_ids else None,
        "ignore_eos": sp.ignore_eos if "ignore_eos" in given else None,
        "logprobs": body.top_logprobs_num if body.return_logprob else None,
        "n": sp.n if sp.n != 1 else None,
    }
    for name in ("temperature", "top_p"):
        if name in given:
            values[name] = getattr(sp, name)
    if "top_k" in given:
        values["top_k"] = top_k(sp.top_k)
    return build_params(values, _NAMES, state.engine.default_sampling_params)


#: the message of an abort a client or a pause asked for
ABORTED = "Aborted"


def _finish_reason(out: Any) -> dict[str, Any] | None:
    """SGLang's finish-reason object: ``length`` / ``stop`` / ``abort``, the last with
    SGLang's ``message``, ``status_code`` and ``err_type``. SGLang has no finish reason
    for a failed request, only an abort carrying the error, which slime and AReaL
    already drop or retry; so kvrunner's ``"error"`` (a non-finite logits row) is such an
    abort, status 500, its message the cause (``"step 12 (output token 3): logits hold
    NaN"``). An abort that was asked for has no status, as in SGLang."""
    reason = out.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(out.token_ids)}
    if reason == "stop":
        matched = getattr(out, "stop_reason", None)
        if matched is None and out.token_ids:
            matched = out.token_ids[-1]
        return {"type": "stop", "matched": matched}
    if reason == "error":
        return {"type": "abort", "message": getattr(out, "error", None) or "error",
                "status_code": 500, "err_type": "InternalServerError"}
    return {"type": "abort", "message": ABORTED, "status_code": None, "err_type": None}


def _weight_version(state: ServerState, out: Any) -> Any:
    version = getattr(out, "weight_version", None)
    return version if version is not None else state.engine.stats().weight_version


def _logprob_triples(state: ServerState, token_ids: list[int], logprobs: list[float],
                     with_text: bool) -> list[list[Any]]:
    return [[lp, t, state.decode([t]) if with_text else None]
            for t, lp in zip(token_ids, logprobs, strict=True)]


def _meta(state: ServerState, body: GenerateRequest, out: Any, rid: str, *,
          prompt_tokens: int, started: float) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_reason(out),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(out.token_ids),
        "cached_tokens": 0,
        "weight_version": _weight_version(state, out),
        "e2e_latency": time.perf_counter() - started,
    }
    spans = getattr(out, "weight_versions", None)
    if spans:  # a finished request: which of its tokens each weight version made
        meta["weight_versions"] = [[version, start] for version, start in spans]
    if body.return_logprob and out.logprobs is not None:
        text = body.return_text_in_logprobs
        meta["output_token_logprobs"] = _logprob_triples(state, out.token_ids, out.logprobs,
                                                         text)
        if body.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [[lp, t, state.decode([t]) if text else None] for t, lp in top.items()]
                for top in (out.top_logprobs or [])
            ]
    return meta


def _one(state: ServerState, body: GenerateRequest, out: Any, rid: str, *,
         prompt_tokens: int, started: float) -> dict[str, Any]:
    return {"text": out.text, "output_ids": list(out.token_ids),
            "meta_info": _meta(state, body, out, rid, prompt_tokens=prompt_tokens,
                               started=started)}


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Any:
    """SGLang's native generate: ``text`` or ``input_ids``, ``sampling_params``,
    ``return_logprob``, ``rid``, ``stream``; ``n`` > 1 answers a list."""
    state = _state(request)
    body = await parse_body(request, GenerateRequest)
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids",
                       param="input_ids" if body.text is None else "text")
    state.admission.require_open()
    field = "text" if body.text is not None else "input_ids"
    ids = state.token_ids(body.text if body.text is not None else body.input_ids, param=field)
    params = _params(state, body, len(ids))
    rid = body.rid or new_id("gen")
    started = time.perf_counter()
    if body.stream:
        items = await generation.start_stream(state.engine, [(ids, params)], rid,
                                              fields=_fields(field))
        return sse.response(_events(state, body, items, rid, len(ids), started,
                                    many=body.sampling_params.n > 1, fields=_fields(field)))
    outs = (await generation.run(state.engine, [(ids, params)], rid, request,
                                 fields=_fields(field)))[0]
    answers = [_one(state, body, out, rid if len(outs) == 1 else f"{rid}-{k}",
                    prompt_tokens=len(ids), started=started) for k, out in enumerate(outs)]
    return JSONResponse(answers[0] if len(answers) == 1 else answers)


class _Progress:
    """One stream's output so far (SGLang's stream events are cumulative)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.error: str | None = None
        self.weight_version: Any = None
        self.weight_versions: Any = None

    def add(self, delta: Any) -> None:
        self.token_ids += list(delta.token_ids)
        self.logprobs += list(delta.logprobs or ())
        self.top_logprobs += list(delta.top_logprobs or ())
        self.text += delta.text or ""
        self.finish_reason = delta.finish_reason
        final = getattr(delta, "output", None)
        if final is not None:  # the last delta carries the whole output: take its facts
            self.text = final.text
            self.stop_reason = getattr(final, "stop_reason", None)
            self.error = getattr(final, "error", None)
            self.weight_version = getattr(final, "weight_version", None)
            self.weight_versions = getattr(final, "weight_versions", None)


async def _events(state: ServerState, body: GenerateRequest,
                  items: AsyncIterator[tuple[int, Any]], rid: str, prompt_tokens: int,
                  started: float, *, many: bool, fields: dict[str, str]
                  ) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        progress: dict[int, _Progress] = {}
        async for index, delta in items:
            seen = progress.setdefault(index, _Progress())
            seen.add(delta)
            chunk = _one(state, body, _OutputView(seen), f"{rid}-{index}" if many else rid,
                         prompt_tokens=prompt_tokens, started=started)
            if many:
                chunk["index"] = index
            yield event(chunk)

    async for item in sse.guarded(events(), fields=fields):
        yield item


class _OutputView:
    """A stream's progress read as an output (what ``_one`` formats)."""

    def __init__(self, seen: _Progress) -> None:
        self.token_ids = seen.token_ids
        # logprobs only when every token had one (return_logprob)
        whole = seen.logprobs and len(seen.logprobs) == len(seen.token_ids)
        self.logprobs = seen.logprobs if whole else None
        self.top_logprobs = seen.top_logprobs or None
        self.text = seen.text
        self.finish_reason = seen.finish_reason
        self.stop_reason = seen.stop_reason
        self.error = seen.error
        self.weight_version = seen.weight_version
        self.weight_versions = seen.weight_versions


# ---------------------------------------------------------------------------
# control routes (403 unless --enable-rl-endpoints)
# ---------------------------------------------------------------------------


@control.post("/abort_request")
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


@control.post("/pause_generation")
async def pause_generation(request: Request) -> dict[str, Any]:
    """Stop stepping. ``abort`` ends the requests in flight; ``in_place`` and ``retract``
    park them (with their KV) until ``/continue_generation``."""
    body = await parse_body(request, PauseGenerationRequest, optional=True)
    await engine_call(_state(request).engine.pause(mode=PAUSE_MODES[body.mode]))
    return {"message": f"generation paused (mode {body.mode})", "status": "ok"}


@control.post("/continue_generation")
async def continue_generation(request: Request) -> dict[str, Any]:
    """Resume stepping; parked requests continue where they stopped."""
    await parse_body(request, ContinueGenerationRequest, optional=True)
    await engine_call(_state(request).engine.resume())
    return {"message": "generation continued", "status": "ok"}


@control.api_route("/flush_cache", methods=["GET", "POST"])
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


@control.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request) -> dict[str, Any]:
    """Free device memory: ``kv_cache`` / ``cuda_graph`` (level 1) or also ``weights``
    (level 2, kept in host memory); no tags is all of it."""
    body = await parse_body(request, MemoryOccupationRequest, optional=True)
    level = _release_level(body.tags)
    await engine_call(_state(request).engine.sleep(level=level))
    return {"success": True, "message": f"memory released (sleep level {level})"}


@control.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request) -> dict[str, Any]:
    """Bring back what ``/release_memory_occupation`` freed (the same pool size)."""
    body = await parse_body(request, MemoryOccupationRequest, optional=True)
    await engine_call(_state(request).engine.wake_up(tags=_wake_tags(body.tags)))
    return {"success": True, "message": "memory resumed"}


@control.post("/update_weights_from_disk")
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
        await engine.load_weights(body.model_path, weight_version=body.weight_version)
        if body.flush_cache:
            await engine.reset_prefix_cache()
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


router.include_router(control)
