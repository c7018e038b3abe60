"""The OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Shaped so that the official ``openai`` client works unchanged: the same JSON, the same
server-sent events ending in ``data: [DONE]``. Logprobs are the engine's own (the
sampled token's logprob under the distribution it was drawn from, as
``LLM.generate`` returns them); ``top_logprobs`` keys are token texts, or
``token_id:<id>`` with vLLM's ``return_tokens_as_token_ids``.

Beside OpenAI's fields every answer carries ``weight_version`` (its last choice's:
the version that choice's last token was made under), every stream chunk the version
its tokens were made under, and every choice its own, with ``weight_versions``
(``[version, first token index]`` spans) when its tokens came from more than one.
``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens taken from the
prefix cache, which vLLM's ``cache_salt`` scopes. On a server that records routed
experts every choice carries vLLM's ``routed_experts`` (a stream: on each choice's last
chunk; serve/routed_experts.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvrunner.serve import answer_fields, generation, routed_experts, sse
from kvrunner.serve.body import parse_body
from kvrunner.serve.chat_messages import render_messages
from kvrunner.serve.chat_parsing import ChatParsing, chat_parsing, reasoning_end_token_id
from kvrunner.serve.errors import APIError
from kvrunner.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from kvrunner.serve.parsers.parsed import OutputStream
from kvrunner.serve.request_params import (
    Asked,
    max_new_tokens,
    refuse_unsupported,
    sampling_params,
    truncated,
    vllm_asked,
)
from kvrunner.serve.sse import event
from kvrunner.serve.state import ServerState, new_id

router = APIRouter()

#: words of an engine's refusal -> the field it is about (see errors.engine_error)
_SAMPLING_FIELDS = {name: name for name in ("stop_token_ids", "logit_bias", "allowed_token_ids",
                                             "bad_words")}
_FIELDS = _SAMPLING_FIELDS | {"token id": "prompt", "prompt": "prompt"}
_CHAT_FIELDS = _SAMPLING_FIELDS | {"token id": "messages", "prompt": "messages"}


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _params(state: ServerState, body: SamplingFields, *, max_tokens: int | None,
            prompt_len: int, logprobs: int | None, logprobs_name: str,
            prompt_logprobs: int | None = None) -> Any:
    """The SamplingParams of one prompt of ``body`` (``prompt_logprobs``: the prompt's
    own logprobs and top-N, for ``echo``; else the body's own ``prompt_logprobs``)."""
    routed_experts.check_prompt_start(body.routed_experts_prompt_start, prompt_len)
    asked = vllm_asked(
        body, max_tokens=max_new_tokens(max_tokens, prompt_len, state.max_model_len),
        logprobs=Asked(logprobs_name, logprobs), recording_routes=state.records_routes,
        prompt_logprobs=None if prompt_logprobs is None
        else Asked("logprobs", prompt_logprobs))
    return sampling_params(state, asked)


def _token_text(state: ServerState, token_id: int, as_ids: bool) -> str:
    if as_ids or state.tokens is None:
        return f"token_id:{token_id}"
    return state.token_text(token_id, skip_special_tokens=False)


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
    # vLLM's shape: at every scored position the sampled token's own entry, then the
    # top-N (up to N + 1 entries; ``logprobs=0`` gives the sampled token's alone)
    top_logprobs = []
    for i, (token, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        if lp is None:
            top_logprobs.append(None)
            continue
        entry = {tokens[i]: _finite(lp)}
        for t, value in ((tops[i] if tops else None) or {}).items():
            if t != token:
                entry[_token_text(state, t, as_ids)] = _finite(value)
        top_logprobs.append(entry)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else _finite(lp) for lp in logprobs],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf is vLLM's (and OpenAI's) -9999.0."""
    return max(logprob, -9999.0)


def _prompt_logprobs(state: ServerState, prompt: list[int], out: Any) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per position a
    ``{token_id: {logprob, rank, decoded_token}}`` of the prompt token and the top-N
    there (rank 1 is the likeliest)."""
    scored = getattr(out, "prompt_logprobs", None)
    if scored is None:
        return None
    tops = getattr(out, "prompt_top_logprobs", None) or [None] * len(scored)
    ranks = getattr(out, "prompt_ranks", None) or [None] * len(scored)
    answer: list[Any] = [None]
    for p in range(1, min(len(prompt), len(scored))):
        token, lp = prompt[p], scored[p]
        top = list((tops[p] or {}).items())
        rank = ranks[p] if ranks[p] is not None else next(
            (r for r, (t, _) in enumerate(top, start=1) if t == token), None)
        entry = {str(token): {"logprob": _finite(lp), "rank": rank,
                              "decoded_token": state.token_text(token)}}
        for r, (t, value) in enumerate(top, start=1):
            entry.setdefault(str(t), {"logprob": _finite(value), "rank": r,
                                      "decoded_token": state.token_text(t)})
        answer.append(entry)
    return answer


