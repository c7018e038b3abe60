"""The ``qwen3_coder`` tool-call parser on Qwen3-Coder's call format, parameters typed
by the request's tool schemas as vLLM's ``qwen3_coder`` parser types them."""

from __future__ import annotations

import json

import pytest
from parse_kit import plain

from kvrunner.serve.parsers.param_types import convert
from kvrunner.serve.parsers.qwen3_coder import Qwen3CoderToolParser

TOOLS = [{"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {
        "town": {"type": "string"}, "nights": {"type": "integer"},
        "budget": {"type": "number"}, "pets": {"type": "boolean"},
        "rooms": {"type": "array"}, "extras": {"type": "object"},
        "floor": {"type": ["integer", "null"]}}}}}]

parse = Qwen3CoderToolParser(TOOLS).parse


def call(name: str, **parameters: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_text_without_a_function_is_all_content() -> None:
    assert plain(parse("no calls <tool_call> here")) == ("no calls <tool_call> here", None, [])


def test_parameters_take_the_types_of_the_tool_schema() -> None:
    text = "Booking.\n" + call("book", town="Paris", nights="3", budget="120.5", pets="True",
                                rooms='["a", "b"]', extras='{"late": true}', floor="null")
    content, _, [(name, arguments)] = plain(parse(text))
    assert (content, name) == ("Booking.\n", "book")
    assert json.loads(arguments) == {"town": "Paris", "nights": 3, "budget": 120.5,
                                     "pets": True, "rooms": ["a", "b"],
                                     "extras": {"late": True}, "floor": None}
    # the arguments are json.dumps of the parameters, in their order
    assert arguments == json.dumps(json.loads(arguments), ensure_ascii=False)


@pytest.mark.parametrize(("text", "schema", "value"), [
    ("3.0", {"type": "number"}, 3),  # integral numbers are written as integers
    ("three", {"type": "integer"}, "three"),  # what does not convert stays text
    ("yes", {"type": "boolean"}, False),
    ("NULL", {"type": "string"}, None),
    ("42", {"type": "string"}, "42"),
    ("42", None, "42"),  # a parameter the schema does not list is text
    ("(1, 2)", {"type": "tuple"}, [1, 2]),  # other types: a Python literal
    ("{1, 2}", {"type": "set"}, "{1, 2}"),  # which JSON cannot carry: text
    ("nan", {"type": "number"}, "nan"),
    ("7", {"type": ["integer", "null"]}, 7),
])
def test_a_value_converts_by_its_schema_type(text: str, schema: dict | None, value: object
                                             ) -> None:
    # compared as the arguments carry it: JSON (a tuple is written as an array)
    converted = convert(text, "p", {} if schema is None else {"p": schema})
    assert json.loads(json.dumps(converted)) == value


def test_several_calls_and_a_function_without_tool_call_tags() -> None:
    text = call("book", town="Rome") + "\n" + "<function=ping>\n</function>"
    assert plain(parse(text)) == (None, None, [("book", '{"town": "Rome"}'), ("ping", "{}")])


def test_a_function_left_open_at_the_end_is_parsed_to_the_end() -> None:
    text = (
        "<tool_call>\n<function=book>\n<parameter=town>\nOslo\n</parameter>\n"
        "<parameter=nights>\n2"
    )
    assert plain(parse(text)) == (None, None, [("book", '{"town": "Oslo", "nights": 2}')])


def test_a_parameter_without_its_end_tag_ends_at_the_next_parameter() -> None:
    text = "<function=book>\n<parameter=town>\nOslo\n<parameter=nights>\n2\n</function>"
    assert plain(parse(text)) == (None, None, [("book", '{"town": "Oslo", "nights": 2}')])


def test_a_function_for_a_tool_not_given_keeps_its_values_as_text() -> None:
    assert plain(parse(call("other", n="5"))) == (None, None, [("other", '{"n": "5"}')])


def test_a_repeated_parameter_keeps_its_first_value() -> None:
    text = "<function=book><parameter=town>A</parameter><parameter=town>B</parameter></function>"
    assert plain(parse(text)) == (None, None, [("book", '{"town": "A"}')])


def test_a_function_name_that_never_ends_leaves_everything_as_content() -> None:
    text = "Calling <tool_call>\n<function=book"
    assert plain(parse(text)) == (text, None, [])


def test_values_keep_inner_newlines_and_markup() -> None:
    text = call("other", code="line 1\nline <b>2</b>\n")
    assert json.loads(parse(text).calls[0].arguments) == {"code": "line 1\nline <b>2</b>\n"}
