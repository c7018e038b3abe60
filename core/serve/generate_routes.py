"""``/generate`` in SGLang's shape, the route slime, AReaL and verl's SGLang clients
call: one prompt or a batch (``input_ids`` or ``text``), SGLang's sampling fields,
``return_logprob`` with ``logprob_start_len`` and ``top_logprobs_num``, streamed as
SGLang streams it; kvrunner's ``return_kept_mass`` adds each output token's kept mass
(``meta_info.output_token_kept_mass``). Names and JSON fields are SGLang's, so a client written for
SGLang's http_server works unchanged. The RL control routes beside it (pause,
continue, flush, release, resume, update from disk) are ``control_routes.py``'s.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvrunner.serve import generation, routed_experts, sse
from kvrunner.serve.body import off_loop, parse_json, read_body
from kvrunner.serve.errors import APIError
from kvrunner.serve.request_params import (
    Asked,
    max_new_tokens,
    refuse_unsupported,
    sampling_params,
)
from kvrunner.serve.rl_protocol import (
    BatchGenerateRequest,
    GenerateRequest,
    SGLangSamplingParams,
)
from kvrunner.serve.sse import event
from kvrunner.serve.state import ServerState, new_id
from kvrunner.serve.structured_fields import sglang_constraint

router = APIRouter()

#: SGLang's sampling fields kvrunner accepts at their neutral value only: stop regexes,
#: custom logit-processor parameters, per-request stream chunking
_NEUTRAL = {"stop_regex": None, "custom_params": None, "stream_interval": None}
#: SGLang's sampling extras the engine does: SGLang's name -> ``SamplingParams``' field
#: (the penalties and the bias under SGLang's rules: ``penalty_rules="sglang"``)
SGLANG_EXTRAS = {"frequency_penalty": "frequency_penalty",
                 "presence_penalty": "presence_penalty",
                 "repetition_penalty": "repetition_penalty", "min_p": "min_p",
                 "min_new_tokens": "min_tokens", "logit_bias": "logit_bias",
                 "no_stop_trim": "include_stop_str_in_output",
                 "skip_special_tokens": "skip_special_tokens",
                 "spaces_between_special_tokens": "spaces_between_special_tokens"}
#: GenerateReqInput's fields kvrunner accepts empty (or off) only: multimodal inputs,
#: LoRA, hidden states, custom logit processors, disaggregation
_NEUTRAL_REQUEST = {"image_data": None, "video_data": None, "audio_data": None,
                    "lora_path": None, "lora_id": None, "return_hidden_states": False,
                    "custom_logit_processor": None, "bootstrap_host": None,
                    "bootstrap_port": None, "bootstrap_room": None, "input_embeds": None,
                    "token_ids_logprob": None, "data_parallel_rank": None}


def _fields(prompt_field: str) -> dict[str, str]:
    """Words of an engine's refusal -> the field it is about (see errors.engine_error)."""
    return {"logit_bias": "sampling_params.logit_bias",
            "stop_token_ids": "sampling_params.stop_token_ids", "token id": prompt_field,
            "prompt": prompt_field}


def _state(request: Request) -> ServerState:
    return request.app.state.server


def score_only(body: GenerateRequest) -> bool:
    """``max_new_tokens`` 0: the prompt is scored and nothing is generated. The engine
    runs the prefill as for one new token (it samples one) and the route drops that
    token: the answer has no output tokens, text or output logprobs."""
    return body.sampling_params.max_new_tokens == 0


def logprob_start(body: GenerateRequest, prompt_len: int) -> int | None:
    """The prompt position ``input_token_logprobs`` starts at, as SGLang resolves
    ``logprob_start_len``: -1 is the last prompt token (past the prompt, so none, for a
    score-only request); None without ``return_logprob`` (then the field is ignored).

    :raises APIError: a start past the last position the request can report.
    """
    if not body.return_logprob:
        return None
    last = prompt_len if score_only(body) else prompt_len - 1
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    if start == -1:
        return last
    if start > last:
        raise APIError(400, f"logprob_start_len={start} is beyond the prompt: it must be at "
                       f"most {last} (the prompt has {prompt_len} tokens"
                       + (", and a score-only request may start past its end)"
                          if score_only(body) else ")"), param="logprob_start_len")
    return start


