"""The ``qwen3`` reasoning parser: Qwen3's ``<think>...</think>``.

Parsed as vLLM's ``qwen3`` reasoning parser does: a ``<think>`` the model writes at
the start is dropped (the newer templates put it in the prompt instead); the
reasoning runs to ``</think>``, and what follows is the content (None when empty).
Without ``</think>`` the output was cut off while thinking: all of it is reasoning.
Qwen3.5 may open a call while thinking: a ``<tool_call>`` followed (past whitespace)
by ``<function`` ends the reasoning too, and the content starts at that tag. With
``enable_thinking=False`` (a request's ``chat_template_kwargs``; the template then
closes an empty think block in the prompt) the whole output is content.

Where vLLM differs: a ``<think>`` is dropped only at the very start, and the earlier of
``</think>`` and a call's opening ends the reasoning (vLLM's whole-text parse strips
the first ``<think>`` anywhere and prefers ``</think>`` wherever it is, which a stream
cannot know before the output ends).
"""

from __future__ import annotations

import re

from kvrunner.serve.parsers.held_text import hold_point
from kvrunner.serve.parsers.parsed import Delta, ParsedOutput

START, END = "<think>", "</think>"
CALL_OPEN = "<tool_call>"
#: a call opened while thinking: the tag, whitespace, then a function's
_CALL_WHILE_THINKING = re.compile(r"<tool_call>\s*<function[\s=]")


def _end_of_reasoning(text: str) -> tuple[int, int] | None:
    """(where the reasoning ends, where the content starts) in ``text``, or None."""
    end = text.find(END)
    call = _CALL_WHILE_THINKING.search(text)
    if end >= 0 and (call is None or end < call.start()):
        return end, end + len(END)
    if call is not None:
        return call.start(), call.start()
    return None


def _may_open_call(tail: str) -> bool:
    """Whether ``tail`` may still grow into ``<tool_call>``, whitespace, ``<function=``."""
    if len(tail) <= len(CALL_OPEN):
        return CALL_OPEN.startswith(tail)
    if not tail.startswith(CALL_OPEN):
        return False
    rest = tail[len(CALL_OPEN):].lstrip()
    return "<function".startswith(rest)


class Qwen3ReasoningParser:
    """Reasoning in ``<think>...</think>``; ``enable_thinking=False``: none."""

    #: the token whose sampling ends the reasoning: a structured-output constraint
    #: applies after it (``SamplingParams.reasoning_end_token_id``)
    end_token = END

    def __init__(self, *, enable_thinking: bool = True) -> None:
        self.enable_thinking = enable_thinking

    def parse(self, text: str) -> ParsedOutput:
        """A whole output's reasoning and content."""
        if not self.enable_thinking:
            return ParsedOutput(content=text or None)
        if text.startswith(START):
            text = text[len(START):]
        ends = _end_of_reasoning(text)
        if ends is None:
            return ParsedOutput(reasoning=text or None)
        return ParsedOutput(reasoning=text[:ends[0]] or None, content=text[ends[1]:] or None)

    def stream(self) -> Qwen3ReasoningStream:
        """A parser of one output's text deltas."""
        return Qwen3ReasoningStream(self.enable_thinking)


class Qwen3ReasoningStream:
    """One output's text, delta by delta: reasoning until it ends, then content."""

    def __init__(self, enable_thinking: bool) -> None:
        self._state = "start" if enable_thinking else "content"
        self._pending = ""

    def feed(self, text: str) -> list[Delta]:
        """The pieces that ``text`` (the next delta) decides."""
        if self._state == "content":
            return [Delta(content=text)] if text else []
        self._pending += text
        out: list[Delta] = []
        if self._state == "start":
            if len(self._pending) < len(START) and START.startswith(self._pending):
                return out  # perhaps the model's own <think>
            if self._pending.startswith(START):
                self._pending = self._pending[len(START):]
            self._state = "thinking"
        ends = _end_of_reasoning(self._pending)
        if ends is not None:
            if ends[0]:
                out.append(Delta(reasoning=self._pending[:ends[0]]))
            if ends[1] < len(self._pending):
                out.append(Delta(content=self._pending[ends[1]:]))
            self._pending = ""
            self._state = "content"
            return out
        safe = self._hold_point()
        if safe:
            out.append(Delta(reasoning=self._pending[:safe]))
            self._pending = self._pending[safe:]
        return out

    def _hold_point(self) -> int:
        held = hold_point(self._pending, (END,))
        call = self._pending.rfind(CALL_OPEN[0], 0, held)
        while call >= 0:  # the earliest '<' whose tail may open a call while thinking
            earlier = self._pending.rfind(CALL_OPEN[0], 0, call)
            if _may_open_call(self._pending[call:]):
                held = call
            call = earlier
        return held

    def finish(self) -> list[Delta]:
        """What is held once the output has ended: reasoning (it never ended)."""
        text, self._pending = self._pending, ""
        return [Delta(reasoning=text)] if text else []
