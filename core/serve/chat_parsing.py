"""The server's output parsers applied to one chat request, as vLLM's chat route
applies them: which parsers a request gets, and its answer's message and stream deltas.

The reasoning parser (``--reasoning-parser``) reads every chat output, with the
request's ``enable_thinking`` (``chat_template_kwargs``). The tool-call parser
(``--tool-call-parser``) reads outputs of requests with ``tools`` and ``tool_choice``
"auto" (OpenAI's default when tools are given), which vLLM allows only with
``--enable-auto-tool-choice``; "none" leaves calls in the text. "required" and a named
function need neither flag: their output is held to the tools' JSON schema
(serve/tool_choice.py) and read as the calls it is (parsers/required_calls.py,
parsers/named_call.py), with empty content. With ``parallel_tool_calls: false`` only
the first tool call is returned (streamed: only its pieces), as vLLM does.

Reasoning before a grammar, as vLLM's structured-output manager does it: when the
reasoning parser is on, the request's thinking enabled and its output constrained
(``response_format``, ``structured_outputs``, a forced ``tool_choice``), the request
carries the parser's end token (:func:`reasoning_end_token_id`, Qwen3's ``</think>``)
as ``SamplingParams.reasoning_end_token_id``: the model thinks freely and the grammar
holds what follows, which the reasoning parser splits off before the calls are read.
A tokenizer without that token as one token of its own gets the grammar from the
first token, and a forced call's output is then read without the reasoning parser.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from kvrunner.serve.errors import APIError
from kvrunner.serve.openai_protocol import ChatCompletionRequest
from kvrunner.serve.parsers.chat_output import ChatOutputParser
from kvrunner.serve.parsers.named_call import NamedCallParser
from kvrunner.serve.parsers.parsed import Delta, ParsedOutput
from kvrunner.serve.parsers.registry import REASONING_PARSERS, TOOL_CALL_PARSERS
from kvrunner.serve.parsers.required_calls import RequiredCallsParser
from kvrunner.serve.settings import ServeSettings
from kvrunner.serve.tool_choice import Choice, called_function, tool_choice


@attrs.frozen
class ChatParsing:
    """What one chat request's outputs go through, and how its answer shows them."""

    parser: ChatOutputParser
    #: the answer has ``tool_calls`` (and finish reason "tool_calls" when any came)
    tools: bool
    #: the answer has ``reasoning_content`` (and vLLM's newer name, ``reasoning``)
    reasoning: bool
    #: only the first call (``parallel_tool_calls: false``)
    first_call_only: bool
    #: the ``tool_choice`` that held the output to the tools' schema ("named",
    #: "required"; None: "auto" or none)
    forced: Choice = None

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """A whole output's message, and whether it calls tools."""
        parsed = self.parser.parse(text)
        # a forced call's answer has empty content, as vLLM's
        content = (parsed.content or "") if self.forced else parsed.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        calls = self._calls(parsed)
        if self.tools:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        if self.reasoning:
            message["reasoning_content"] = message["reasoning"] = parsed.reasoning
        return message, bool(calls)

    def finish_reason(self, called: bool, finish_reason: str) -> str:
        """A choice's finish reason, given whether it calls tools, as OpenAI's and
        vLLM's: "tool_calls" for calls the model chose ("auto") and for "required"
        calls of an output that ended by itself; a named function's call keeps the
        output's own ("stop")."""
        if not called or self.forced == "named":
            return finish_reason
        if self.forced == "required" and finish_reason != "stop":
            return finish_reason
        return "tool_calls"

    def _calls(self, parsed: ParsedOutput) -> tuple:
        return parsed.calls[:1] if self.first_call_only else parsed.calls

    def delta(self, pieces: Iterable[Delta]) -> tuple[dict[str, Any], bool]:
        """One stream chunk's ``delta`` from a text delta's pieces (vLLM's keys, only
        those set), and whether it holds a call's piece."""
        content = "".join(p.content for p in pieces)
        reasoning = "".join(p.reasoning for p in pieces)
        calls: dict[int, dict[str, Any]] = {}
        for piece in (p.call for p in pieces if p.call is not None):
            if self.first_call_only and piece.index > 0:
                continue
            entry = calls.get(piece.index)
            if entry is None:
                entry = calls[piece.index] = {"index": piece.index, "function": {}}
                if piece.id is not None:
                    entry |= {"id": piece.id, "type": "function"}
                    entry["function"]["name"] = piece.name
                entry["function"]["arguments"] = ""
            entry["function"]["arguments"] += piece.arguments
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = list(calls.values())
        return delta, bool(calls)


def _auto_tool_choice(choice: Choice, settings: ServeSettings) -> bool:
    """Whether calls are parsed out of this request's outputs by the server's tool-call
    parser; a 400 when it asks for "auto" of a server started without one."""
    if choice != "auto":
        return False
    if settings.tool_call_parser is None or not settings.enable_auto_tool_choice:
        raise APIError(400, "\"auto\" tool choice requires --enable-auto-tool-choice and "
                       "--tool-call-parser to be set; send tool_choice='none' to render the "
                       "tools into the prompt and parse the calls from the text, or "
                       "'required' or a named function to have the output held to the "
                       "tools' schema", param="tool_choice")
    return True


def _thinking(body: ChatCompletionRequest) -> bool:
    """The request's ``enable_thinking`` (``chat_template_kwargs``; on unless it says)."""
    return bool((body.chat_template_kwargs or {}).get("enable_thinking", True))


def reasoning_end_token_id(body: ChatCompletionRequest, settings: ServeSettings,
                           tokenizer: Any | None) -> int | None:
    """The token after which ``body``'s structured-output constraint applies: the
    reasoning parser's end token, when the parser is on, the request's thinking enabled
    and ``tokenizer`` (a ``tokenizers.Tokenizer``) has it as one token; else None (the
    constraint applies from the first token)."""
    if settings.reasoning_parser is None or tokenizer is None or not _thinking(body):
        return None
    return tokenizer.token_to_id(REASONING_PARSERS[settings.reasoning_parser].end_token)


def chat_parsing(body: ChatCompletionRequest, settings: ServeSettings, *,
                 thinks_first: bool = False) -> ChatParsing | None:
    """The parsers a chat request's outputs go through (None: none, the text is the
    content); a 400 for a ``tool_choice`` this server cannot honour.

    :param thinks_first: the request reasons before its grammar applies
        (:func:`reasoning_end_token_id` found the token): a forced call's output is
        split by the reasoning parser before its calls are read."""
    choice = tool_choice(body)
    reasoning = None
    if settings.reasoning_parser is not None:
        reasoning = REASONING_PARSERS[settings.reasoning_parser](
            enable_thinking=_thinking(body))
    first_call_only = body.parallel_tool_calls is False
    if choice in ("named", "required"):
        calls = NamedCallParser(called_function(body)) if choice == "named" \
            else RequiredCallsParser()
        # without thinking first, the grammar holds the output from its first token:
        # it holds no reasoning
        return ChatParsing(parser=ChatOutputParser(reasoning if thinks_first else None, calls),
                           tools=True,
                           reasoning=reasoning is not None,
                           first_call_only=first_call_only, forced=choice)
    tools = _auto_tool_choice(choice, settings)
    if not tools and reasoning is None:
        return None
    tool_parser = None
    if tools:
        schemas = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        tool_parser = TOOL_CALL_PARSERS[settings.tool_call_parser](schemas)
    return ChatParsing(parser=ChatOutputParser(reasoning, tool_parser), tools=tools,
                       reasoning=reasoning is not None, first_call_only=first_call_only)