def _params(state: ServerState, body: GenerateRequest, prompt_len: int,
            start: int | None) -> Any:
    sp: SGLangSamplingParams = body.sampling_params
    refuse_unsupported(sp, _NEUTRAL, prefix="sampling_params.")
    refuse_unsupported(body, _NEUTRAL_REQUEST)
    given = sp.model_fields_set
    # the engine scores a prompt position p > 0 from the logits at p - 1; SGLang's first
    # entry (at ``start``) has no logprob, so only a start before the last token needs
    # the prompt scored (which costs the prefix-cache hit: see SamplingParams)
    scored = start is not None and start < prompt_len - 1
    top = Asked("top_logprobs_num", body.top_logprobs_num)
    asked = {
        "max_tokens": Asked("sampling_params.max_new_tokens", 1 if score_only(body)
                            else max_new_tokens(sp.max_new_tokens, prompt_len,
                                                state.max_model_len)),
        "seed": Asked("sampling_params.sampling_seed", sp.sampling_seed),
        "logprobs": top if body.return_logprob else Asked(top.name),
        "prompt_logprobs": top if scored else Asked(top.name),
        "ignore_eos": Asked("sampling_params.ignore_eos",
                            sp.ignore_eos if "ignore_eos" in given else None),
        "return_kept_mass": Asked("return_kept_mass", body.return_kept_mass or None),
        "return_routed_experts": Asked("return_routed_experts", True if routed_experts.wanted(
            body.return_routed_experts, recording=state.records_routes) else None),
    }
    for name in ("stop", "stop_token_ids", "n"):
        asked[name] = Asked(f"sampling_params.{name}", getattr(sp, name))
    for name in ("temperature", "top_p", "top_k"):
        asked[name] = Asked(f"sampling_params.{name}",
                            getattr(sp, name) if name in given else None)
    asked |= sglang_extras(sp)
    asked["structured_outputs"] = Asked(*sglang_constraint(sp))
    return sampling_params(state, asked, bias_limit=None)


def sglang_extras(sp: SGLangSamplingParams) -> dict[str, Asked]:
    """The engine fields of SGLang's sampling extras (:data:`SGLANG_EXTRAS`), each by its
    SGLang name; one left out or null keeps the engine's default. The penalties and
    ``logit_bias`` always follow SGLang's rules (``penalty_rules="sglang"``: the
    repetition penalty counts the output's tokens alone, after the frequency and
    presence penalties; the bias is added last)."""
    asked = {field: Asked(f"sampling_params.{name}", getattr(sp, name))
             for name, field in SGLANG_EXTRAS.items()}
    asked["penalty_rules"] = Asked("sampling_params", "sglang")
    return asked


#: the message of an abort a client or a pause asked for
ABORTED = "Aborted"


def _finish_reason(out: Any, score_only: bool) -> dict[str, Any] | None:
    """SGLang's finish-reason object: ``length`` / ``stop`` / ``abort``, the last with
    SGLang's ``message``, ``status_code`` and ``err_type``. SGLang has no finish reason
    for a failed request, only an abort carrying the error, which slime and AReaL
    already drop or retry; so kvrunner's ``"error"`` (a non-finite logits row) is such an
    abort, status 500, its message the cause (``"step 12 (output token 3): logits hold
    NaN"``). An abort that was asked for has no status, as in SGLang."""
    reason = out.finish_reason
    if reason is None:
        return None
    if score_only and reason in ("length", "stop"):  # the dropped token ended it
        return {"type": "length", "length": 0}
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


def _logprob_triples(state: ServerState, token_ids: list[int],
                     logprobs: list[float | None], with_text: bool) -> list[list[Any]]:
    return [[lp, t, state.token_text(t) if with_text else None]
            for t, lp in zip(token_ids, logprobs, strict=True)]


def _top_triples(state: ServerState, top: dict[int, float] | None,
                 with_text: bool) -> list[list[Any]] | None:
    if top is None:
        return None
    return [[lp, t, state.token_text(t) if with_text else None] for t, lp in top.items()]


