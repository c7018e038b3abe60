"""What the output parsers return: a whole output's parts, and the pieces of a stream.

A whole output parses to :class:`ParsedOutput` (content, reasoning, tool calls); a
stream of text deltas parses to :class:`Delta` pieces, each one of: content text,
reasoning text, or a :class:`CallPiece` of one tool call. A call's first piece carries
its id and name; every piece may carry a fragment of its arguments (a JSON text), and
the fragments in order are the call's whole arguments. :func:`accumulate` folds the
pieces of a stream into the :class:`ParsedOutput` the whole text gives.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Protocol

import attrs


def new_call_id() -> str:
    """A tool call's id, as vLLM writes one (``chatcmpl-tool-`` and 32 hex digits)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@attrs.frozen
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON text."""

    name: str
    arguments: str
    id: str = attrs.field(factory=new_call_id)


@attrs.frozen
class CallPiece:
    """A piece of the call numbered ``index`` (0, 1, ... in the output's order): its
    first piece has ``id`` and ``name``, later ones only argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@attrs.frozen
class Delta:
    """One piece of a parsed stream: content, reasoning, or a tool call's piece."""

    content: str = ""
    reasoning: str = ""
    call: CallPiece | None = None


@attrs.frozen
class ParsedOutput:
    """A whole output's parts; an empty part is None, as vLLM returns it."""

    content: str | None = None
    reasoning: str | None = None
    calls: tuple[ToolCall, ...] = ()


class OutputStream(Protocol):
    """One output's parser, fed its text delta by delta."""

    def feed(self, text: str) -> list[Delta]:
        """The pieces that ``text`` (the next delta) decides."""
        ...

    def finish(self) -> list[Delta]:
        """The last pieces, once the output has ended."""
        ...


class OutputParser(Protocol):
    """A parser of outputs in one format, for one request."""

    def parse(self, text: str) -> ParsedOutput:
        """A whole output's parts."""
        ...

    def stream(self) -> OutputStream:
        """A parser of one output's text deltas, whose pieces add up to ``parse``'s."""
        ...


def accumulate(deltas: Iterable[Delta]) -> ParsedOutput:
    """The whole output that a stream's pieces make, in their order."""
    content: list[str] = []
    reasoning: list[str] = []
    names: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        piece = delta.call
        if piece is None:
            continue
        if piece.index not in names:
            if piece.id is None or piece.name is None:
                raise ValueError(f"call {piece.index}'s first piece has no id or name")
            names[piece.index] = (piece.id, piece.name)
            arguments[piece.index] = []
        arguments[piece.index].append(piece.arguments)
    if sorted(names) != list(range(len(names))):
        raise ValueError(f"calls numbered {sorted(names)}, not 0, 1, ...")
    calls = tuple(ToolCall(id=names[i][0], name=names[i][1], arguments="".join(arguments[i]))
                  for i in range(len(names)))
    return ParsedOutput(content="".join(content) or None,
                        reasoning="".join(reasoning) or None, calls=calls)
