"""Structured outputs over HTTP: every form RL clients send reaches the engine's grammar
(OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``, SGLang's
``json_schema`` / ``regex`` / ``ebnf``), the official ``openai`` client gets JSON its
schema accepts, and a constraint that does not parse is a 400 naming the field while the
server serves on."""

from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest
from serve_kit import API_KEY

pytest.importorskip("xgrammar")

MODEL = "tiny-qwen3"
REGEX = "[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Give me the record."}]


class Record(pydantic.BaseModel):
    n: int
    ok: bool


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def _post(http, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_openai_client_gets_json_its_schema_accepts(client) -> None:
    finished = 0
    for seed in range(4):
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0.8, seed=seed,
            response_format={"type": "json_schema", "json_schema": {
                "name": "record", "schema": SCHEMA, "strict": True}})
        (choice,) = response.choices
        if choice.finish_reason == "stop":
            finished += 1
            record = Record.model_validate(json.loads(choice.message.content))
            assert 0 <= record.n <= 999
    assert finished >= 2


def test_the_openai_clients_parse_helper_gets_its_model(client) -> None:
    parsed = [client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0.8, seed=seed,
        response_format=Record).choices[0] for seed in range(4)]
    done = [c.message.parsed for c in parsed if c.finish_reason == "stop"]
    assert len(done) >= 2 and all(isinstance(r, Record) for r in done)


def test_json_object_output_parses(client) -> None:
    texts = [client.completions.create(
        model=MODEL, prompt=[5, 17, 42], max_tokens=64, temperature=0.7, seed=seed,
        extra_body={"structured_outputs": {"json_object": True,
                                           "disable_any_whitespace": True}}).choices[0]
        for seed in range(4)]
    done = [c.text for c in texts if c.finish_reason == "stop"]
    assert len(done) >= 3 and all(isinstance(json.loads(t), dict) for t in done)


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX},
], ids=["structured_outputs", "guided_regex"])
def test_completions_hold_a_regex(http, extra) -> None:
    for seed in range(3):
        choice = _post(http, "/v1/completions", {
            "model": MODEL, "prompt": [5, 17, 42], "max_tokens": 32, "temperature": 1.0,
            "seed": seed} | extra)["choices"][0]
        assert choice["finish_reason"] == "stop" and re.fullmatch(REGEX, choice["text"])


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES},
], ids=["structured_outputs", "guided_choice"])
def test_chat_returns_one_of_the_choices(http, extra) -> None:
    for seed in range(3):
        choice = _post(http, "/v1/chat/completions", {
            "model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0,
            "seed": seed} | extra)["choices"][0]
        assert choice["message"]["content"] in CHOICES and choice["finish_reason"] == "stop"


def test_response_format_text_is_neutral(http) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True}
    plain = _post(http, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    text = _post(http, "/v1/chat/completions", body | {"response_format": {"type": "text"}})
    assert text["choices"][0]["message"]["content"] == plain


@pytest.mark.parametrize(("field", "value", "check"), [
    ("regex", REGEX, lambda t: re.fullmatch(REGEX, t)),
    ("json_schema", json.dumps(SCHEMA), lambda t: Record.model_validate_json(t)),
    ("ebnf", 'root ::= "a" | "bb" | "ccc"', lambda t: t in ("a", "bb", "ccc")),
])
def test_sglang_generate_holds_its_constraint(http, field, value, check) -> None:
    done = 0
    for seed in range(3):
        answer = _post(http, "/generate", {"input_ids": [5, 17, 42], "sampling_params": {
            "max_new_tokens": 200, "temperature": 0.8, "sampling_seed": seed, field: value}})
        if answer["meta_info"]["finish_reason"]["type"] == "stop":
            done += 1
            assert check(answer["text"]), answer["text"]
    assert done >= 2


def test_the_tokens_in_route_holds_structured_outputs(http) -> None:
    answer = _post(http, "/inference/v1/generate", {"token_ids": [5, 17, 42], "sampling_params": {
        "max_tokens": 16, "temperature": 1.0, "seed": 1,
        "structured_outputs": {"choice": CHOICES}}})
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "nonsense"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x"}}},
     "response_format.json_schema", "json_schema.schema"),
    ("/v1/completions", {"structured_outputs": {"json": "{oops"}}, "structured_outputs",
     "structured_outputs.json is not valid JSON"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs", "exactly one"),
    ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex", "guided_regex could not be"),
    ("/v1/completions", {"guided_grammar": "root ::= nowhere"}, "guided_grammar", "nowhere"),
    ("/v1/completions", {"guided_regex": "a", "response_format": {"type": "json_object"}},
     "guided_regex", "response_format, guided_regex"),
    ("/generate", {"sampling_params": {"regex": "(("}}, "sampling_params.regex", "regex"),
])
def test_a_bad_constraint_is_a_400_naming_it_and_the_server_serves_on(
        http, path, body, param, words) -> None:
    if path == "/generate":
        body = {"input_ids": [5, 17]} | body
    elif path == "/v1/completions":
        body = {"model": MODEL, "prompt": [5, 17], "max_tokens": 4} | body
    else:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4} | body
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert _post(http, "/v1/completions", {"model": MODEL, "prompt": [5, 17],
                                           "max_tokens": 2})["choices"][0]["text"] is not None
