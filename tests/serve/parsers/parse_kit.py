"""Helpers for the parser specifications: a stream fed in given chunks, and a parse
result without its random call ids."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvrunner.serve.parsers.parsed import ParsedOutput, accumulate


def streamed(parser: Any, chunks: Iterable[str]) -> ParsedOutput:
    """What ``parser``'s stream makes of ``chunks`` fed in order, then finished."""
    stream = parser.stream()
    pieces = []
    for chunk in chunks:
        pieces.extend(stream.feed(chunk))
    pieces.extend(stream.finish())
    return accumulate(pieces)


def plain(parsed: ParsedOutput) -> tuple:
    """``parsed`` as (content, reasoning, [(name, arguments)]): ids are random."""
    return parsed.content, parsed.reasoning, [(c.name, c.arguments) for c in parsed.calls]


def cut(text: str, at: Iterable[int]) -> list[str]:
    """``text`` cut at the given indices."""
    bounds = [0, *sorted(set(at)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
