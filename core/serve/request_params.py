"""From a route's body to the engine's :class:`~kvrunner.SamplingParams`.

A field the body leaves out takes the engine's default (the checkpoint's
``generation_config.json``, as vLLM does), not the protocol's; a field the body sets is
checked by ``SamplingParams`` itself, and its error is re-labelled with the name the
client used (``sampling_params.max_new_tokens``, not ``SamplingParams.max_tokens``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs
from pydantic import BaseModel

from kvrunner.errors import RequestError
from kvrunner.sampling_params import SamplingParams
from kvrunner.serve.errors import APIError

_FIELD = re.compile(r"SamplingParams\.(\w+)")


def refuse_unsupported(body: BaseModel, neutral: Mapping[str, Any], *, prefix: str = "") -> None:
    """A 400 for the first field of ``neutral`` the body sets to anything else: a client
    asking for a repetition penalty must not silently get none."""
    for name, value in neutral.items():
        got = getattr(body, name)
        if got != value and not (value is None and got in ({}, [])):
            raise APIError(
                400, f"{prefix}{name}={got!r} is not supported by kvrunner (only {value!r})",
                param=prefix + name,
            )


def build_params(
    values: Mapping[str, Any], names: Mapping[str, str], defaults: SamplingParams
) -> SamplingParams:
    """``SamplingParams(**values)`` over ``defaults``; ``names`` maps each of its fields to
    the client's name for it, for the error.

    ``values`` holds only what the client set (None entries are dropped). ``n`` and
    ``stop`` need a ``SamplingParams`` that has them.
    """
    known = attrs.fields_dict(SamplingParams)
    given = {k: v for k, v in values.items() if v is not None}
    for name in given:
        if name not in known:
            raise APIError(400, f"{names.get(name, name)} is not supported by this kvrunner",
                           param=names.get(name, name))
    try:
        return attrs.evolve(defaults, **given)
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


def top_k(value: int) -> int:
    """OpenAI/vLLM's -1 and SGLang's -1 are kvrunner's 0 (off)."""
    return 0 if value < 0 else value


def stops(value: str | list[str] | None) -> tuple[str, ...] | None:
    if value is None or value == []:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


def set_fields(body: BaseModel) -> set[str]:
    """The fields the client's JSON set (defaults left out)."""
    return set(body.model_fields_set)
