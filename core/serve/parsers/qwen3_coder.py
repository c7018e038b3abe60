"""The ``qwen3_coder`` tool-call parser: Qwen3-Coder's XML-like calls.

::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parsed as vLLM's ``qwen3_coder`` parser does: the content is the text before the first
``<tool_call>`` or ``<function=``; each ``<function=NAME>`` after it is a call, its
body running to ``</function>``, ``</tool_call>`` or the end of the output; each
``<parameter=P>`` in the body a parameter whose value runs to ``</parameter>``, the
next ``<parameter=`` or the body's end, less one newline at each end, converted by the
tool's JSON schema (:mod:`~kvrunner.serve.parsers.param_types`). The arguments are
the parameters as a JSON object (``json.dumps``). When no function is a call, the
whole output is content.

Where vLLM differs: a repeated parameter keeps its first value (vLLM's dict keeps the
last), and a function or parameter whose name never ends (no ``>``) is no call or
parameter here, where vLLM gives up on the whole output. Both let a stream send each
parameter as it closes and still equal the whole-text parse.

Streamed: a call's first piece (id, name, arguments "") when ``<function=NAME>`` is
read, then ``{"p": value`` and ``, "q": value`` as each parameter closes, and ``}``
when the function does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvrunner.serve.parsers.held_text import first_of, hold_point
from kvrunner.serve.parsers.param_types import convert, parameter_schemas
from kvrunner.serve.parsers.parsed import CallPiece, Delta, ParsedOutput, ToolCall, new_call_id

OPEN_CALL, CLOSE_CALL = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"

_OPENER = re.compile(r"<tool_call>|<function=")
_FUNCTION = re.compile(r"<function=([^>]*)>(.*?)(?:</function>|</tool_call>|\Z)", re.DOTALL)
_PARAMETER = re.compile(
    r"<parameter=((?:(?!</parameter>|<parameter=)[^>])*)>(.*?)(?=</parameter>|<parameter=|\Z)",
    re.DOTALL)

#: what ends a parameter's name or value
_PARAMETER_ENDS = (END_PARAMETER, PARAMETER, END_FUNCTION, CLOSE_CALL)
#: what a function's body holds between parameters
_BODY_TAGS = (PARAMETER, END_FUNCTION, CLOSE_CALL)


def _trimmed(value: str) -> str:
    """A parameter's text less the newline after its tag and the one before the next."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _member(name: str, value: Any) -> str:
    return f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


