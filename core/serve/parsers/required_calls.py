"""The output of a request with ``tool_choice`` "required": a JSON array of calls.

The grammar held the output to vLLM's schema for it (serve/tool_choice.py): an array
of ``{"name": ..., "parameters": ...}`` objects. Each element is a call, its name the
``name`` string and its arguments the text of its ``parameters`` value as the model
wrote it. No text is content.

One character at a time, a small JSON scanner reads the whole text and a stream alike,
so a stream's pieces add up to the whole-text parse whatever the chunking: a call's
first piece (id, type, name, the arguments so far) goes out once its name string has
closed and its parameters value has begun, in either order; then each fragment of the
value as it comes (vLLM's stream sends the same pieces). An element without both is
no call.

Where vLLM differs: its whole answer writes each call's parameters back with
``json.dumps`` (the same JSON, its own spacing), and gives no call at all for an
output that is not a whole array (one cut by ``max_tokens``); here, whole and
streamed, such an output gives the calls begun, the last one's arguments cut where
the output was, as vLLM's stream gives them.
"""

from __future__ import annotations

import json

from kvrunner.serve.parsers.parsed import (
    CallPiece,
    Delta,
    ParsedOutput,
    accumulate,
    new_call_id,
)

#: what the scanner is reading at an element's own level: a key, the value after
#: one, or the rest after a value (up to a ``,`` or the element's close)
_KEY, _VALUE, _AFTER = "key", "value", "after"


def _decoded(raw: str) -> str | None:
    """A JSON string's text (its quotes left off) decoded, or None if it is not one."""
    try:
        value = json.loads('"' + raw + '"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class RequiredCallsParser:
    """The calls of a JSON array of ``{"name", "parameters"}`` objects."""

    def parse(self, text: str) -> ParsedOutput:
        """A whole output's calls (no content)."""
        stream = self.stream()
        return accumulate([*stream.feed(text), *stream.finish()])

    def stream(self) -> RequiredCallsStream:
        """A parser of one output's text deltas."""
        return RequiredCallsStream()


class RequiredCallsStream:
    """One output's deltas through the scanner (see the module docstring)."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # the open ``[`` and ``{``
        self._in_string = False
        self._escaped = False
        #: the raw text of a key or name string being read (None: another string)
        self._string: list[str] | None = None
        self._string_is_key = False
        self._phase = _KEY
        self._key: str | None = None
        # the element being read
        self._name: str | None = None
        self._held: list[str] = []  # its arguments while its name is not yet known
        #: how its parameters value ends while it is being read: "container",
        #: "string" or "scalar" (None: not inside it)
        self._value: str | None = None
        self._value_begun = False
        self._index: int | None = None  # its call's index once the first piece is out
        self._calls = 0
        # the pieces of the current feed: [index, id, name, argument characters]
        self._out: list[list] = []

    def feed(self, text: str) -> list[Delta]:
        """The call pieces that ``text`` (the next delta) completes."""
        for ch in text:
            self._char(ch)
        out, self._out = self._out, []
        return [Delta(call=CallPiece(index=i, id=call_id, name=name,
                                     arguments="".join(chars)))
                for i, call_id, name, chars in out]

    def finish(self) -> list[Delta]:
        """Nothing: an element without both a name and parameters is no call."""
        return []

    # -- the scanner ----------------------------------------------------------------

    def _in_element(self) -> bool:
        """Whether the scanner is at an element's own level (an array's object)."""
        return len(self._stack) == 2 and self._stack[0] == "[" and self._stack[1] == "{"

    def _take(self, ch: str) -> None:
        """``ch`` of the parameters value: to the call's pieces, or held for them."""
        if self._index is None:
            self._held.append(ch)
        elif self._out and self._out[-1][0] == self._index:
            self._out[-1][3].append(ch)
        else:
            self._out.append([self._index, None, None, [ch]])

    def _maybe_start(self) -> None:
        """The call's first piece, once its name is known and its parameters begun."""
        if self._index is None and self._name is not None and self._value_begun:
            self._index = self._calls
            self._calls += 1
            self._out.append([self._index, new_call_id(), self._name, self._held])
            self._held = []

    def _new_element(self) -> None:
        self._phase, self._key, self._name, self._held = _KEY, None, None, []
        self._value, self._value_begun, self._index = None, False, None

    def _push(self, ch: str) -> None:
        if ch == "{" and self._stack == ["["]:
            self._new_element()
        self._stack.append(ch)

    def _pop(self, ch: str) -> None:
        if self._stack and self._stack[-1] == ("{" if ch == "}" else "["):
            self._stack.pop()

    def _char(self, ch: str) -> None:
        if self._in_string:
            self._string_char(ch)
        elif self._value is not None and not (self._value == "scalar" and self._in_element()
                                              and (ch in ",}]" or ch.isspace())):
            self._value_char(ch)
        else:
            self._value = None  # a scalar value ends at what follows it
            if self._in_element():
                self._element_char(ch)
            elif ch == '"':
                self._in_string, self._string = True, None
            elif ch in "{[":
                self._push(ch)
            elif ch in "}]":
                self._pop(ch)

    def _string_char(self, ch: str) -> None:
        if self._value is not None:
            self._take(ch)
        elif self._string is not None:
            self._string.append(ch)
        if self._escaped:
            self._escaped = False
            return
        if ch == "\\":
            self._escaped = True
            return
        if ch != '"':
            return
        self._in_string = False
        if self._value == "string":
            self._value = None
        elif self._string is not None:
            text = _decoded("".join(self._string[:-1]))
            self._string = None
            if self._string_is_key:
                self._key, self._phase = text, _VALUE
            elif self._name is None:
                self._name = text
                self._maybe_start()

    def _value_char(self, ch: str) -> None:
        """``ch`` inside the parameters value, outside its strings."""
        self._take(ch)
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._push(ch)
        elif ch in "}]":
            self._pop(ch)
            if self._in_element() and self._value == "container":
                self._value = None

    def _element_char(self, ch: str) -> None:
        """``ch`` at an element's own level, outside any value that is read."""
        if ch.isspace() or ch == ":":
            return
        if ch == ",":
            self._phase = _KEY
            return
        if ch in "}]":
            self._pop(ch)  # the element's close ends it; a stray ``]`` is ignored
            return
        if self._phase == _KEY:
            if ch == '"':
                self._in_string, self._string, self._string_is_key = True, [], True
            elif ch in "{[":
                self._push(ch)
            return
        if self._phase == _AFTER:
            if ch == '"':
                self._in_string, self._string = True, None
            elif ch in "{[":
                self._push(ch)
            return
        # a value begins
        self._phase = _AFTER
        if self._key == "parameters" and not self._value_begun:
            self._value_begun = True
            self._take(ch)
            if ch == '"':
                self._in_string, self._string, self._value = True, None, "string"
            elif ch in "{[":
                self._push(ch)
                self._value = "container"
            else:
                self._value = "scalar"
            self._maybe_start()
        elif ch == '"':
            self._in_string = True
            self._string, self._string_is_key = ([], False) if self._key == "name" \
                else (None, False)
        elif ch in "{[":
            self._push(ch)