def _input_logprobs(state: ServerState, body: GenerateRequest, out: Any,
                    prompt: list[int], start: int) -> dict[str, Any]:
    """SGLang's ``input_token_logprobs`` (and ``input_top_logprobs``): one entry per
    prompt position from ``start`` to the end, the first with a null logprob (SGLang
    computes logits from ``start`` on, so the token there has none), entry ``k`` the
    logprob of ``prompt[start + k]`` given the tokens before it. A request ended before
    its prefill did (an abort) has entries for the positions scored by then only."""
    scored = out.prompt_logprobs  # None: no position after ``start`` needed scoring
    end = len(prompt) if scored is None else min(len(prompt), len(scored))
    positions = range(start + 1, end)
    text = body.return_text_in_logprobs
    tail = prompt[start:end]
    values = [None, *(scored[p] for p in positions)] if tail else []
    meta = {"input_token_logprobs": _logprob_triples(state, tail, values, text)}
    if body.top_logprobs_num:
        tops = out.prompt_top_logprobs
        meta["input_top_logprobs"] = [None, *(_top_triples(state, tops[p], text)
                                              for p in positions)] if tail else []
    return meta


def _meta(state: ServerState, body: GenerateRequest, out: Any, rid: str, *,
          prompt: list[int], started: float) -> dict[str, Any]:
    only = score_only(body)
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_reason(out, only),
        "prompt_tokens": len(prompt),
        "completion_tokens": 0 if only else len(out.token_ids),
        "cached_tokens": getattr(out, "num_cached_tokens", 0),
        "weight_version": _weight_version(state, out),
        "e2e_latency": time.perf_counter() - started,
    }
    spans = getattr(out, "weight_versions", None)
    if spans:  # a finished request: which of its tokens each weight version made
        meta["weight_versions"] = [[version, start] for version, start in spans]
    routes = getattr(out, "routed_experts", None)
    if body.return_routed_experts and routes is not None:  # a finished request's
        meta["routed_experts"] = routed_experts.flat_int32_base64(routes)
    if body.return_logprob and out.logprobs is not None:
        text = body.return_text_in_logprobs
        start = logprob_start(body, len(prompt))
        assert start is not None  # return_logprob
        meta |= _input_logprobs(state, body, out, prompt, start)
        kept = 0 if only else len(out.token_ids)
        meta["output_token_logprobs"] = _logprob_triples(
            state, out.token_ids[:kept], out.logprobs[:kept], text)
        if body.top_logprobs_num:
            meta["output_top_logprobs"] = [_top_triples(state, top, text)
                                           for top in (out.top_logprobs or [])[:kept]]
    if body.return_kept_mass:
        meta["output_token_kept_mass"] = [] if only else list(out.kept_mass or [])
    return meta


def _one(state: ServerState, body: GenerateRequest, out: Any, rid: str, *,
         prompt: list[int], started: float) -> dict[str, Any]:
    only = score_only(body)
    return {"text": "" if only else out.text,
            "output_ids": [] if only else list(out.token_ids),
            "meta_info": _meta(state, body, out, rid, prompt=prompt, started=started)}


#: ``/generate``'s fields that a batch gives per prompt (one value, or a list of them)
_PER_PROMPT = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
               "extra_key")


async def _generate_body(request: Request) -> GenerateRequest | BatchGenerateRequest:
    """The body as one request, or as a batch when its prompts are a list (parsed off
    the event loop when large: :func:`~kvrunner.serve.body.off_loop`)."""
    return await off_loop(await read_body(request), _parse_generate)


def _parse_generate(raw: bytes) -> GenerateRequest | BatchGenerateRequest:
    data = None
    with contextlib.suppress(ValueError, UnicodeDecodeError):  # parse_json's 400
        data = json.loads(raw)
    batch = BatchGenerateRequest.is_batch(data)
    return parse_json(raw, BatchGenerateRequest if batch else GenerateRequest)


