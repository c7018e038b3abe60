"""A chat request's ``tool_choice``, and the JSON schema a forced one holds the output to.

OpenAI's values, read as vLLM reads them: without ``tools`` only "none" (or no
``tool_choice``) is allowed; with ``tools`` the default is "auto". "none" renders the
tools and parses no calls; "auto" parses them with the server's tool-call parser.
The two forced choices need no parser: the output is held by a grammar
(``structured_outputs.json``) to

- a named function (``{"type": "function", "function": {"name": ...}}``): that
  function's ``parameters`` schema; the whole output is the call's arguments;
- "required": vLLM's schema for a list of calls, a JSON array of at least one
  ``{"name": <a tool's name>, "parameters": <that tool's parameters>}`` (one ``anyOf``
  branch per tool; with ``parallel_tool_calls: false``, at most one element). Each
  tool's ``$defs`` are lifted to the array's root, where its ``#/$defs/...`` references
  find them; two tools defining one name differently are a 400.

A function without ``parameters`` takes any object, as vLLM's array branch does.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

from kvrunner.engine.grammar_compiler import parse_constraint, xgrammar
from kvrunner.errors import RequestError
from kvrunner.serve.errors import APIError
from kvrunner.serve.openai_protocol import ChatCompletionRequest, NamedToolChoice, Tool
from kvrunner.structured_outputs import StructuredOutputsParams

#: how a request's tools are used: None (it has none), or OpenAI's ``tool_choice``
#: with a named function as "named"
Choice = Literal["none", "auto", "required", "named"] | None

#: the parameters of a function that declares none: any object
ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def tool_choice(body: ChatCompletionRequest) -> Choice:
    """How ``body`` uses its tools; a 400 naming ``tool_choice`` for a choice that does
    not fit them (a choice other than "none" without tools, a function not among them)."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice other than 'none' needs tools; the request "
                           "has none", param="tool_choice")
        return None
    if choice is None:
        return "auto"  # OpenAI's default when tools are given
    if isinstance(choice, NamedToolChoice):
        _named_tool(body.tools, choice)
        return "named"
    return choice


def _named_tool(tools: list[Tool], choice: NamedToolChoice) -> Tool:
    """The tool ``choice`` names; a 400 naming the function when no tool has it."""
    for tool in tools:
        if tool.function.name == choice.function.name:
            return tool
    names = ", ".join(repr(t.function.name) for t in tools)
    raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which "
                   f"is not among the request's tools ({names})", param="tool_choice")


def called_function(body: ChatCompletionRequest) -> str:
    """The function a named ``tool_choice`` calls."""
    assert isinstance(body.tool_choice, NamedToolChoice)
    return body.tool_choice.function.name


def _parameters(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters
    return copy.deepcopy(params) if params is not None else dict(ANY_OBJECT)


def _calls_schema(tools: list[Tool], *, one_call: bool) -> dict[str, Any]:
    """vLLM's "required" schema: a non-empty array of ``{name, parameters}``, one
    ``anyOf`` branch per tool, the tools' ``$defs`` at the root."""
    branches, defs = [], {}
    for i, tool in enumerate(tools):
        params = _parameters(tool)
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise APIError(400, f"tools.{i}.function.parameters defines $defs.{name} "
                               f"unlike an earlier tool does; tool_choice='required' holds "
                               f"every tool's parameters in one schema, where a definition "
                               f"has one meaning", param=f"tools.{i}.function.parameters")
            defs[name] = schema
        branches.append({"properties": {"name": {"type": "string",
                                                 "enum": [tool.function.name]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": branches}}
    if one_call:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def forced_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema ``body``'s ``tool_choice`` holds its output to (None: "auto",
    "none" or no tools); a 400 naming ``tools`` when the schema does not parse."""
    choice = tool_choice(body)
    if choice == "named":
        assert isinstance(body.tool_choice, NamedToolChoice) and body.tools
        schema = _parameters(_named_tool(body.tools, body.tool_choice))
    elif choice == "required":
        assert body.tools
        schema = _calls_schema(body.tools, one_call=body.parallel_tool_calls is False)
    else:
        return None
    asked = "the named function" if choice == "named" else "'required'"
    try:
        xgrammar()
    except RequestError:
        raise APIError(400, f"tool_choice={asked} holds the output to the tools' schema with "
                       f"an xgrammar grammar, and xgrammar is not installed: pip install "
                       f"'kvrunner[structured]'", param="tool_choice") from None
    try:
        parse_constraint(StructuredOutputsParams(json=json.dumps(schema)))
    except RequestError as e:
        reason = str(e).partition(": ")[2] or str(e)
        raise APIError(400, f"tool_choice={asked} holds the output to the tools' parameters "
                       f"schema, which could not be parsed: {reason}",
                       param="tools") from None
    return schema
