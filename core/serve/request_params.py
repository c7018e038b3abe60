"""From a route's body to the engine's :class:`~kvrunner.SamplingParams`: one mapper for
every route family.

Each family names the engine's fields its own way (vLLM's ``max_tokens``, SGLang's
``sampling_params.max_new_tokens``); a route hands :func:`sampling_params` each
engine field as a :class:`Asked` (the client's name and value), and gets one
``SamplingParams`` checked once, by ``SamplingParams`` itself, with its error
re-labelled with the name the client used. A field the body leaves out takes the
engine's default (the checkpoint's ``generation_config.json``, as vLLM does), not the
protocol's. A documented field asking for what kvrunner does not do is refused by
name unless it holds its neutral value (:func:`refuse_unsupported`); vLLM's sampling
extras the engine does (:data:`VLLM_EXTRAS`) are passed on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from kvrunner.errors import RequestError
from kvrunner.sampling_params import SamplingParams
from kvrunner.serve import routed_experts
from kvrunner.serve.errors import APIError
from kvrunner.serve.state import ServerState
from kvrunner.serve.structured_fields import vllm_constraint

_FIELD = re.compile(r"SamplingParams\.(\w+)")

#: the vLLM family's fields kvrunner accepts at their neutral value only (completions,
#: chat completions, /inference/v1/generate): field -> the one value it may hold
VLLM_NEUTRAL: dict[str, Any] = {"priority": 0}

#: vLLM's sampling extras the engine does (``SamplingParams`` documents each), passed
#: on by the same name where the body sets them
VLLM_EXTRAS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p",
               "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
               "include_stop_str_in_output", "skip_special_tokens",
               "spaces_between_special_tokens")

#: vLLM clamps each logit bias to this range, as OpenAI documents it
_BIAS_LIMIT = 100.0


@attrs.frozen
class Asked:
    """One engine sampling field as the client gave it: its name in the client's
    protocol (errors name it) and its value (None: not set, the engine's default
    stands)."""

    name: str
    value: Any = None


def refuse_unsupported(body: Any, neutral: Mapping[str, Any], *, prefix: str = "") -> None:
    """A 400 for the first field of ``neutral`` the body sets to anything else: a client
    asking for a repetition penalty must not silently get none. An empty list or dict
    is the neutral value of a field whose neutral value is None."""
    for name, value in neutral.items():
        if not hasattr(body, name):
            continue
        got = getattr(body, name)
        if got != value and not (value is None and got in ({}, [])):
            raise APIError(
                400, f"{prefix}{name}={got!r} is not supported by kvrunner (only {value!r})",
                param=prefix + name,
            )


def sampling_params(state: ServerState, asked: Mapping[str, Asked], *,
                    bias_limit: float | None = _BIAS_LIMIT) -> SamplingParams:
    """The ``SamplingParams`` of one request: ``asked`` maps each engine field the route
    speaks of to what the client gave, over the engine's defaults, under this server's
    limits (:func:`resolve`)."""
    settings = state.settings
    return resolve(asked, defaults=state.engine.default_sampling_params,
                   max_n=settings.max_n, max_logprobs=settings.max_logprobs,
                   bias_limit=bias_limit)


def resolve(asked: Mapping[str, Asked], *, defaults: SamplingParams, max_n: int,
            max_logprobs: int, bias_limit: float | None = _BIAS_LIMIT) -> SamplingParams:
    """``asked`` over ``defaults`` as one ``SamplingParams``.

    Applies the server's limits (``--max-n``, ``--max-logprobs``) and the protocols'
    shared spellings: a negative ``top_k`` is off (0), a ``stop`` string is one stop,
    an empty stop list or ``stop_token_ids`` list is none, ``n`` 1 is the default,
    ``logit_bias`` keys are token ids as text, each bias clamped to ``bias_limit`` either
    side of 0 (vLLM's 100; None, as SGLang, keeps it as given).
    """
    values: dict[str, Any] = {}
    for field, given in asked.items():
        value = given.value
        if value is None:
            continue
        if field == "n":
            if value > max_n:
                raise APIError(400, f"{given.name}={value} is above this server's limit of "
                               f"{max_n} samples per request (--max-n)",
                               param=given.name)
            if value == 1:
                continue
        elif field in ("logprobs", "prompt_logprobs") and value > max_logprobs:
            raise APIError(400, f"{given.name}={value} is above this server's limit of "
                           f"{max_logprobs} (--max-logprobs)", param=given.name)
        elif field == "top_k":
            value = max(0, value)
        elif field == "stop":
            if value in ("", []):
                continue
            value = (value,) if isinstance(value, str) else tuple(value)
        elif field == "stop_token_ids":
            if not value:
                continue
            value = tuple(value)
        elif field == "logit_bias":
            value = _token_biases(value, given.name, bias_limit)
        elif field == "allowed_token_ids" and not value:
            continue  # an empty list: as the field left out (every token)
        values[field] = value
    names = {field: given.name for field, given in asked.items()}
    return build_params(values, names, defaults)


def _token_biases(value: Mapping[str, float], name: str,
                  limit: float | None) -> dict[int, float]:
    """A ``logit_bias`` of token ids as text as token ids, each bias clamped to
    [-limit, limit] (None: as given)."""
    biases: dict[int, float] = {}
    for token, bias in value.items():
        try:
            token_id = int(token)
        except ValueError:
            raise APIError(400, f"{name} keys must be token ids, got {token!r}",
                           param=name) from None
        biases[token_id] = bias if limit is None else min(limit, max(-limit, bias))
    return biases


def build_params(
    values: Mapping[str, Any], names: Mapping[str, str], defaults: SamplingParams
) -> SamplingParams:
    """``SamplingParams(**values)`` over ``defaults``; ``names`` maps each of its fields to
    the client's name for it, for the error."""
    known = attrs.fields_dict(SamplingParams)
    for name in values:
        if name not in known:
            raise APIError(400, f"{names.get(name, name)} is not supported by this kvrunner",
                           param=names.get(name, name))
    try:
        return attrs.evolve(defaults, **values)
    except RequestError as e:
        match = _FIELD.search(str(e))
        field = names.get(match.group(1), match.group(1)) if match else None
        message = str(e) if field is None else _FIELD.sub(field, str(e))
        raise APIError(400, message, param=field) from None


def max_new_tokens(asked: int | None, prompt_len: int, max_model_len: int) -> int:
    """``asked``, or (None) every token the model's length leaves after the prompt."""
    if asked is not None:
        return asked
    return max(1, max_model_len - prompt_len)


def vllm_asked(body: Any, *, max_tokens: int, logprobs: Asked, recording_routes: bool,
               prompt_logprobs: Asked | None = None) -> dict[str, Asked]:
    """The engine fields of a vLLM-family body (completions, chat completions, the
    ``sampling_params`` of ``/inference/v1/generate``): every shared field by its vLLM
    name, the sampling fields only where the client set them. ``recording_routes``: the
    server records routed experts, so a body that does not say
    ``return_routed_experts`` gets them (:func:`~kvrunner.serve.routed_experts.wanted`)."""
    refuse_unsupported(body, VLLM_NEUTRAL)
    given = body.model_fields_set
    routes = routed_experts.wanted(getattr(body, "return_routed_experts", None),
                                   recording=recording_routes)
    asked = {
        "max_tokens": Asked("max_tokens", max_tokens),
        "seed": Asked("seed", body.seed),
        "stop": Asked("stop", body.stop),
        "stop_token_ids": Asked("stop_token_ids", body.stop_token_ids),
        "ignore_eos": Asked("ignore_eos", body.ignore_eos if "ignore_eos" in given else None),
        "n": Asked("n", body.n),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs or Asked("prompt_logprobs", body.prompt_logprobs),
        "return_kept_mass": Asked("return_kept_mass", getattr(body, "return_kept_mass", None)
                                  or None),
        "return_routed_experts": Asked("return_routed_experts", True if routes else None),
        "structured_outputs": Asked(*vllm_constraint(body)),
    }
    for name in ("temperature", "top_p", "top_k", *VLLM_EXTRAS):
        asked[name] = Asked(name, getattr(body, name) if name in given else None)
    return asked


def truncated(prompt: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the
    most the model's length holds with one token to generate); None keeps it whole."""
    if keep is None:
        return prompt
    keep = max_model_len - 1 if keep == -1 else keep
    return prompt[-keep:] if keep else []
