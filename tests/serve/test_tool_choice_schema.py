"""The schema a forced ``tool_choice`` holds the output to, as vLLM builds it: a named
function's ``parameters``; for "required", a non-empty JSON array of ``{"name",
"parameters"}`` objects, one ``anyOf`` branch per tool, the tools' ``$defs`` at its root."""

from __future__ import annotations

import jsonschema
import pytest

from kvrunner.serve.errors import APIError
from kvrunner.serve.openai_protocol import ChatCompletionRequest
from kvrunner.serve.tool_choice import ANY_OBJECT, forced_schema, tool_choice

pytest.importorskip("xgrammar")

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ROUTE = {"$defs": {"place": {"enum": ["home", "work"]}}, "type": "object",
         "properties": {"to": {"$ref": "#/$defs/place"}}, "required": ["to"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "route", "parameters": ROUTE}},
         {"type": "function", "function": {"name": "ping"}}]


def _body(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        | fields)


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_a_named_function_holds_the_output_to_its_parameters() -> None:
    assert forced_schema(_body(tool_choice=_named("weather"))) == CITY
    assert forced_schema(_body(tool_choice=_named("route"))) == ROUTE
    assert forced_schema(_body(tool_choice=_named("ping"))) == ANY_OBJECT


def test_required_holds_the_output_to_a_list_of_calls_to_the_tools() -> None:
    schema = forced_schema(_body(tool_choice="required"))
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [b["properties"]["name"] for b in schema["items"]["anyOf"]] == [
        {"type": "string", "enum": [name]} for name in ("weather", "route", "ping")]
    assert schema["$defs"] == ROUTE["$defs"]  # lifted, where "#/$defs/place" finds it
    accepted = [{"name": "weather", "parameters": {"city": "Oslo"}},
                {"name": "route", "parameters": {"to": "home"}},
                {"name": "ping", "parameters": {}}]
    jsonschema.validate(accepted, schema)
    for refused in ([], [{"name": "other", "parameters": {}}],
                    [{"name": "weather", "parameters": {}}],
                    [{"name": "route", "parameters": {"to": "moon"}}],
                    [{"name": "ping"}], [{"name": "ping", "parameters": 3}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(refused, schema)
    assert "$defs" in ROUTE  # the request's own tool is left as it was


def test_required_without_parallel_tool_calls_holds_one_call() -> None:
    schema = forced_schema(_body(tool_choice="required", parallel_tool_calls=False))
    assert schema["maxItems"] == 1


@pytest.mark.parametrize("fields", [{"tool_choice": "auto"}, {"tool_choice": "none"}, {},
                                    {"tools": None}, {"tools": None, "tool_choice": "none"}])
def test_auto_none_and_no_tools_hold_nothing(fields) -> None:
    assert forced_schema(_body(**fields)) is None


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tool_choice": _named("clock")}, "tool_choice",
     "names the function 'clock', which is not among the request's tools ('weather', "
     "'route', 'ping')"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": None, "tool_choice": _named("weather")}, "tool_choice", "needs tools"),
    ({"tool_choice": "required", "tools": [*TOOLS, {"type": "function", "function": {
        "name": "other", "parameters": {"$defs": {"place": {"type": "integer"}}}}}]},
     "tools.3.function.parameters", "$defs.place"),
])
def test_a_choice_that_does_not_fit_the_tools_is_a_400_naming_it(fields, param, words) -> None:
    with pytest.raises(APIError) as caught:
        forced_schema(_body(**fields))
    assert caught.value.status == 400 and caught.value.param == param
    assert words in caught.value.message


def test_the_choice_is_auto_by_default_with_tools() -> None:
    assert tool_choice(_body()) == "auto"
    assert tool_choice(_body(tool_choice=_named("ping"))) == "named"
    assert tool_choice(_body(tools=None)) is None