class Qwen3CoderToolParser:
    """Tool calls as ``<function=NAME>`` with ``<parameter=P>`` values, typed by ``tools``."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self._tools = tools

    def parse(self, text: str) -> ParsedOutput:
        """A whole output's content and calls."""
        opener = _OPENER.search(text)
        if opener is None:
            return ParsedOutput(content=text or None)
        calls = []
        for function in _FUNCTION.finditer(text, opener.start()):
            name, body = function.group(1), function.group(2)
            schemas = parameter_schemas(self._tools, name)
            arguments: dict[str, Any] = {}
            for parameter in _PARAMETER.finditer(body):
                key = parameter.group(1)
                if key not in arguments:
                    arguments[key] = convert(_trimmed(parameter.group(2)), key, schemas)
            calls.append(ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return ParsedOutput(content=text or None)
        return ParsedOutput(content=text[:opener.start()] or None, calls=tuple(calls))

    def stream(self) -> Qwen3CoderStream:
        """A parser of one output's text deltas."""
        return Qwen3CoderStream(self._tools)


class Qwen3CoderStream:
    """One output's text, delta by delta (the states: outside a function, in its name,
    in its body, in a parameter's name, in a parameter's value)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        self._tools = tools
        self._text = ""  # every delta so far: the content when no call comes
        self._pending = ""
        self._state = "outside"
        self._open_at: int | None = None
        self._calls = 0
        self._schemas: Mapping[str, Any] = {}
        self._seen: list[str] = []
        self._parameter = ""

    def feed(self, text: str) -> list[Delta]:
        """The pieces that ``text`` (the next delta) completes."""
        self._text += text
        self._pending += text
        out: list[Delta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Delta]:
        """The last pieces, once the output has ended: what is open is closed, and with
        no call at all the text from the first tag on is content."""
        out: list[Delta] = []
        while self._step(out, final=True):
            pass
        if self._calls == 0 and self._open_at is not None:
            out.append(Delta(content=self._text[self._open_at:]))
        return out

    def _consume(self, n: int) -> str:
        taken, self._pending = self._pending[:n], self._pending[n:]
        return taken

    def _step(self, out: list[Delta], *, final: bool) -> bool:
        """Move on by what the pending text decides; False when it needs more text."""
        return getattr(self, f"_{self._state}")(out, final)

    def _outside(self, out: list[Delta], final: bool) -> bool:
        opened = self._open_at is not None
        tags = (FUNCTION,) if opened else (OPEN_CALL, FUNCTION)
        at, tag = first_of(self._pending, tags)
        if at < 0:
            safe = len(self._pending) if final else hold_point(self._pending, tags)
            text = self._consume(safe)
            if text and not opened:
                out.append(Delta(content=text))
            return False
        if not opened:
            if at:
                out.append(Delta(content=self._pending[:at]))
            self._open_at = len(self._text) - len(self._pending) + at
        self._consume(at + len(tag))
        if tag == FUNCTION:
            self._state = "name"
        return True

    def _name(self, out: list[Delta], final: bool) -> bool:
        end = self._pending.find(">")
        if end < 0:
            if final:  # a name that never ends is no call
                self._consume(len(self._pending))
                self._state = "outside"
                return True
            return False
        name = self._consume(end + 1)[:-1]
        out.append(Delta(call=CallPiece(index=self._calls, id=new_call_id(), name=name)))
        self._calls += 1
        self._schemas = parameter_schemas(self._tools, name)
        self._seen = []
        self._state = "body"
        return True

    def _body(self, out: list[Delta], final: bool) -> bool:
        at, tag = first_of(self._pending, _BODY_TAGS)
        if at < 0:
            if final:
                self._consume(len(self._pending))
                self._close_function(out)
                return True
            self._consume(hold_point(self._pending, _BODY_TAGS))
            return False
        self._consume(at + len(tag))
        if tag == PARAMETER:
            self._state = "parameter_name"
        else:
            self._close_function(out)
        return True

    def _parameter_name(self, out: list[Delta], final: bool) -> bool:
        end = self._pending.find(">")
        at, _ = first_of(self._pending, _PARAMETER_ENDS)
        if at >= 0 and (end < 0 or at < end):  # a name that never ends: no parameter
            self._consume(at)
            self._state = "body"
            return True
        if end < 0:
            if final:
                self._consume(len(self._pending))
                self._state = "body"
                return True
            return False
        self._parameter = self._consume(end + 1)[:-1]
        self._state = "parameter_value"
        return True

    def _parameter_value(self, out: list[Delta], final: bool) -> bool:
        at, tag = first_of(self._pending, _PARAMETER_ENDS)
        if at < 0 and not final:
            return False
        value = self._consume(len(self._pending) if at < 0 else at)
        if tag == END_PARAMETER:
            self._consume(len(tag))
        key = self._parameter
        if key not in self._seen:
            lead = ", " if self._seen else "{"
            self._seen.append(key)
            member = _member(key, convert(_trimmed(value), key, self._schemas))
            out.append(Delta(call=CallPiece(index=self._calls - 1, arguments=lead + member)))
        self._state = "body"
        return True

    def _close_function(self, out: list[Delta]) -> None:
        out.append(Delta(call=CallPiece(index=self._calls - 1,
                                        arguments="}" if self._seen else "{}")))
        self._state = "outside"
