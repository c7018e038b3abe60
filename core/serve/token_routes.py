"""vLLM's token-level routes: ``/inference/v1/generate`` (tokens in, tokens out, as TRL's
``VLLMClient`` and verifiers' training client call it), ``/tokenize`` and
``/detokenize``.

``/inference/v1/generate`` takes the prompt as ``token_ids`` and vLLM's own
``SamplingParams`` as JSON; its answer names every token ``token_id:<id>`` in the
logprobs, gives each choice's ``token_ids``, and the prompt's ids when
``return_token_ids`` asks. Multimodal ``features`` and ``content_parts`` are refused
by name (kvrunner serves text models).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from kvrunner.serve import answer_fields, generation, routed_experts, sse
from kvrunner.serve.body import parse_body
from kvrunner.serve.chat_messages import render_messages
from kvrunner.serve.errors import APIError
from kvrunner.serve.openai_protocol import (
    ChatMessage,
    NonNegativeInt,
    PositiveInt,
    StreamOptions,
    StrictModel,
    TokenIds,
    Tool,
)
from kvrunner.serve.request_params import (
    Asked,
    max_new_tokens,
    sampling_params,
    truncated,
    vllm_asked,
)
from kvrunner.serve.state import ServerState, new_id

router = APIRouter()

#: words of an engine's refusal -> the field it is about (see errors.engine_error)
_FIELDS = {name: f"sampling_params.{name}"
           for name in ("stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words")
           } | {"token id": "token_ids", "prompt": "token_ids"}


class VLLMSamplingParams(StrictModel):
    """vLLM's ``SamplingParams`` as JSON (the body of ``/inference/v1/generate``)."""

    n: PositiveInt = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: float = 0.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    #: None: every token the model's length leaves after the prompt
    max_tokens: PositiveInt | None = None
    min_tokens: NonNegativeInt = 0
    logprobs: NonNegativeInt | None = None
    prompt_logprobs: NonNegativeInt | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: vLLM's RequestOutputKind: 0 cumulative, 1 delta, 2 final only (an answer that is
    #: not streamed is final whatever it says)
    output_kind: Literal[0, 1, 2] = 0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[NonNegativeInt] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    structured_outputs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None
    #: each choice's ``routed_experts`` leaves out the rows of the prompt's first N
    #: tokens (a server started with ``--enable-return-routed-experts`` gives every
    #: choice its routes, as vLLM's; verifiers' training client sets it on a turn that
    #: extends the last one)
    routed_experts_prompt_start: NonNegativeInt = 0


class TokensGenerateRequest(StrictModel):
    """``POST /inference/v1/generate``."""

    token_ids: TokenIds
    sampling_params: VLLMSamplingParams = Field(default_factory=VLLMSamplingParams)
    request_id: str | None = None
    model: str | None = None
    features: dict[str, Any] | None = None
    #: raw media for the server to place in the prompt (refused: text models only)
    content_parts: list[dict[str, Any]] | None = None
    #: answer the prompt's token ids (``prompt_token_ids``; a stream's first chunk)
    return_token_ids: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: vLLM's prefix-cache namespace: only requests with the same salt share cached KV
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


