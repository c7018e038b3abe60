"""What the vLLM-shaped answers (``/v1/completions``, ``/v1/chat/completions``,
``/inference/v1/generate``) carry beside their choices: the usage with its cached
prompt tokens, and the weight versions a choice's tokens were made under."""

from __future__ import annotations

from typing import Any


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage, with ``prompt_tokens_details.cached_tokens``: the prompt tokens
    whose KV came from the prefix cache (which ``cache_salt`` scopes)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choice_versions(out: Any) -> dict[str, Any]:
    """A choice's ``weight_version``, and its ``weight_versions`` (``[version, first
    token index]`` spans) when its tokens came from more than one version (a request
    parked across a weight update)."""
    spans = out.weight_versions
    return {"weight_version": out.weight_version} | (
        {"weight_versions": [[version, start] for version, start in spans]}
        if len(spans) > 1
        else {}
    )


def final_choice_versions(delta: Any) -> dict[str, Any]:
    """A stream chunk's choice fields: on a choice's last chunk, its whole output's
    :func:`choice_versions`; none on the others (the chunk's own ``weight_version``
    names its tokens')."""
    return {} if delta.output is None else choice_versions(delta.output)