def _chat_logprobs(state: ServerState, token_ids: list[int], logprobs: list[float] | None,
                   tops: list[dict[int, float]] | None, *, as_ids: bool
                   ) -> dict[str, Any] | None:
    if logprobs is None:
        return None

    def entry(token_id: int, lp: float) -> dict[str, Any]:
        text = _token_text(state, token_id, as_ids)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode())}

    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        item = entry(t, lp)
        item["top_logprobs"] = [entry(k, v) for k, v in tops[i].items()] if tops else []
        content.append(item)
    return {"content": content}


async def _prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    """The completion body's prompt as a list of token-id prompts, each truncated as
    ``truncate_prompt_tokens`` asks."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [await state.prompt_ids(prompt, param="prompt")]
    elif not prompt:
        raise APIError(400, "prompt is an empty list", param="prompt")
    else:
        prompts = [await state.prompt_ids(p, param=f"prompt.{i}")
                   for i, p in enumerate(prompt)]
    return [truncated(ids, body.truncate_prompt_tokens, state.max_model_len)
            for ids in prompts]


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
    prompts = await _prompts(state, body)
    # echo with logprobs scores the prompt too (SamplingParams.prompt_logprobs, computed in
    # the prefill; such a request recomputes its prompt instead of taking a prefix hit)
    scored = body.logprobs if body.echo and body.logprobs is not None else None
    jobs = [(ids, _params(state, body, max_tokens=body.max_tokens, prompt_len=len(ids),
                          logprobs=body.logprobs, logprobs_name="logprobs",
                          prompt_logprobs=scored))
            for ids in prompts]
    rid, created = new_id("cmpl"), int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created,
            "model": state.model_name}
    as_ids = body.return_tokens_as_token_ids
    if body.stream:
        items = await generation.start_stream(state.engine, jobs, rid, fields=_FIELDS,
                                              cache_salt=body.cache_salt)
        usage = body.stream_options is not None and body.stream_options.include_usage
        return sse.response(_completion_events(state, items, head, jobs, as_ids=as_ids,
                                               usage=usage, mass=body.return_kept_mass,
                                               routes_from=body.routed_experts_prompt_start))
    results = await generation.run(state.engine, jobs, rid, request, fields=_FIELDS,
                                   cache_salt=body.cache_salt)
    choices, completion_tokens = [], 0
    for (ids, _), outs in zip(jobs, results, strict=True):
        echoed = await state.tokens.decode(ids, skip_special_tokens=False) \
            if body.echo and state.tokens is not None else ""
        for out in outs:
            logprobs = _completion_logprobs(state, out.token_ids, out.logprobs,
                                            out.top_logprobs, as_ids=as_ids,
                                            offset=len(echoed))
            if body.echo and logprobs is not None:
                logprobs = _echoed_logprobs(state, ids, out, logprobs, as_ids=as_ids)
            choice = {
                "index": len(choices),
                "text": echoed + out.text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
                "stop_reason": getattr(out, "stop_reason", None),
            } | answer_fields.choice_versions(out)
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs(state, ids, out)
            if body.return_token_ids:
                choice["prompt_token_ids"] = list(ids)
                choice["token_ids"] = list(out.token_ids)
            if body.return_kept_mass:
                choice["kept_mass"] = list(out.kept_mass or [])
            choice |= routed_experts.choice_routes(out, body.routed_experts_prompt_start)
            choices.append(choice)
            completion_tokens += len(out.token_ids)
    cached = sum(out.num_cached_tokens for outs in results for out in outs)
    return JSONResponse(dict(head, choices=choices,
                             weight_version=results[-1][-1].weight_version,
                             usage=answer_fields.usage(sum(len(p) for p in prompts),
                                                       completion_tokens, cached)))


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
                             usage: bool, mass: bool = False,
                             routes_from: int = 0) -> AsyncIterator[str]:
    """The completion's chunks; a choice's last chunk (its finish reason) carries its
    weight versions and, when the request gets them, its ``routed_experts`` from the
    prompt row ``routes_from`` on."""
    async def events() -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        completion_tokens = cached = 0
        async for index, delta in items:
            logprobs = _completion_logprobs(state, delta.token_ids, delta.logprobs,
                                            delta.top_logprobs, as_ids=as_ids,
                                            offset=offsets.get(index, 0))
            if logprobs is not None:
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
            completion_tokens += len(delta.token_ids)
            cached += delta.output.num_cached_tokens if delta.output is not None else 0
            choice = {"index": index, "text": delta.text, "logprobs": logprobs,
                      "finish_reason": delta.finish_reason}
            if mass:
                choice["kept_mass"] = list(delta.kept_mass or [])
            choice |= answer_fields.final_choice_versions(delta)
            choice |= routed_experts.choice_routes(delta.output, routes_from)
            yield event(dict(head, weight_version=delta.weight_version, choices=[choice]))
        if usage:
            yield event(dict(head, choices=[], usage=answer_fields.usage(
                sum(len(ids) for ids, _ in jobs), completion_tokens, cached)))

    async for item in sse.guarded(events(), fields=_FIELDS):
        yield item


def _check_chat_features(body: ChatCompletionRequest) -> None:
    """A 400 naming what the request asks that kvrunner does not have (``tool_choice``:
    :func:`~kvrunner.serve.chat_parsing.chat_parsing`)."""
    if body.continue_final_message:
        raise APIError(400, "continue_final_message is not supported by kvrunner",
                       param="continue_final_message")


async def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    _check_chat_features(body)
    text = await render_messages(state, body.messages, tools=body.tools,
                                 add_generation_prompt=body.add_generation_prompt,
                                 template_kwargs=body.chat_template_kwargs,
                                 template_source=body.chat_template)
    # the template writes the special tokens itself: none are added again unless asked
    ids = await state.prompt_ids(text, param="messages",
                                 add_special_tokens=body.add_special_tokens)
    ids = truncated(ids, body.truncate_prompt_tokens, state.max_model_len)
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
    end_id = reasoning_end_token_id(body, state.settings,
                                    None if state.tokens is None else state.tokens.tokenizer)
    parsing = chat_parsing(body, state.settings, thinks_first=end_id is not None)
    state.admission.require_open()
    ids = await _chat_prompt(state, body)
    asked = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(state, body, max_tokens=asked, prompt_len=len(ids),
                     logprobs=logprobs, logprobs_name="top_logprobs")
    if end_id is not None and params.structured_outputs is not None:
        # the model thinks first; the grammar holds what follows the reasoning
        params = attrs.evolve(params, reasoning_end_token_id=end_id)
    jobs = [(ids, params)]
    rid, created = new_id("chatcmpl"), int(time.time())
    as_ids = body.return_tokens_as_token_ids
    if body.stream:
        items = await generation.start_stream(state.engine, jobs, rid, fields=_CHAT_FIELDS,
                                              cache_salt=body.cache_salt)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": state.model_name}
        usage = body.stream_options is not None and body.stream_options.include_usage
        return sse.response(_chat_events(state, items, head, len(ids), as_ids=as_ids,
                                         usage=usage, parsing=parsing,
                                         mass=body.return_kept_mass,
                                         routes_from=body.routed_experts_prompt_start))
    outs = (await generation.run(state.engine, jobs, rid, request, fields=_CHAT_FIELDS,
                                 cache_salt=body.cache_salt))[0]
    choices = [_chat_choice(state, k, out, parsing, as_ids=as_ids,
                            token_ids=body.return_token_ids, mass=body.return_kept_mass)
               | routed_experts.choice_routes(out, body.routed_experts_prompt_start)
               for k, out in enumerate(outs)]
    answer = {
        "id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
        "choices": choices, "weight_version": outs[-1].weight_version,
        "usage": answer_fields.usage(len(ids), sum(len(o.token_ids) for o in outs),
                        sum(o.num_cached_tokens for o in outs)),
    }
    if body.return_token_ids:
        answer["prompt_token_ids"] = list(ids)
    if body.prompt_logprobs is not None:
        answer["prompt_logprobs"] = _prompt_logprobs(state, ids, outs[0])
    return JSONResponse(answer)


def _chat_choice(state: ServerState, index: int, out: Any, parsing: ChatParsing | None, *,
                 as_ids: bool, token_ids: bool, mass: bool = False) -> dict[str, Any]:
    """One choice of a whole chat answer; with parsers, its reasoning and tool calls
    apart from its content, and its finish reason as :meth:`ChatParsing.finish_reason`
    gives it."""
    message: dict[str, Any] = {"role": "assistant", "content": out.text}
    finish_reason = out.finish_reason
    if parsing is not None:
        message, called = parsing.message(out.text)
        finish_reason = parsing.finish_reason(called, finish_reason)
    choice = {
        "index": index,
        "message": message,
        "logprobs": _chat_logprobs(state, out.token_ids, out.logprobs, out.top_logprobs,
                                   as_ids=as_ids),
        "finish_reason": finish_reason,
        "stop_reason": getattr(out, "stop_reason", None),
    } | answer_fields.choice_versions(out)
    if token_ids:
        choice["token_ids"] = list(out.token_ids)
    if mass:
        choice["kept_mass"] = list(out.kept_mass or [])
    return choice


async def _chat_events(state: ServerState, items: AsyncIterator[tuple[int, Any]],
                       head: dict[str, Any], prompt_tokens: int, *, as_ids: bool,
                       usage: bool, parsing: ChatParsing | None,
                       mass: bool = False, routes_from: int = 0) -> AsyncIterator[str]:
    """The chat answer's chunks; a choice's last chunk (its finish reason) carries its
    weight versions and, when the request gets them, its ``routed_experts`` from the
    prompt row ``routes_from`` on."""
    async def events() -> AsyncIterator[str]:
        # a choice's parser stream (None without parsers), from its first chunk
        streams: dict[int, OutputStream | None] = {}
        called: set[int] = set()
        completion_tokens = cached = 0
        async for index, delta in items:
            first = index not in streams
            if first:
                streams[index] = parsing.parser.stream() if parsing is not None else None
            message: dict[str, Any] = {"content": delta.text}
            finish_reason = delta.finish_reason
            stream = streams[index]
            if parsing is not None and stream is not None:
                pieces = stream.feed(delta.text)
                if finish_reason is not None:
                    pieces += stream.finish()
                message, calls = parsing.delta(pieces)
                if calls:
                    called.add(index)
                if finish_reason is not None:
                    finish_reason = parsing.finish_reason(index in called, finish_reason)
            if first:  # the first chunk of a choice names its role
                message = {"role": "assistant"} | message
            completion_tokens += len(delta.token_ids)
            cached += delta.output.num_cached_tokens if delta.output is not None else 0
            logprobs = _chat_logprobs(state, delta.token_ids, delta.logprobs,
                                      delta.top_logprobs, as_ids=as_ids)
            versions = answer_fields.final_choice_versions(delta)
            if (not message and finish_reason is None and logprobs is None and not mass
                    and not versions):
                continue  # the parser holds this text back (a tag not yet whole)
            choice = {"index": index, "delta": message, "logprobs": logprobs,
                      "finish_reason": finish_reason} | versions
            if mass:
                choice["kept_mass"] = list(delta.kept_mass or [])
            choice |= routed_experts.choice_routes(delta.output, routes_from)
            yield event(dict(head, weight_version=delta.weight_version, choices=[choice]))
        if usage:
            yield event(dict(head, choices=[], usage=answer_fields.usage(
                prompt_tokens, completion_tokens, cached)))

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
