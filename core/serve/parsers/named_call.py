"""The output of a request whose ``tool_choice`` names a function: one call to it.

The grammar held the output to the function's ``parameters`` schema, so the whole
output is the call's arguments, as vLLM returns them: no content, and no call when
the output is empty or only whitespace. Streamed, the call's first piece (id, type,
name) goes out with the first text that is not whitespace (whitespace before it is
held, so that a stream and the whole text agree on whether there is a call), then
each delta's text as an argument fragment.
"""

from __future__ import annotations

from kvrunner.serve.parsers.parsed import CallPiece, Delta, ParsedOutput, ToolCall, new_call_id


class NamedCallParser:
    """Every output is the arguments of one call to ``name``."""

    def __init__(self, name: str) -> None:
        self._name = name

    def parse(self, text: str) -> ParsedOutput:
        """A whole output as the call (none when it is blank)."""
        if not text.strip():
            return ParsedOutput()
        return ParsedOutput(calls=(ToolCall(name=self._name, arguments=text),))

    def stream(self) -> NamedCallStream:
        """A parser of one output's text deltas."""
        return NamedCallStream(self._name)


class NamedCallStream:
    """One output's deltas as the pieces of its one call."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._held = ""  # whitespace before the call's first piece
        self._started = False

    def feed(self, text: str) -> list[Delta]:
        """The call's piece that ``text`` adds (none while all is whitespace)."""
        if self._started:
            return [Delta(call=CallPiece(index=0, arguments=text))] if text else []
        self._held += text
        if not self._held.strip():
            return []
        self._started = True
        first = CallPiece(index=0, arguments=self._held, id=new_call_id(), name=self._name)
        self._held = ""
        return [Delta(call=first)]

    def finish(self) -> list[Delta]:
        """Nothing: blank text held back is no call."""
        return []