def _batch_items(body: BatchGenerateRequest, prompt_field: str) -> list[GenerateRequest]:
    """A batch as one request per prompt, each with its own per-prompt fields."""
    prompts = getattr(body, prompt_field)
    count = len(prompts)
    if body.rid is not None and len(body.rid) != count:
        raise APIError(400, f"rid has {len(body.rid)} entries for {count} prompts", param="rid")
    items = []
    for i, prompt in enumerate(prompts):
        fields: dict[str, Any] = {prompt_field: prompt, "stream": body.stream,
                                  "return_text_in_logprobs": body.return_text_in_logprobs,
                                  "return_kept_mass": body.return_kept_mass,
                                  "return_routed_experts": body.return_routed_experts,
                                  "rid": None if body.rid is None else body.rid[i]}
        for name in _PER_PROMPT:
            value = getattr(body, name)
            if isinstance(value, list):
                if len(value) != count:
                    raise APIError(400, f"{name} has {len(value)} entries for {count} "
                                   f"prompts", param=name)
                value = value[i]
            fields[name] = value
        items.append(GenerateRequest.model_construct(**fields))
    return items


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Any:
    """SGLang's native generate: ``text`` or ``input_ids``, ``sampling_params``,
    ``return_logprob`` (with ``logprob_start_len`` and ``top_logprobs_num``), ``rid``,
    ``stream``; ``n`` > 1 answers a list, and so does a batch (a list of prompts: one
    answer per prompt and sample, prompt-major)."""
    state = _state(request)
    body = await _generate_body(request)
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids",
                       param="input_ids" if body.text is None else "text")
    state.admission.require_open()
    field = "text" if body.text is not None else "input_ids"
    batch = isinstance(body, BatchGenerateRequest)
    items = _batch_items(body, field) if batch else [body]
    prompts = [await state.prompt_ids(getattr(item, field),
                                      param=f"{field}.{i}" if batch else field)
               for i, item in enumerate(items)]
    jobs = [(ids, _params(state, item, len(ids), logprob_start(item, len(ids))))
            for item, ids in zip(items, prompts, strict=True)]
    rids = [item.rid or new_id("gen") for item in items]
    # every answer (prompt-major, then sample): its request, prompt and id
    choices = [(item, ids, rid if item.sampling_params.n == 1 else f"{rid}-{k}")
               for item, ids, rid in zip(items, prompts, rids, strict=True)
               for k in range(item.sampling_params.n)]
    salts = [item.extra_key for item in items]
    started = time.perf_counter()
    if body.stream:
        events = await generation.start_stream(state.engine, jobs, rids, fields=_fields(field),
                                               cache_salt=salts)
        return sse.response(_events(state, events, choices, started,
                                    many=len(choices) > 1, fields=_fields(field)))
    results = await generation.run(state.engine, jobs, rids, request, fields=_fields(field),
                                   cache_salt=salts)
    outs = [out for job_outs in results for out in job_outs]
    answers = [_one(state, item, out, rid, prompt=ids, started=started)
               for (item, ids, rid), out in zip(choices, outs, strict=True)]
    return JSONResponse(answers if batch or len(answers) > 1 else answers[0])


class _Progress:
    """One stream's output so far (SGLang's stream events are cumulative)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.kept_mass: list[float] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.error: str | None = None
        self.weight_version: Any = None
        self.weight_versions: Any = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_top_logprobs: list[dict[int, float] | None] | None = None
        self.routed_experts: Any = None

    def add(self, delta: Any) -> None:
        self.token_ids += list(delta.token_ids)
        self.logprobs += list(delta.logprobs or ())
        self.top_logprobs += list(delta.top_logprobs or ())
        self.kept_mass += list(delta.kept_mass or ())
        self.text += delta.text or ""
        self.finish_reason = delta.finish_reason
        self.weight_version = delta.weight_version
        if delta.prompt_logprobs is not None:  # the first delta: the prompt's scores
            self.prompt_logprobs = delta.prompt_logprobs
            self.prompt_top_logprobs = delta.prompt_top_logprobs
        final = getattr(delta, "output", None)
        if final is not None:  # the last delta carries the whole output: take its facts
            self.text = final.text
            self.stop_reason = getattr(final, "stop_reason", None)
            self.error = getattr(final, "error", None)
            self.weight_version = getattr(final, "weight_version", None)
            self.weight_versions = getattr(final, "weight_versions", None)
            self.routed_experts = getattr(final, "routed_experts", None)
            self.num_cached_tokens = final.num_cached_tokens


async def _events(state: ServerState, items: AsyncIterator[tuple[int, Any]],
                  choices: list[tuple[GenerateRequest, list[int], str]], started: float, *,
                  many: bool, fields: dict[str, str]) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        progress: dict[int, _Progress] = {}
        async for index, delta in items:
            seen = progress.setdefault(index, _Progress())
            seen.add(delta)
            item, prompt, rid = choices[index]
            chunk = _one(state, item, _OutputView(seen), rid, prompt=prompt, started=started)
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
        self.kept_mass = seen.kept_mass
        self.text = seen.text
        self.finish_reason = seen.finish_reason
        self.stop_reason = seen.stop_reason
        self.error = seen.error
        self.weight_version = seen.weight_version
        self.weight_versions = seen.weight_versions
        self.num_cached_tokens = seen.num_cached_tokens
        self.prompt_logprobs = seen.prompt_logprobs
        self.prompt_top_logprobs = seen.prompt_top_logprobs
        self.routed_experts = seen.routed_experts
