"""Reasoning before the grammar over HTTP: with ``--reasoning-parser qwen3`` a
constrained chat request (``response_format``, ``structured_outputs``, a forced
``tool_choice``) thinks freely and the grammar holds only what follows ``</think>``, as
vLLM's structured-output manager does; with thinking disabled the grammar holds the
output from its first token.

The model is a scripted tiny checkpoint (scripted_checkpoint.py) whose tokenizer has
``<think>`` and ``</think>`` as tokens of their own and whose greedy output is a Qwen3
turn: a think block, then a JSON record. Under the grammar from the first token the
script could not even open its think block.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from scripted_checkpoint import write_scripted_checkpoint
from serve_kit import API_KEY, ServeProcess, start_server

pytest.importorskip("xgrammar")

THOUGHT = "\nThe user wants the weather.\n"
RECORD = '{"city": "Paris", "days": 3}'
SCRIPT = ["<think>", THOUGHT, "</think>", RECORD]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "weather?"}]
CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, serve_home: Path
           ) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("reasoning_grammar")
    checkpoint = write_scripted_checkpoint(tmp / "model", SCRIPT)
    process = start_server(tmp, serve_home, "reasoning", ["--reasoning-parser", "qwen3"],
                           api_key=API_KEY, model=str(checkpoint)).wait_ready()
    try:
        yield process
    finally:
        assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def _chat(client: openai.OpenAI, **kwargs: object):
    model = client.models.list().data[0].id
    (choice,) = client.chat.completions.create(
        model=model, messages=ASK, temperature=0.0, max_tokens=40, **kwargs).choices
    return choice


def _reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_a_json_schema_holds_the_answer_after_the_thinking(client) -> None:
    choice = _chat(client, response_format={"type": "json_schema", "json_schema": {
        "name": "weather", "schema": WEATHER}})
    assert _reasoning(choice.message) == THOUGHT
    assert choice.message.content == RECORD and choice.finish_reason == "stop"


def test_every_token_after_the_thinking_is_the_grammars(client) -> None:
    # the script's record is no choice: after </think> the grammar picks the tokens
    choice = _chat(client, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert _reasoning(choice.message) == THOUGHT
    assert choice.message.content in CHOICES and choice.finish_reason == "stop"


def test_without_thinking_the_grammar_holds_the_output_from_its_first_token(client) -> None:
    choice = _chat(client, extra_body={"structured_outputs": {"choice": CHOICES},
                                       "chat_template_kwargs": {"enable_thinking": False}})
    assert _reasoning(choice.message) is None
    assert choice.message.content in CHOICES and choice.finish_reason == "stop"


def test_a_forced_call_is_made_after_the_thinking(client) -> None:
    choice = _chat(client, tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert _reasoning(choice.message) == THOUGHT
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_the_stream_splits_the_thinking_from_the_held_answer(client) -> None:
    model = client.models.list().data[0].id
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(
            model=model, messages=ASK, temperature=0.0, max_tokens=40, stream=True,
            response_format={"type": "json_schema", "json_schema": {
                "name": "weather", "schema": WEATHER}}):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert reasoning == THOUGHT and content == RECORD