class TokenizeRequest(StrictModel):
    """``POST /tokenize``: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[NonNegativeInt]


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _logprobs(token_ids: list[int], logprobs: list[float | None] | None,
              tops: list[dict[int, float] | None] | None, asked: int) -> dict[str, Any] | None:
    """vLLM's token logprobs: every token ``token_id:<id>``, its logprob, and the first
    ``max(asked, 1)`` of (the sampled token, then the top-N)."""
    if logprobs is None:
        return None
    content = []
    for i, (token, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        entries = {token: lp, **{t: v for t, v in ((tops[i] if tops else None) or {}).items()
                                 if t != token}}
        content.append({
            "token": f"token_id:{token}", "logprob": max(lp, -9999.0),
            "top_logprobs": [{"token": f"token_id:{t}", "logprob": max(v, -9999.0)}
                             for t, v in list(entries.items())[:max(asked, 1)]],
        })
    return {"content": content}


@router.post("/inference/v1/generate")
async def generate_tokens(request: Request) -> Any:
    """vLLM's tokens-in, tokens-out generate: one prompt of token ids, ``n`` samples."""
    state = _state(request)
    body = await parse_body(request, TokensGenerateRequest)
    state.check_model(body.model)
    # an empty content_parts holds no media (vLLM's own check skips it)
    for name, given in (("features", body.features is not None),
                        ("content_parts", bool(body.content_parts))):
        if given:
            raise APIError(400, f"multimodal {name} are not supported by kvrunner (it "
                           "serves text models)", param=name)
    for name, neutral in (("priority", 0), ("kv_transfer_params", None)):
        if getattr(body, name) != neutral:
            raise APIError(400, f"{name}={getattr(body, name)!r} is not supported by kvrunner",
                           param=name)
    state.admission.require_open()
    sp = body.sampling_params
    ids = truncated(list(body.token_ids), sp.truncate_prompt_tokens, state.max_model_len)
    routed_experts.check_prompt_start(sp.routed_experts_prompt_start, len(ids),
                                      param="sampling_params.routed_experts_prompt_start")
    asked = vllm_asked(sp, max_tokens=max_new_tokens(sp.max_tokens, len(ids),
                                                     state.max_model_len),
                       logprobs=Asked("sampling_params.logprobs", sp.logprobs),
                       recording_routes=state.records_routes)
    asked = {field: Asked(f"sampling_params.{given.name}", given.value)
             for field, given in asked.items()}
    jobs = [(ids, sampling_params(state, asked))]
    rid = body.request_id or new_id("generate-tokens")
    head = {"id": rid, "request_id": rid}
    prompt = {"prompt_token_ids": ids} if body.return_token_ids else {}
    asked_top = sp.logprobs or 0
    if body.stream:
        items = await generation.start_stream(state.engine, jobs, rid, fields=_FIELDS,
                                              cache_salt=body.cache_salt)
        usage = body.stream_options is not None and body.stream_options.include_usage
        return sse.response(_events(items, head, prompt, len(ids), asked_top, usage,
                                    sp.routed_experts_prompt_start))
    outs = (await generation.run(state.engine, jobs, rid, request, fields=_FIELDS,
                                 cache_salt=body.cache_salt))[0]
    choices = [{
        "index": k,
        "logprobs": _logprobs(out.token_ids, out.logprobs, out.top_logprobs, asked_top),
        "finish_reason": out.finish_reason or "stop",
        "token_ids": list(out.token_ids),
    } | answer_fields.choice_versions(out)
        | routed_experts.choice_routes(out, sp.routed_experts_prompt_start)
        for k, out in enumerate(outs)]
    completion = sum(len(out.token_ids) for out in outs)
    return JSONResponse(dict(head, model=state.model_name, choices=choices, **prompt,
                             prompt_logprobs=None, weight_version=outs[-1].weight_version,
                             usage=answer_fields.usage(len(ids), completion,
                                          sum(out.num_cached_tokens for out in outs))))


async def _events(items: AsyncIterator[tuple[int, Any]], head: dict[str, Any],
                  prompt: dict[str, Any], prompt_tokens: int, asked_top: int, usage: bool,
                  routes_from: int = 0) -> AsyncIterator[str]:
    """The answer's chunks: the first carries ``prompt`` (the prompt's ids, when asked);
    a choice's last one its weight versions and its ``routed_experts`` (from the
    prompt row ``routes_from`` on) when it has them."""

    async def events() -> AsyncIterator[str]:
        completion = cached = 0
        first = prompt  # the prompt's ids ride on the first chunk only, as vLLM's
        async for index, delta in items:
            completion += len(delta.token_ids)
            cached += delta.output.num_cached_tokens if delta.output is not None else 0
            if not delta.token_ids and delta.finish_reason is None:
                continue
            extra, first = first, {}
            yield sse.event(dict(head, **extra, weight_version=delta.weight_version, choices=[{
                "index": index, "finish_reason": delta.finish_reason,
                "token_ids": list(delta.token_ids),
                "logprobs": _logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs,
                                      asked_top),
            } | answer_fields.final_choice_versions(delta)
                | routed_experts.choice_routes(delta.output, routes_from)]))
        if usage:
            yield sse.event(dict(head, choices=[], usage=answer_fields.usage(
                prompt_tokens, completion, cached)))

    async for item in sse.guarded(events(), fields=_FIELDS):
        yield item


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's tokenize: ``prompt`` (special tokens added unless told not to) or
    ``messages`` (rendered by the chat template, none added)."""
    state = _state(request)
    body = await parse_body(request, TokenizeRequest)
    state.check_model(body.model)
    tokens = state.tokens
    if tokens is None:
        raise APIError(400, "the model has no tokenizer", param="prompt")
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages",
                       param="prompt" if body.prompt is None else "messages")
    if body.prompt is not None:
        text, special, param = body.prompt, body.add_special_tokens is not False, "prompt"
    else:
        param = "messages"
        text = await render_messages(state, body.messages, tools=body.tools,
                                     add_generation_prompt=body.add_generation_prompt,
                                     template_kwargs=body.chat_template_kwargs)
        special = bool(body.add_special_tokens)
    encoding = await tokens.encode(text, param=param, add_special_tokens=special)
    return {"count": len(encoding.ids), "max_model_len": state.max_model_len,
            "tokens": list(encoding.ids),
            "token_strs": list(encoding.tokens) if body.return_token_strs else None}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    """vLLM's detokenize: the text of ``tokens``."""
    state = _state(request)
    body = await parse_body(request, DetokenizeRequest)
    state.check_model(body.model)
    if state.tokens is None:
        raise APIError(400, "the model has no tokenizer", param="tokens")
    return {"prompt": await state.tokens.decode(body.tokens, skip_special_tokens=False)}
