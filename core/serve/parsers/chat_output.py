"""One chat choice's output through the server's parsers: reasoning first, then tool
calls in what is left, as vLLM chains them."""

from __future__ import annotations

from kvrunner.serve.parsers.parsed import Delta, OutputParser, OutputStream, ParsedOutput


class ChatOutputParser:
    """The reasoning parser (or None) chained into the tool-call parser (or None)."""

    def __init__(self, reasoning: OutputParser | None, tools: OutputParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def parse(self, text: str) -> ParsedOutput:
        """A whole output's reasoning, content and calls."""
        reasoning, content = None, text or None
        if self._reasoning is not None:
            split = self._reasoning.parse(text)
            reasoning, content = split.reasoning, split.content
        if self._tools is None:
            return ParsedOutput(content=content, reasoning=reasoning)
        found = self._tools.parse(content or "")
        return ParsedOutput(content=found.content, reasoning=reasoning, calls=found.calls)

    def stream(self) -> ChatOutputStream:
        """A parser of one output's text deltas."""
        return ChatOutputStream(
            None if self._reasoning is None else self._reasoning.stream(),
            None if self._tools is None else self._tools.stream())


class ChatOutputStream:
    """One output's text deltas through the chained parsers' streams."""

    def __init__(self, reasoning: OutputStream | None, tools: OutputStream | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def feed(self, text: str) -> list[Delta]:
        """The pieces that ``text`` (the next delta) completes."""
        pieces = self._reasoning.feed(text) if self._reasoning is not None \
            else [Delta(content=text)]
        return self._through_tools(pieces)

    def finish(self) -> list[Delta]:
        """The last pieces, once the output has ended."""
        pieces = self._reasoning.finish() if self._reasoning is not None else []
        out = self._through_tools(pieces)
        if self._tools is not None:
            out.extend(self._tools.finish())
        return out

    def _through_tools(self, pieces: list[Delta]) -> list[Delta]:
        if self._tools is None:
            return [p for p in pieces if p.content or p.reasoning or p.call]
        out: list[Delta] = []
        for piece in pieces:
            if piece.content:
                out.extend(self._tools.feed(piece.content))
            elif piece.reasoning:
                out.append(piece)
        return out
