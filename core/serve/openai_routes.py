"""The OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Shaped so that the official ``openai`` client works unchanged: the same JSON, the same
server-sent events ending in ``data: [DONE]``. Logprobs are the engine's own (the
sampled token's logprob under the distribution it was drawn from, as
``LLM.generate`` returns them); ``top_logprobs`` keys are token texts, or
``token_id:<id>`` with vLLM's ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvrunner.serve import generation, sse
from kvrunner.serve.body import parse_body
from kvrunner.serve.errors import APIError
from kvrunner.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from kvrunner.serve.request_params import (
    build_params,
    max_new_tokens,
    refuse_unsupported,
    stops,
    top_k,
)
from kvrunner.serve.sse import event
from kvrunner.serve.state import ServerState, new_id

router = APIRouter()

_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None}
#: SamplingParams field -> the OpenAI body's name for it
_NAMES = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
          "top_k": "top_k", "seed": "seed", "stop": "stop", "n": "n",
          "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
          "logprobs": "logprobs", "prompt_logprobs": "logprobs"}


#: words of an engine's refusal -> the field it is about (see errors.engine_error)
_FIELDS = {"stop_token_ids": "stop_token_ids", "token id": "prompt", "prompt": "prompt"}
_CHAT_FIELDS = {"stop_token_ids": "stop_token_ids", "token id": "messages",
                "prompt": "messages"}


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _params(state: ServerState, body: SamplingFields, *, max_tokens: int | None,
            prompt_len: int, logprobs: int | None, logprobs_name: str,
            prompt_logprobs: int | None = None) -> Any:
    """The SamplingParams of one prompt of ``body`` (``prompt_logprobs``: the prompt's
    own logprobs and top-N, for ``echo``)."""
    settings = state.settings
    refuse_unsupported(body, _NEUTRAL)
    if body.n > settings.max_n:
        raise APIError(400, f"n={body.n} is above this server's limit of {settings.max_n} "
                       f"samples per request (--max-n)", param="n")
    if logprobs is not None and logprobs > settings.max_logprobs:
        raise APIError(400, f"{logprobs_name}={logprobs} is above this server's limit of "
                       f"{settings.max_logprobs} (--max-logprobs)", param=logprobs_name)
    given = body.model_fields_set
    values: dict[str, Any] = {
        "max_tokens": max_new_tokens(max_tokens, prompt_len, state.max_model_len),
        "seed": body.seed,
        "stop": stops(body.stop),
        "stop_token_ids": tuple(body.stop_token_ids) if body.stop_token_ids else None,
        "ignore_eos": body.ignore_eos if "ignore_eos" in given else None,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "n": body.n if body.n != 1 else None,
    }
    # unset sampling fields keep the engine's defaults (the checkpoint's generation_config)
    for name in ("temperature", "top_p"):
        if name in given:
            values[name] = getattr(body, name)
    if "top_k" in given:
        values["top_k"] = top_k(body.top_k)
    names = dict(_NAMES, logprobs=logprobs_name)
    return build_params(values, names, state.engine.default_sampling_params)


def _token_text(state: ServerState, token_id: int, as_ids: bool) -> str:
    if as_ids or state.engine.tokenizer is None:
        return f"token_id:{token_id}"
    return state.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(state: ServerState, token_ids: list[int],
                         logprobs: list[float | None] | None,
                         tops: list[dict[int, float] | None] | None, *, as_ids: bool,
                         offset: int) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    tokens = [_token_text(state, t, as_ids) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": None if tops is None else [
            None if top is None else {_token_text(state, t, as_ids): lp for t, lp in top.items()}
            for top in tops
        ],
        "text_offset": offsets,
    }


def _chat_logprobs(state: ServerState, token_ids: list[int], logprobs: list[float] | None,
                   tops: list[dict[int, float]] | None, *, as_ids: bool
                   ) -> dict[str, Any] | None:
    if logprobs is None:
        return None

    def entry(token_id: int, lp: float) -> dict[str, Any]:
        text = _token_text(state, token_id, as_ids)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        item = entry(t, lp)
        item["top_logprobs"] = [entry(k, v) for k, v in tops[i].items()] if tops else []
        content.append(item)
    return {"content": content}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """The completion body's prompt as a list of token-id prompts."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [state.token_ids(prompt, param="prompt")]
    if not prompt:
        raise APIError(400, "prompt is an empty list", param="prompt")
    return [state.token_ids(p, param=f"prompt.{i}") for i, p in enumerate(prompt)]


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    """OpenAI's completions: text or token-id prompts (one or a batch), ``n`` samples each."""
    state = _state(request)
    body = await parse_body(request, CompletionRequest)
    state.check_model(body.model)
    refuse_unsupported(body, {"suffix": None})
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of other than n is not supported by kvrunner",
                       param="best_of")
    if body.echo and body.stream:
        raise APIError(400, "echo is supported without stream only", param="echo")
    if body.echo and state.engine.tokenizer is None:
        raise APIError(400, "echo needs the prompt's text, and the model has no tokenizer",
                       param="echo")
    state.admission.require_open()
    prompts = _prompts(state, body.prompt)
    # echo with logprobs scores the prompt too (SamplingParams.prompt_logprobs, computed in
    # the prefill; such a request recomputes its prompt instead of taking a prefix hit)
    scored = body.logprobs if body.echo else None
    jobs = [(ids, _params(state, body, max_tokens=body.max_tokens, prompt_len=len(ids),
                          logprobs=body.logprobs, logprobs_name="logprobs",
                          prompt_logprobs=scored))
            for ids in prompts]
    rid, created = new_id("cmpl"), int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created,
            "model": state.model_name}
    as_ids = body.return_tokens_as_token_ids
    if body.stream:
        items = await generation.start_stream(state.engine, jobs, rid, fields=_FIELDS)
        usage = body.stream_options is not None and body.stream_options.include_usage
        return sse.response(
            _completion_events(state, items, head, jobs, as_ids=as_ids, usage=usage))
    results = await generation.run(state.engine, jobs, rid, request, fields=_FIELDS)
    choices, completion_tokens = [], 0
    for (ids, _), outs in zip(jobs, results, strict=True):
        echoed = state.engine.tokenizer.decode(ids, skip_special_tokens=False) \
            if body.echo else ""
        for out in outs:
            logprobs = _completion_logprobs(state, out.token_ids, out.logprobs,
                                            out.top_logprobs, as_ids=as_ids,
                                            offset=len(echoed))
            if body.echo and logprobs is not None:
                logprobs = _echoed_logprobs(state, ids, out, logprobs, as_ids=as_ids)
            choices.append({
                "index": len(choices),
                "text": echoed + out.text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
                "stop_reason": getattr(out, "stop_reason", None),
            })
            completion_tokens += len(out.token_ids)
    return JSONResponse(dict(head, choices=choices,
                             usage=_usage(sum(len(p) for p in prompts), completion_tokens)))


