"""verifiers' own ``TrainClient`` (verifiers 0.4.0, ``verifiers/v1/clients/train.py``:
the training client prime-rl runs) against a live ``kvrunner serve``, unchanged.

The client is built as a verifiers user builds it, from its ``TrainClientConfig``
(the server's URL, the API key's variable, the renderer and the model the renderer
tokenizes for), and each turn goes through its ``get_response`` with the
chat-completions dialect and a ``SamplingConfig``. It renders the messages to token
ids itself (the ``renderers`` package; its ``DefaultRenderer``, the chat template of
the checkpoint, is the renderer that fits the embedded model: the typed Qwen3 renderer
needs Qwen3's special tokens, which the tiny tokenizer writes as plain text), asks
``GET /v1/models`` for the model's length, and posts vLLM's
``/inference/v1/generate`` with ``logprobs: 1`` and the renderer's stop ids. Each
answer is checked against the server's own rendering (``/tokenize``) and the
in-process ``LLM``'s tokens and logprobs for the same prompt ids.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

# collected only in the compat stage (conftest.py), whose site must hold them: a failed
# import there is an error, not a skip
import renderers
import verifiers.v1.clients.train as train
import verifiers.v1.configs.client as client_configs
import verifiers.v1.dialects as dialects
import verifiers.v1.errors as vf_errors
import verifiers.v1.types as vf_types

from kvrunner import SamplingParams

MODEL = "tiny-qwen3"
API_KEY = "vf-compat-key"
KEY_VAR = "VERIFIERS_TRAIN_API_KEY"
#: the embedded tokenizer's end of text, the renderer's one stop id
EOS = 0
QUESTION = [{"role": "user", "content": "weather by the river?"}]


@pytest.fixture(scope="module")
def train_server(tmp_path_factory, compat_home):
    """A server as prime-rl starts vLLM for its rollouts: behind an API key."""
    from serve_kit import start_server

    from kvrunner.models.tiny import ensure_default_model

    ensure_default_model(MODEL)
    server = start_server(tmp_path_factory.mktemp("verifiers_logs"), compat_home,
                          "verifiers", [], api_key=API_KEY).wait_ready()
    previous = os.environ.get(KEY_VAR)
    os.environ[KEY_VAR] = API_KEY
    yield server
    if previous is None:
        os.environ.pop(KEY_VAR, None)
    else:
        os.environ[KEY_VAR] = previous
    assert server.stop() == 0


@pytest.fixture(scope="module")
def checkpoint(compat_home) -> Path:
    from kvrunner.models.tiny import ensure_default_model

    return ensure_default_model(MODEL)


def config(server, checkpoint: Path, **renderer: Any):
    """A ``TrainClientConfig`` as a verifiers user writes one: the server's OpenAI base,
    the key's variable, the renderer pinned to the checkpoint's tokenizer."""
    return client_configs.TrainClientConfig(
        base_url=server.url + "/v1", api_key_var=KEY_VAR,
        renderer=renderers.DefaultRendererConfig(**renderer),
        renderer_model_name=str(checkpoint))


def conversation(cfg, turns: list[tuple[dict, dict]]) -> list[Any]:
    """Each ``(body, sampling)`` as one ``TrainClient.get_response`` turn, in order, on
    one client (its connection pool lives on one event loop)."""
    async def run() -> list[Any]:
        client = train.TrainClient(cfg)
        try:
            return [await client.get_response(dialects.ChatDialect(), body,
                                              vf_types.SamplingConfig(**sampling))
                    for body, sampling in turns]
        finally:
            await client.close()

    return asyncio.run(run())


def turn(cfg, messages: list[dict], tools: list[dict] | None = None, **sampling: Any):
    """One turn of ``messages`` (and ``tools``) on a client of its own."""
    body = {"model": MODEL, "messages": messages} | ({"tools": tools} if tools else {})
    (response,) = conversation(cfg, [(body, sampling)])
    return response


def served_rendering(server, messages: list[dict], **extra: Any) -> list[int]:
    """The server's own rendering of ``messages`` (vLLM's ``/tokenize``)."""
    with server.client() as http:
        answer = http.post("/tokenize", json={"model": MODEL, "messages": messages} | extra)
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def engine(reference_llm, prompt: list[int], **params: Any):
    """The in-process engine's answer for ``prompt`` with the client's stop id."""
    (out,) = reference_llm.generate([prompt], SamplingParams(
        stop_token_ids=[EOS], logprobs=1, **params))
    return out


def test_a_turn_is_the_engines_greedy_tokens_for_the_rendered_prompt(
        train_server, checkpoint, reference_llm) -> None:
    got = turn(config(train_server, checkpoint), QUESTION, temperature=0.0, max_tokens=6)
    ref = engine(reference_llm, got.tokens.prompt_ids, temperature=0.0, max_tokens=6)
    assert got.tokens.prompt_ids == served_rendering(train_server, QUESTION)
    assert got.tokens.completion_ids == ref.token_ids
    assert got.tokens.completion_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert got.finish_reason == ref.finish_reason
    assert got.usage.prompt_tokens == len(got.tokens.prompt_ids)
    assert got.usage.completion_tokens == len(ref.token_ids)
    assert got.message.content == reference_llm.tokenizer.decode(
        [t for t in ref.token_ids if t != EOS], skip_special_tokens=False)
    assert got.id.startswith("generate-tokens")
    assert got.raw["choices"][0]["message"]["content"] == got.message.content


def test_temperature_zero_gives_the_same_tokens_twice(train_server, checkpoint) -> None:
    cfg = config(train_server, checkpoint)
    body = {"model": MODEL, "messages": QUESTION}
    sampling = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    first, second = conversation(cfg, [(body, sampling), (body, sampling)])
    assert first.tokens.completion_ids == second.tokens.completion_ids
    assert len(first.tokens.completion_ids) == 8 and first.finish_reason == "length"


def test_max_tokens_temperature_and_seed_are_the_engines(
        train_server, checkpoint, reference_llm) -> None:
    got = turn(config(train_server, checkpoint), QUESTION, temperature=0.8, seed=7,
               max_tokens=5, ignore_eos=True)
    ref = engine(reference_llm, got.tokens.prompt_ids, temperature=0.8, seed=7,
                 max_tokens=5, ignore_eos=True)
    assert got.tokens.completion_ids == ref.token_ids
    assert len(ref.token_ids) == 5 and got.finish_reason == "length"
    assert got.tokens.completion_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    other = turn(config(train_server, checkpoint), QUESTION, temperature=0.8, seed=8,
                 max_tokens=5, ignore_eos=True)
    assert other.tokens.completion_ids == engine(
        reference_llm, other.tokens.prompt_ids, temperature=0.8, seed=8, max_tokens=5,
        ignore_eos=True).token_ids


def test_a_stop_string_ends_the_turn_where_the_engine_ends_it(
        train_server, checkpoint, reference_llm) -> None:
    cfg = config(train_server, checkpoint)
    free = turn(cfg, QUESTION, temperature=0.0, max_tokens=16, ignore_eos=True)
    text = reference_llm.tokenizer.decode(free.tokens.completion_ids)
    stop = text[6:9]
    got = turn(cfg, QUESTION, temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    ref = engine(reference_llm, got.tokens.prompt_ids, temperature=0.0, max_tokens=16,
                 ignore_eos=True, stop=[stop])
    assert got.tokens.completion_ids == ref.token_ids
    assert len(got.tokens.completion_ids) < len(free.tokens.completion_ids)
    assert got.finish_reason == "stop" == ref.finish_reason


def test_a_multi_turn_conversation_renders_each_turn_and_generates_on_it(
        train_server, checkpoint, reference_llm) -> None:
    cfg = config(train_server, checkpoint)
    sampling = {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True}
    (first,) = conversation(cfg, [({"model": MODEL, "messages": QUESTION}, sampling)])
    history = [*QUESTION, {"role": "assistant", "content": first.message.content},
               {"role": "user", "content": "and at night?"}]
    (second,) = conversation(cfg, [({"model": MODEL, "messages": history}, sampling)])
    assert second.tokens.prompt_ids == served_rendering(train_server, history)
    assert len(second.tokens.prompt_ids) > len(first.tokens.prompt_ids)
    assert second.tokens.completion_ids == engine(
        reference_llm, second.tokens.prompt_ids, **sampling).token_ids


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a town.",
    "parameters": {"type": "object", "properties": {"town": {"type": "string"}},
                   "required": ["town"]}}}]


def test_tools_and_template_kwargs_render_into_the_prompt(
        train_server, checkpoint, reference_llm) -> None:
    got = turn(config(train_server, checkpoint, tool_parser="qwen3"), QUESTION, TOOLS,
               temperature=0.0, max_tokens=4,
               chat_template_kwargs={"enable_thinking": False})
    assert got.tokens.prompt_ids == served_rendering(
        train_server, QUESTION, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    text = reference_llm.tokenizer.decode(got.tokens.prompt_ids, skip_special_tokens=False)
    assert "get_weather" in text and text.endswith("<think>\n\n</think>\n\n")
    assert got.tokens.completion_ids == engine(
        reference_llm, got.tokens.prompt_ids, temperature=0.0, max_tokens=4).token_ids


def test_a_cache_salt_is_taken_and_changes_no_token(train_server, checkpoint) -> None:
    cfg = config(train_server, checkpoint)
    plain = turn(cfg, QUESTION, temperature=0.0, max_tokens=4)
    salted = turn(cfg, QUESTION, temperature=0.0, max_tokens=4, cache_salt="rollout-7")
    assert salted.tokens.completion_ids == plain.tokens.completion_ids


def test_a_prompt_over_the_served_length_fails_before_it_is_sent(
        train_server, checkpoint) -> None:
    long = [{"role": "user", "content": "the river " * 3000}]
    with pytest.raises(vf_errors.ProviderError) as caught:
        turn(config(train_server, checkpoint), long, temperature=0.0, max_tokens=2)
    assert caught.value.status_code == 400
    assert "maximum context length (4096)" in str(caught.value)


def test_a_refused_sampling_value_is_a_400_the_harness_does_not_retry(
        train_server, checkpoint) -> None:
    with pytest.raises(vf_errors.ProviderError) as caught:
        turn(config(train_server, checkpoint), QUESTION, temperature=0.0, max_tokens=2,
             min_p=1.5)
    assert caught.value.status_code == 400
    assert "min_p" in str(caught.value)
