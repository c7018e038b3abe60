"""The ``hermes`` tool-call parser: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Hermes 2 Pro, Qwen2.5 and Qwen3 (their chat templates teach it), parsed
as vLLM's ``hermes`` parser does: the content is the text before the first
``<tool_call>``; each block whose body is a JSON object with a string ``name`` and an
``arguments`` member is a call, its arguments written back as JSON text
(``json.dumps``, non-ASCII kept); the last block may be left open at the end of the
output. When no block is a call, the whole output is content, tags and all.

Where vLLM differs: a malformed block among well-formed ones is dropped here, where
vLLM's whole-text parse then returns no call at all. That keeps the streamed result
equal to the whole-text one whatever the chunking: a call is streamed once its block
closes (id, name and arguments in one piece), so no call is ever sent that the whole
text would not give.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvrunner.serve.parsers.held_text import hold_point
from kvrunner.serve.parsers.parsed import CallPiece, Delta, ParsedOutput, ToolCall, new_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def block_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block's body, or None when it is no call."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
            or "arguments" not in value:
        return None
    return value["name"], json.dumps(value["arguments"], ensure_ascii=False)


class HermesToolParser:
    """Tool calls written as JSON in ``<tool_call>`` blocks."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        del tools  # the JSON carries its own types

    def parse(self, text: str) -> ParsedOutput:
        """A whole output's content and calls."""
        start = text.find(OPEN)
        if start < 0:
            return ParsedOutput(content=text or None)
        calls = []
        for match in _BLOCK.finditer(text):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            call = block_call(body)
            if call is not None:
                calls.append(ToolCall(name=call[0], arguments=call[1]))
        if not calls:
            return ParsedOutput(content=text or None)
        return ParsedOutput(content=text[:start] or None, calls=tuple(calls))

    def stream(self) -> HermesStream:
        """A parser of one output's text deltas."""
        return HermesStream()


class HermesStream:
    """One output's text, delta by delta: content is sent as it comes, up to the first
    ``<tool_call>``; a call when its block closes."""

    def __init__(self) -> None:
        self._pending = ""
        self._in_block = False
        self._opened = False
        #: the text from the first ``<tool_call>`` on: the content if no call comes
        self._held: list[str] = []
        self._calls = 0

    def feed(self, text: str) -> list[Delta]:
        """The pieces that ``text`` (the next delta) completes."""
        self._pending += text
        out: list[Delta] = []
        while True:
            if self._in_block:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return out
                self._close_block(self._pending[:end], out)
                self._keep(self._pending[:end + len(CLOSE)])
                self._pending = self._pending[end + len(CLOSE):]
                self._in_block = False
                continue
            start = self._pending.find(OPEN)
            if start < 0:
                safe = hold_point(self._pending, (OPEN,))
                self._outside(self._pending[:safe], out)
                self._pending = self._pending[safe:]
                return out
            self._outside(self._pending[:start], out)
            self._opened = True
            self._keep(OPEN)
            self._pending = self._pending[start + len(OPEN):]
            self._in_block = True

    def finish(self) -> list[Delta]:
        """The last pieces, once the output has ended: an open block is parsed to the
        end, and with no call at all the held text is content."""
        out: list[Delta] = []
        if self._in_block:
            self._keep(self._pending)
            self._close_block(self._pending, out)
        else:
            self._outside(self._pending, out)
        self._pending = ""
        if self._calls == 0 and self._held:
            out.append(Delta(content="".join(self._held)))
            self._held.clear()
        return out

    def _outside(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        if self._opened:
            self._keep(text)  # text between blocks is no content once a call came
        else:
            out.append(Delta(content=text))

    def _keep(self, text: str) -> None:
        if self._calls == 0:
            self._held.append(text)

    def _close_block(self, body: str, out: list[Delta]) -> None:
        call = block_call(body)
        if call is None:
            return
        out.append(Delta(call=CallPiece(index=self._calls, id=new_call_id(), name=call[0],
                                        arguments=call[1])))
        self._calls += 1
        self._held.clear()
