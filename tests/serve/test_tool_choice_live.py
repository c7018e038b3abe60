"""``tool_choice`` "required" and a named function, end to end: the official ``openai``
client against a live ``kvrunner serve`` of the embedded tiny model, started without
``--tool-call-parser`` or ``--enable-auto-tool-choice`` (vLLM needs neither for these).

The model's weights are random, so what it writes is whatever the grammar lets it: a
call's arguments are checked against the tool's own JSON schema (``jsonschema``), for
several seeds; the schemas are small and closed so that most outputs finish.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_kit import API_KEY

pytest.importorskip("xgrammar")

MODEL = "tiny-qwen3"
SEEDS = range(6)
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
#: a schema with its own ``$defs``, which "required" lifts to the root of its array schema
ROUTE = {"$defs": {"place": {"type": "string", "enum": ["home", "work"]}},
         "type": "object", "properties": {"from": {"$ref": "#/$defs/place"},
                                          "to": {"$ref": "#/$defs/place"}},
         "required": ["from", "to"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_route", "parameters": ROUTE}}]
SCHEMAS = {"get_weather": WEATHER, "get_route": ROUTE}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_route"}}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def _ask(seed: int, **kwargs: object) -> dict:
    # the random model writes much of the whitespace JSON allows: a list of calls takes room
    room = 600 if kwargs.get("tool_choice") == "required" else 150
    return dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=room,
                temperature=1.0, seed=seed) | kwargs


def _whole(client: openai.OpenAI, seed: int, **kwargs: object) -> dict:
    (choice,) = client.chat.completions.create(**_ask(seed, **kwargs)).choices
    message = choice.message
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-"), call
    return {"content": message.content, "finish": choice.finish_reason,
            "calls": [(c.function.name, c.function.arguments)
                      for c in message.tool_calls or []]}


def _streamed(client: openai.OpenAI, seed: int, **kwargs: object) -> dict:
    """A streamed answer gathered as a client gathers it, checking vLLM's chunk shape:
    a call's first piece has its id, type and name, the later ones only arguments."""
    chunks = list(client.chat.completions.create(stream=True, **_ask(seed, **kwargs)))
    content, calls, finish = "", {}, None
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id.startswith("chatcmpl-tool-") and piece.type == "function"
                calls[piece.index] = [piece.function.name, ""]
            else:
                assert piece.id is None and piece.function.name is None, piece
            calls[piece.index][1] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sorted(calls) == list(range(len(calls)))
    return {"content": content, "finish": finish,
            "calls": [tuple(calls[i]) for i in sorted(calls)]}


def _valid(name: str, arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_a_named_function_is_called_with_arguments_its_schema_accepts(client) -> None:
    finished = 0
    for seed in SEEDS:
        answer = _whole(client, seed, tool_choice=NAMED)
        # vLLM's shape: one call to the function, empty content, the output's own finish
        assert answer["content"] == "" and len(answer["calls"]) == 1, answer
        assert answer["calls"][0][0] == "get_route"
        assert answer["finish"] in ("stop", "length")
        if answer["finish"] == "stop":
            finished += 1
            assert _valid(*answer["calls"][0]), answer
    assert finished >= len(SEEDS) // 2


def test_required_calls_name_a_tool_each_with_arguments_its_schema_accepts(client) -> None:
    finished, names = 0, set()
    for seed in SEEDS:
        answer = _whole(client, seed, tool_choice="required")
        assert answer["content"] == "", answer
        if answer["finish"] == "tool_calls":
            finished += 1
            assert answer["calls"], answer
            for name, arguments in answer["calls"]:
                assert _valid(name, arguments), (name, arguments)
                names.add(name)
        else:
            assert answer["finish"] == "length", answer
    assert finished >= len(SEEDS) // 2
    assert names == set(SCHEMAS)  # the anyOf lets the model call either tool


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_a_stream_adds_up_to_the_whole_answer(client, choice) -> None:
    for seed in SEEDS:
        whole, streamed = _whole(client, seed, tool_choice=choice), \
            _streamed(client, seed, tool_choice=choice)
        # the same calls, names and arguments to the character (a cut output's too)
        assert streamed == whole | {"content": ""}, (streamed, whole)


def test_required_with_parallel_tool_calls_false_makes_one_call(client) -> None:
    finished = 0
    for seed in SEEDS:
        answer = _whole(client, seed, tool_choice="required", parallel_tool_calls=False)
        if answer["finish"] == "tool_calls":
            finished += 1
            assert len(answer["calls"]) == 1 and _valid(*answer["calls"][0]), answer
    assert finished >= len(SEEDS) // 2


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "'get_time', which is not among the request's tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": None, "tool_choice": NAMED}, "tool_choice", "needs tools"),
    ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice, response_format"),
    ({"tool_choice": "required", "tools": [
        TOOLS[1], {"type": "function", "function": {"name": "other", "parameters": {
            "$defs": {"place": {"type": "integer"}}, "type": "object"}}}]},
     "tools.1.function.parameters", "$defs.place"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "broken", "parameters": {"type": "nonsense"}}}]}, "tools", "nonsense"),
])
def test_tool_choices_that_do_not_fit_the_tools_are_a_400_naming_the_field(
        client, extra, param, words) -> None:
    body = _ask(0, tool_choice="required") | extra
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{k: v for k, v in body.items() if v is not None})
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error
    # the server serves on
    assert _whole(client, 0, tool_choice=NAMED)["calls"]
