"""The output parsers by the names ``kvrunner serve`` takes, as vLLM names them:
``--tool-call-parser hermes | qwen3_coder``, ``--reasoning-parser qwen3``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvrunner.config import ConfigError
from kvrunner.serve.parsers.hermes import HermesToolParser
from kvrunner.serve.parsers.parsed import OutputParser
from kvrunner.serve.parsers.qwen3_coder import Qwen3CoderToolParser
from kvrunner.serve.parsers.qwen3_reasoning import Qwen3ReasoningParser

#: a tool-call parser for one request, built from its ``tools`` (the JSON schemas)
ToolParserFactory = Callable[[Sequence[Mapping[str, Any]] | None], OutputParser]

TOOL_CALL_PARSERS: dict[str, ToolParserFactory] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}

#: a reasoning parser for one request, built with its ``enable_thinking``
REASONING_PARSERS: dict[str, Callable[..., OutputParser]] = {
    "qwen3": Qwen3ReasoningParser,
}


def check_parser(kind: str, name: str | None) -> None:
    """A ConfigError naming ``name`` and the parsers there are, unless ``name`` is one
    of them (None: no parser)."""
    known = TOOL_CALL_PARSERS if kind == "tool_call_parser" else REASONING_PARSERS
    if name is not None and name not in known:
        flag = "--" + kind.replace("_", "-")
        raise ConfigError(f"serve: {flag} {name!r} is not a parser kvrunner has; "
                          f"it has {sorted(known)}")
