"""``/v1/chat/completions`` renders the messages with the checkpoint's chat template,
exactly as transformers' ``apply_chat_template`` does on the same tokenizer, and
generates what the in-process ``LLM`` generates for that prompt. (A checkpoint
without a template gets a 400 naming ``messages``: test_openai_client.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_kit import API_KEY, ENGINE_KWARGS, ServeProcess, start_server
from transformers import AutoTokenizer

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.serve.chat_template import load_chat_template

#: a template using what published ones use: a namespace, a filtered loop with
#: loop.last, {% break %}, tojson on non-ASCII and HTML-ish text, raise_exception,
#: the special tokens, whitespace control and add_generation_prompt
TEMPLATE = """\
{%- set ns = namespace(system=none) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- break -%}{%- endif -%}
{%- endfor -%}
{{- bos_token -}}
{%- if ns.system is not none %}<|system|>{{ ns.system | trim }}{{ eos_token }}
{% endif -%}
{%- for m in messages if m.role != 'system' -%}
  {%- if m.role not in ['user', 'assistant'] -%}
    {{- raise_exception('only user and assistant turns, got ' ~ m.role) -}}
  {%- endif -%}
  {%- if m.name is defined %}<|meta|>{{ {'name': m.name, 'note': '<ä & ü>'} | tojson }}
{% endif -%}
<|{{ m.role }}|>{{ m.content }}{% if not loop.last or m.role == 'assistant' %}{{ eos_token }}
{% endif %}
{% endfor -%}
{%- if add_generation_prompt %}<|assistant|>{% endif -%}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "the cat sat"}],
    [{"role": "system", "content": "  be brief  "}, {"role": "user", "content": "hi there"}],
    [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "d e"},
     {"role": "user", "content": "f g", "name": "bob"}],
    [{"role": "system", "content": "one"}, {"role": "user", "content": "x"},
     {"role": "system", "content": "two"}, {"role": "assistant", "content": "y"}],
]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> Path:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("chat") / "m", seed=0)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config["bos_token"] = config["eos_token"]
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(chat_checkpoint):
    return AutoTokenizer.from_pretrained(str(chat_checkpoint))


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory, serve_home, chat_checkpoint) -> Iterator[ServeProcess]:
    server = start_server(tmp_path_factory.mktemp("chat_logs"), serve_home, "chat", [],
                          api_key=API_KEY, model=str(chat_checkpoint)).wait_ready()
    yield server
    assert server.stop() == 0


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "named", "two_system"])
def test_the_template_renders_as_transformers_apply_chat_template(
    chat_checkpoint, hf_tokenizer, messages, add_generation_prompt
) -> None:
    template = load_chat_template(chat_checkpoint)
    assert template is not None
    got = template.render(messages, add_generation_prompt=add_generation_prompt)
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)
    assert got == want


def test_chat_completions_generate_from_the_rendered_prompt(chat_server, chat_checkpoint,
                                                            hf_tokenizer) -> None:
    settings = {k: v for k, v in ENGINE_KWARGS.items() if k != "model"}
    llm = LLM(str(chat_checkpoint), **settings)
    try:
        with chat_server.client() as client:
            for messages in CONVERSATIONS:
                text = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=True)
                ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
                want = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.8,
                                                          seed=5, ignore_eos=True))[0]
                response = client.post("/v1/chat/completions", json={
                    "model": str(chat_checkpoint), "messages": messages, "max_tokens": 6,
                    "temperature": 0.8, "seed": 5, "ignore_eos": True, "logprobs": True,
                    "return_tokens_as_token_ids": True})
                assert response.status_code == 200, response.text
                body = response.json()
                assert body["usage"]["prompt_tokens"] == len(ids)
                (choice,) = body["choices"]
                tokens = [int(t["token"].split(":")[1]) for t in choice["logprobs"]["content"]]
                assert tokens == want.token_ids
                assert choice["message"] == {"role": "assistant", "content": want.text}
    finally:
        llm.shutdown()


def test_messages_the_template_refuses_are_a_400_naming_messages(chat_server,
                                                                 chat_checkpoint) -> None:
    with chat_server.client() as client:
        response = client.post("/v1/chat/completions", json={
            "model": str(chat_checkpoint), "max_tokens": 2,
            "messages": [{"role": "tool", "content": "42"}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "only user and assistant turns, got tool" in error["message"]


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory, serve_home) -> Iterator[ServeProcess]:
    """A server of a checkpoint whose tokenizer_config.json has no chat template."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("plain") / "m", seed=0)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    server = start_server(tmp_path_factory.mktemp("plain_logs"), serve_home, "plain", [],
                          api_key=API_KEY, model=str(path)).wait_ready()
    yield server
    assert server.stop() == 0


def test_chat_on_a_checkpoint_without_a_template_is_a_clear_400(plain_server) -> None:
    with plain_server.client() as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        response = client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "chat template" in error["message"]
