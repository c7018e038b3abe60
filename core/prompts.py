"""Turning what a caller passes to ``LLM.generate`` into checked token-id requests.

A prompt is text or a sequence of token ids, or vLLM's dict of one of them
(``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, with an optional
``"cache_salt"``); one prompt or a list of them may be passed, with one
``SamplingParams`` for all or one each. Everything is checked before anything is
queued, and a fault is a :class:`~kvrunner.errors.RequestError`
naming the request by its position: a float token id is refused rather than
truncated, and a text prompt for a model without a tokenizer says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Real
from typing import TYPE_CHECKING, Any

from kvrunner.errors import RequestError
from kvrunner.sampling_params import SamplingParams, is_int
from kvrunner.unicode_text import lone_surrogate

if TYPE_CHECKING:
    from kvrunner.config import EngineConfig

Prompt = str | Sequence[int]


def require_tokenizer(config: EngineConfig, needs: str, instead: str) -> None:
    """Refuse, before any model is loaded, what ``needs`` a tokenizer when the
    checkpoint ``config`` names has none: judged from its files (``tokenizer.json``)
    and ``skip_tokenizer_init``, as the load would.

    :param needs: what needs it (``"--stop"``); :param instead: what to do instead.
    :raises RequestError: saying both, and why there is no tokenizer.
    """
    from kvrunner.models.checkpoint_files import has_tokenizer
    from kvrunner.runner.setup import resolve_model_path

    path = resolve_model_path(config.model)
    if has_tokenizer(path, skip=config.skip_tokenizer_init):
        return
    why = ("skip_tokenizer_init is set" if config.skip_tokenizer_init
           else f"{path} has no tokenizer.json")
    raise RequestError(f"{needs} needs a tokenizer, but {why}; {instead}")


def _as_list(value: Any) -> Any:
    # numpy arrays and torch tensors hold ids too; tolist() gives their Python values.
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str) else value


def _is_one_prompt(prompts: Any) -> bool:
    if isinstance(prompts, str | Mapping):
        return True
    if isinstance(prompts, Sequence) and prompts:
        first = prompts[0]
        return isinstance(first, Real) and not isinstance(first, bool) or is_int(first)
    return False


def normalize_requests(
    prompts: Any, sampling_params: Any
) -> tuple[list[Prompt], list[SamplingParams]]:
    """``(prompts, params)`` as two lists of equal length, one entry per request."""
    prompts = _as_list(prompts)
    if _is_one_prompt(prompts):
        prompts = [prompts]
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        raise RequestError(
            f"prompts must be a string, a list of token ids, or a list of those; "
            f"got {type(prompts).__name__}"
        )
    prompts = [p if isinstance(p, Mapping) else _as_list(p) for p in prompts]
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(prompts)
    elif isinstance(sampling_params, Sequence):
        params = list(sampling_params)
    else:
        raise RequestError(
            f"sampling_params must be a SamplingParams or a list of them, "
            f"got {type(sampling_params).__name__}"
        )
    if len(params) != len(prompts):
        raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
    for index, sp in enumerate(params):
        if not isinstance(sp, SamplingParams):
            raise RequestError(
                f"request {index}: sampling params must be a SamplingParams, "
                f"got {type(sp).__name__}"
            )
    return prompts, params


#: the keys of vLLM's prompt dicts kvrunner reads (``TextPrompt``, ``TokensPrompt``)
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def unpack_prompt(prompt: Any, index: int) -> tuple[Any, str | None]:
    """``(prompt, its cache_salt)``: a vLLM prompt dict's prompt and salt, any other
    prompt as it is with no salt.

    :raises RequestError: a dict with neither or both of ``prompt`` and
        ``prompt_token_ids``, or with a key kvrunner does not read (multimodal data),
        naming the request.
    """
    if not isinstance(prompt, Mapping):
        return prompt, None
    unknown = sorted(str(k) for k in prompt if k not in _PROMPT_KEYS)
    if unknown:
        raise RequestError(
            f"request {index}: prompt dict key(s) {unknown} are not supported by kvrunner "
            f"(it reads {', '.join(_PROMPT_KEYS)})"
        )
    given = [k for k in ("prompt", "prompt_token_ids") if k in prompt]
    if len(given) != 1:
        raise RequestError(
            f"request {index}: a prompt dict needs exactly one of 'prompt' and "
            f"'prompt_token_ids', got {given or 'neither'}"
        )
    inner = prompt[given[0]]
    return (_as_list(inner) if given[0] == "prompt_token_ids" else inner,
            prompt.get("cache_salt"))


def per_prompt_salts(cache_salt: Any, count: int) -> list[str | None]:
    """``LLM.generate``'s ``cache_salt`` as one entry per prompt: one salt (or None)
    for every prompt, or a list of one per prompt (each checked when its request is
    made)."""
    if cache_salt is None or isinstance(cache_salt, str):
        return [cache_salt] * count
    if not isinstance(cache_salt, Sequence):
        raise RequestError(
            f"cache_salt must be a string, None, or a list of one per prompt; got "
            f"{type(cache_salt).__name__}"
        )
    if len(cache_salt) != count:
        raise RequestError(f"{count} prompts but {len(cache_salt)} cache salts")
    return list(cache_salt)


def prompt_token_ids(prompt: Any, index: int | str, tokenizer: Any | None) -> list[int]:
    """The token ids of one prompt; RequestError naming request ``index`` if it has none.

    :param tokenizer: a ``tokenizers.Tokenizer``, or None when the model has none
        (then only token-id prompts are accepted).
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(
                f"request {index}: a text prompt needs a tokenizer, but this model has none "
                f"(no tokenizer.json, or skip_tokenizer_init is set); pass token ids instead"
            )
        found = lone_surrogate(prompt)
        if found is not None:
            raise RequestError(f"request {index}: the text prompt {found}")
        return list(tokenizer.encode(prompt).ids)
    if isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
        raise RequestError(
            f"request {index}: a prompt must be text or a list of token ids, "
            f"got {type(prompt).__name__}"
        )
    if all(type(token) is int for token in prompt):  # the usual case, at a tenth the cost
        return list(prompt)
    for position, token in enumerate(prompt):
        if not is_int(token):
            raise RequestError(
                f"request {index}: token ids must be integers; position {position} holds "
                f"{token!r} ({type(token).__name__})"
            )
    return [int(t) for t in prompt]