def _echoed_logprobs(state: ServerState, prompt: list[int], out: Any,
                     generated: dict[str, Any], *, as_ids: bool) -> dict[str, Any]:
    """``generated``'s logprobs with the prompt's in front (the first prompt token has
    none, as in vLLM's echo)."""
    head = _completion_logprobs(state, prompt, out.prompt_logprobs,
                                None if generated["top_logprobs"] is None
                                else out.prompt_top_logprobs or [None] * len(prompt),
                                as_ids=as_ids, offset=0)
    assert head is not None  # the request asked for prompt logprobs
    return {key: head[key] + generated[key] for key in head}


async def _completion_events(state: ServerState, items: AsyncIterator[tuple[int, Any]],
                             head: dict[str, Any], jobs: list, *, as_ids: bool,
                             usage: bool) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        completion_tokens = 0
        async for index, delta in items:
            logprobs = _completion_logprobs(state, delta.token_ids, delta.logprobs,
                                            delta.top_logprobs, as_ids=as_ids,
                                            offset=offsets.get(index, 0))
            if logprobs is not None:
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
            completion_tokens += len(delta.token_ids)
            yield event(dict(head, choices=[{
                "index": index, "text": delta.text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
            }]))
        if usage:
            yield event(dict(head, choices=[], usage=_usage(
                sum(len(ids) for ids, _ in jobs), completion_tokens)))

    async for item in sse.guarded(events(), fields=_FIELDS):
        yield item


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    template = state.chat_template
    if template is None:
        raise APIError(400, f"the model {state.model_name!r} has no chat template (no "
                       f"chat_template in its tokenizer_config.json, no chat_template.jinja); "
                       f"use /v1/completions with a prompt instead", param="messages")
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "the model has no tokenizer, so chat messages cannot be "
                       "tokenized; use /v1/completions with token ids", param="messages")
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) else "".join(
            p.text for p in m.content)
        messages.append({"role": m.role, "content": content}
                        | ({"name": m.name} if m.name else {}))
    try:
        text = template.render(messages, add_generation_prompt=body.add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    # the template writes the special tokens itself: none are added again
    ids = list(tokenizer.encode(text, add_special_tokens=False).ids)
    if not ids:
        raise APIError(400, "the messages render to an empty prompt", param="messages")
    return ids


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    """OpenAI's chat completions, for a checkpoint with a chat template (else a 400)."""
    state = _state(request)
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    state.admission.require_open()
    ids = _chat_prompt(state, body)
    asked = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    jobs = [(ids, _params(state, body, max_tokens=asked, prompt_len=len(ids),
                          logprobs=logprobs, logprobs_name="top_logprobs"))]
    rid, created = new_id("chatcmpl"), int(time.time())
    as_ids = body.return_tokens_as_token_ids
    if body.stream:
        items = await generation.start_stream(state.engine, jobs, rid, fields=_CHAT_FIELDS)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": state.model_name}
        usage = body.stream_options is not None and body.stream_options.include_usage
        return sse.response(_chat_events(state, items, head, len(ids), as_ids=as_ids, usage=usage))
    outs = (await generation.run(state.engine, jobs, rid, request, fields=_CHAT_FIELDS))[0]
    choices = [{
        "index": k,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": _chat_logprobs(state, out.token_ids, out.logprobs, out.top_logprobs,
                                   as_ids=as_ids),
        "finish_reason": out.finish_reason,
        "stop_reason": getattr(out, "stop_reason", None),
    } for k, out in enumerate(outs)]
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
        "choices": choices,
        "usage": _usage(len(ids), sum(len(o.token_ids) for o in outs)),
    })


async def _chat_events(state: ServerState, items: AsyncIterator[tuple[int, Any]],
                       head: dict[str, Any], prompt_tokens: int, *, as_ids: bool,
                       usage: bool) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        started: set[int] = set()
        completion_tokens = 0
        async for index, delta in items:
            message: dict[str, Any] = {"content": delta.text}
            if index not in started:  # the first chunk of a choice names its role
                started.add(index)
                message = {"role": "assistant"} | message
            completion_tokens += len(delta.token_ids)
            yield event(dict(head, choices=[{
                "index": index, "delta": message,
                "logprobs": _chat_logprobs(state, delta.token_ids, delta.logprobs,
                                           delta.top_logprobs, as_ids=as_ids),
                "finish_reason": delta.finish_reason,
            }]))
        if usage:
            yield event(dict(head, choices=[], usage=_usage(prompt_tokens, completion_tokens)))

    async for item in sse.guarded(events(), fields=_CHAT_FIELDS):
        yield item


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "kvrunner",
            "root": str(state.model_path) if state.model_path else state.model_name,
            "max_model_len": state.max_model_len}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The one served model."""
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.check_model(model)
    return _model_card(state)
