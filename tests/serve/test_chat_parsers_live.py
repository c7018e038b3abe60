"""The server's output parsers end to end: the official ``openai`` client against live
``kvrunner serve`` processes started with vLLM's flags (``--tool-call-parser hermes``
or ``qwen3_coder``, ``--enable-auto-tool-choice``, ``--reasoning-parser qwen3``).

The model is a scripted tiny checkpoint (scripted_checkpoint.py): the real engine
greedily writes a fixed output in a parser's format, token by token, so the parsers
read what the engine detokenizes, whole and streamed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from scripted_checkpoint import write_scripted_checkpoint
from serve_kit import API_KEY, ServeProcess, start_server

from kvrunner.cli.main import main

#: a Qwen3 turn: reasoning, a word, a Hermes call
HERMES_SCRIPT = ["<think>", "\nThe user asks for the weather.\n", "</think>",
                 "\n\nLet me check.\n", "<tool_call>", '\n{"name": "get_weather", ',
                 '"arguments": {"city": "Paris", "days": 3}}', "\n</tool_call>"]
#: a Qwen3-Coder turn: a word, two calls, the parameters written as bare text
CODER_SCRIPT = ["Checking both towns.\n", "<tool_call>", "\n<function=get_weather>",
                "\n<parameter=city>\nParis\n</parameter>", "\n<parameter=days>\n3\n</parameter>",
                "\n</function>\n</tool_call>",
                "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>"
                "\n</function>\n</tool_call>"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a town",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "weather?"}]
PARSED_FLAGS = {
    "hermes": ["--tool-call-parser", "hermes", "--enable-auto-tool-choice",
               "--reasoning-parser", "qwen3"],
    "qwen3_coder": ["--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice"],
}


@pytest.fixture(scope="module")
def parsed_servers(tmp_path_factory: pytest.TempPathFactory, serve_home: Path
                   ) -> Iterator[dict[str, ServeProcess]]:
    """One server per tool-call parser, each serving a checkpoint scripted in its format,
    started when a test first asks for it."""
    tmp = tmp_path_factory.mktemp("parsers")
    scripts = {"hermes": HERMES_SCRIPT, "qwen3_coder": CODER_SCRIPT}
    started: dict[str, ServeProcess] = {}

    class Servers(dict):
        def __missing__(self, name: str) -> ServeProcess:
            checkpoint = write_scripted_checkpoint(tmp / name, scripts[name])
            started[name] = self[name] = start_server(
                tmp, serve_home, name, PARSED_FLAGS[name], api_key=API_KEY,
                model=str(checkpoint)).wait_ready()
            return started[name]

    try:
        yield Servers()
    finally:
        codes = {name: server.stop() for name, server in started.items()}
        assert set(codes.values()) <= {0}, codes


def _client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _ask(client: openai.OpenAI, **kwargs: object) -> dict:
    return dict(model=_model(client), messages=ASK, tools=TOOLS, temperature=0.0,
                max_tokens=40) | kwargs


def _streamed(client: openai.OpenAI, **kwargs: object) -> tuple[dict, list]:
    """A streamed answer gathered as a client gathers it: content, reasoning, calls by
    index (id, type and name from their first piece, arguments joined), the finish
    reason; and the chunks."""
    chunks = list(client.chat.completions.create(stream=True, **_ask(client, **kwargs)))
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        (choice,) = chunk.choices
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name, piece
                calls[piece.index] = {"id": piece.id, "name": piece.function.name,
                                      "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None, piece
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [calls[i] for i in sorted(calls)], "finish": finish}, chunks


def _whole(client: openai.OpenAI, **kwargs: object) -> dict:
    (choice,) = client.chat.completions.create(**_ask(client, **kwargs)).choices
    message = choice.message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in message.tool_calls or []]
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-")
               for c in message.tool_calls or [])
    return {"content": message.content,
            "reasoning": (message.model_extra or {}).get("reasoning_content"),
            "calls": calls, "finish": choice.finish_reason}


def _without_ids(answer: dict) -> dict:
    return answer | {"calls": [{k: v for k, v in c.items() if k != "id"}
                               for c in answer["calls"]]}


def test_hermes_calls_and_qwen3_reasoning_come_apart_from_the_content(parsed_servers) -> None:
    client = _client(parsed_servers["hermes"])
    assert _without_ids(_whole(client)) == {
        "content": "\n\nLet me check.\n", "reasoning": "\nThe user asks for the weather.\n",
        "calls": [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}],
        "finish": "tool_calls"}


def test_hermes_and_qwen3_stream_to_the_whole_answer(parsed_servers) -> None:
    client = _client(parsed_servers["hermes"])
    streamed, chunks = _streamed(client)
    assert _without_ids(streamed) == _without_ids(_whole(client))
    # reasoning goes out before the content, and the call after both
    kinds = [next(k for k in ("reasoning_content", "content", "tool_calls")
                  if (c.choices[0].delta.model_extra or {}).get(k)
                  or getattr(c.choices[0].delta, k, None))
             for c in chunks if c.choices[0].finish_reason is None
             and (c.choices[0].delta.content or c.choices[0].delta.tool_calls
                  or (c.choices[0].delta.model_extra or {}).get("reasoning_content"))]
    assert kinds[0] == "reasoning_content" and kinds[-1] == "tool_calls", kinds
    assert chunks[0].choices[0].delta.role == "assistant"


def test_qwen3_coder_calls_are_typed_by_the_tool_schema(parsed_servers) -> None:
    client = _client(parsed_servers["qwen3_coder"])
    whole = _whole(client)
    assert _without_ids(whole) == {
        "content": "Checking both towns.\n", "reasoning": None,
        "calls": [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
                  {"name": "get_weather", "arguments": '{"city": "Oslo"}'}],
        "finish": "tool_calls"}
    assert len({c["id"] for c in whole["calls"]}) == 2


def test_qwen3_coder_streams_a_call_name_first_then_its_arguments(parsed_servers) -> None:
    client = _client(parsed_servers["qwen3_coder"])
    streamed, chunks = _streamed(client)
    assert _without_ids(streamed) == _without_ids(_whole(client))
    fragments = [p.function.arguments for c in chunks for p in c.choices[0].delta.tool_calls or []
                 if p.index == 0]
    assert fragments == ["", '{"city": "Paris"', ', "days": 3', "}"]


def test_qwen3_coder_with_parallel_tool_calls_false_keeps_the_first_call(parsed_servers) -> None:
    client = _client(parsed_servers["qwen3_coder"])
    whole = _whole(client, parallel_tool_calls=False)
    streamed, _ = _streamed(client, parallel_tool_calls=False)
    assert [c["arguments"] for c in whole["calls"]] == ['{"city": "Paris", "days": 3}']
    assert _without_ids(streamed) == _without_ids(whole)


def test_tool_choice_none_leaves_the_calls_in_the_content(parsed_servers) -> None:
    client = _client(parsed_servers["hermes"])
    for answer in (_whole(client, tool_choice="none"),
                   _streamed(client, tool_choice="none")[0]):
        assert answer["reasoning"] == "\nThe user asks for the weather.\n"
        assert answer["content"].startswith("\n\nLet me check.\n<tool_call>\n")
        assert answer["calls"] == [] and answer["finish"] == "stop"


def test_with_thinking_off_there_is_no_reasoning(parsed_servers) -> None:
    client = _client(parsed_servers["hermes"])
    answer = _whole(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert answer["reasoning"] is None
    assert answer["content"].startswith("<think>\nThe user")
    assert [c["name"] for c in answer["calls"]] == ["get_weather"]


#: a closed schema, so that the scripted model, held to it, soon writes a whole object
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["days"], "additionalProperties": False}


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "thinking_off"])
@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_choice_is_held_to_the_schema_past_the_servers_parsers(
        parsed_servers, choice, thinking) -> None:
    """The tool-call parser does not touch a forced choice (no tags are looked for).
    With thinking on, the model thinks first (the script's think block, parsed out as
    the reasoning) and the grammar holds what follows; with it off the grammar holds
    the output from its first token and no reasoning is parsed out of it."""
    client = _client(parsed_servers["hermes"])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": DAYS}}]
    finished = 0
    for seed in range(4):
        answer = _whole(client, tools=tools, tool_choice=choice, temperature=1.0, seed=seed,
                        max_tokens=200, extra_body={
                            "chat_template_kwargs": {"enable_thinking": thinking}})
        assert answer["content"] == "", answer
        assert answer["reasoning"] == (HERMES_SCRIPT[1] if thinking else None), answer
        assert {c["name"] for c in answer["calls"]} <= {"get_weather"}
        if answer["finish"] in ("stop", "tool_calls"):
            finished += 1
            assert answer["calls"], answer
            for call in answer["calls"]:
                days = json.loads(call["arguments"])["days"]
                assert json.loads(call["arguments"]) == {"days": days} and 1 <= days <= 7
    assert finished >= 1


@pytest.mark.parametrize(("flags", "words"), [
    (["--tool-call-parser", "pythonic"], "--tool-call-parser 'pythonic' is not a parser"),
    (["--reasoning-parser", "deepseek_r1"], "--reasoning-parser 'deepseek_r1' is not a parser"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
])
def test_an_unknown_parser_stops_the_server_at_start_naming_it(flags, words, capsys) -> None:
    assert main(["serve", "--model", "tiny-qwen3", "--port", "0", *flags]) == 2
    assert words in capsys.readouterr().err


def test_qwen3_coder_arguments_are_json_text(parsed_servers) -> None:
    client = _client(parsed_servers["qwen3_coder"])
    assert [json.loads(c["arguments"]) for c in _whole(client)["calls"]] == [
        {"city": "Paris", "days": 3}, {"city": "Oslo"}]


def test_each_of_n_streamed_choices_is_parsed_alone_and_keeps_every_logprob(
        parsed_servers) -> None:
    client = _client(parsed_servers["hermes"])
    (whole,) = client.chat.completions.create(**_ask(client, logprobs=True)).choices
    chunks = list(client.chat.completions.create(stream=True, **_ask(client, n=2,
                                                                   logprobs=True)))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        calls = [p for c in mine for p in c.delta.tool_calls or []]
        assert [p.function.name for p in calls if p.id] == ["get_weather"]
        assert "".join(p.function.arguments or "" for p in calls) == \
            whole.message.tool_calls[0].function.arguments
        # text the parser holds back still sends its tokens' logprobs
        tokens = [e.token for c in mine if c.logprobs for e in c.logprobs.content]
        assert tokens == [e.token for e in whole.logprobs.content]
        assert mine[-1].finish_reason == "tool_calls"
