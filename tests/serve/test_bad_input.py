"""Bad HTTP input gets a 4xx with the JSON error naming the field, and the requests
already in flight keep being served."""

from __future__ import annotations

import json
import threading

import pytest

MODEL = "tiny-qwen3"


def _completion(**fields: object) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4} | fields


def _generate(**sampling: object) -> dict:
    return {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4} | sampling}


#: (id, method, path, body (dict, or raw text), status, the field the error must name)
CASES = [
    ("malformed_json", "POST", "/v1/completions", '{"model": "tiny-qwen3", "prompt": ',
     400, "body"),
    ("not_an_object", "POST", "/v1/completions", "[1, 2]", 400, "body"),
    ("empty_body", "POST", "/v1/completions", "", 400, "body"),
    ("wrong_type", "POST", "/v1/completions", _completion(temperature="hot"), 400,
     "temperature"),
    ("unknown_field", "POST", "/v1/completions", _completion(beam_width=4), 400, "beam_width"),
    ("negative_max_tokens", "POST", "/v1/completions", _completion(max_tokens=-1), 400,
     "max_tokens"),
    ("float_max_tokens", "POST", "/v1/completions", _completion(max_tokens=2.5), 400,
     "max_tokens"),
    ("string_max_tokens", "POST", "/v1/completions", _completion(max_tokens="5"), 400,
     "max_tokens"),
    ("bool_n", "POST", "/v1/completions", _completion(n=True), 400, "n"),
    ("huge_n", "POST", "/v1/completions", _completion(n=1_000_000), 400, "n"),
    ("huge_logprobs", "POST", "/v1/completions", _completion(logprobs=10_000), 400, "logprobs"),
    ("out_of_vocab_prompt", "POST", "/v1/completions", _completion(prompt=[1, 10**9]), 400,
     "prompt"),
    ("float_token_id", "POST", "/v1/completions", _completion(prompt=[1, 2.5]), 400, "prompt.1"),
    ("empty_text_prompt", "POST", "/v1/completions", _completion(prompt=""), 400, "prompt"),
    # a JSON escape of a lone UTF-16 surrogate: valid JSON, not a Unicode character
    ("lone_surrogate_prompt", "POST", "/v1/completions",
     '{"model": "tiny-qwen3", "prompt": "a\\ud800b", "max_tokens": 4}', 400, "prompt"),
    ("lone_surrogate_batch_prompt", "POST", "/v1/completions",
     '{"model": "tiny-qwen3", "prompt": ["ok", "\\udfff"], "max_tokens": 4}', 400,
     "prompt.1"),
    ("lone_surrogate_generate_text", "POST", "/generate", '{"text": "\\ud83d!"}', 400, "text"),
    ("lone_surrogate_bad_word", "POST", "/v1/completions",
     '{"model": "tiny-qwen3", "prompt": "hi", "bad_words": ["\\ud800"], "max_tokens": 4}',
     400, "bad_words"),
    ("logit_bias_past_the_vocabulary", "POST", "/v1/completions",
     _completion(logit_bias={"1000000000": 5}), 400, "logit_bias"),
    ("allowed_token_ids_past_the_vocabulary", "POST", "/v1/completions",
     _completion(allowed_token_ids=[10**9]), 400, "allowed_token_ids"),
    ("vllm_generate_allowed_token_ids_past_the_vocabulary", "POST", "/inference/v1/generate",
     {"model": MODEL, "token_ids": [1, 2], "sampling_params": {"allowed_token_ids": [10**9]}},
     400, "sampling_params.allowed_token_ids"),
    ("lone_surrogate_tokenize", "POST", "/tokenize",
     '{"model": "tiny-qwen3", "prompt": "\\ud800"}', 400, "prompt"),
    ("top_p_above_one", "POST", "/v1/completions", _completion(top_p=1.5), 400, "top_p"),
    ("negative_temperature", "POST", "/v1/completions", _completion(temperature=-1), 400,
     "temperature"),
    ("negative_seed", "POST", "/v1/completions", _completion(seed=-3), 400, "seed"),
    ("penalty", "POST", "/v1/completions", _completion(frequency_penalty=2.5), 400,
     "frequency_penalty"),
    ("echo", "POST", "/v1/completions", _completion(echo=True, stream=True), 400, "echo"),
    ("unknown_model", "POST", "/v1/completions", _completion(model="llama-9000"), 404, "model"),
    ("missing_model", "POST", "/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("chat_no_messages", "POST", "/v1/chat/completions", {"model": MODEL, "messages": []},
     400, "messages"),
    ("chat_bad_role", "POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role"),
    ("generate_both_prompts", "POST", "/generate", _generate() | {"text": "hi"}, 400, "text"),
    ("generate_no_prompt", "POST", "/generate", {"sampling_params": {}}, 400, "input_ids"),
    ("generate_negative_max_new_tokens", "POST", "/generate", _generate(max_new_tokens=-3),
     400, "sampling_params.max_new_tokens"),
    ("generate_unknown_sampling_field", "POST", "/generate", _generate(beam=2), 400,
     "sampling_params.beam"),
    ("generate_out_of_vocab", "POST", "/generate", {"input_ids": [5, 10**9]}, 400, "input_ids"),
    ("generate_stop_token_out_of_vocab", "POST", "/generate",
     _generate(stop_token_ids=[10**9]), 400, "sampling_params.stop_token_ids"),
    ("generate_huge_n", "POST", "/generate", _generate(n=10**6), 400, "sampling_params.n"),
    ("generate_penalty_past_sglangs_range", "POST", "/generate",
     _generate(repetition_penalty=2.5), 400, "sampling_params.repetition_penalty"),
    ("generate_grammar_that_does_not_parse", "POST", "/generate", _generate(regex="(a+"),
     400, "sampling_params.regex"),
    ("generate_huge_top_logprobs", "POST", "/generate",
     {"input_ids": [1], "return_logprob": True, "top_logprobs_num": 999}, 400,
     "top_logprobs_num"),
    ("pause_unknown_mode", "POST", "/pause?mode=forever", None, 400, "mode"),
    ("pause_unknown_query", "POST", "/pause?mode=keep&fast=1", None, 400, "fast"),
    ("sleep_bad_level", "POST", "/sleep?level=x", None, 400, "level"),
    ("sglang_pause_bad_mode", "POST", "/pause_generation", {"mode": "sideways"}, 400, "mode"),
    ("update_weights_no_path", "POST", "/update_weights_from_disk", {}, 400, "model_path"),
    ("update_weights_missing_dir", "POST", "/update_weights_from_disk",
     {"model_path": "/nonexistent/ckpt"}, 400, "model_path"),
    ("abort_no_rid", "POST", "/abort_request", {}, 400, "rid"),
]


def _send(client, method: str, path: str, body: object):
    if body is None:
        return client.request(method, path)
    content = body if isinstance(body, str) else json.dumps(body)
    return client.request(method, path, content=content,
                          headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def long_stream(server):
    """A streaming request of 256 tokens, running while every bad request is sent."""
    body = {"input_ids": [7, 8, 9], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 256, "ignore_eos": True,
                                "temperature": 1.0, "sampling_seed": 5}}
    events: list[dict] = []
    first = threading.Event()

    def read() -> None:
        with server.client() as client, client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    first.set()
        first.set()

    thread = threading.Thread(target=read)
    thread.start()
    assert first.wait(120), "the long stream never started"
    yield events, thread


@pytest.mark.parametrize(("method", "path", "body", "status", "param"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_naming_the_field(server, long_stream, method, path, body,
                                              status, param) -> None:
    with server.client() as client:
        response = _send(client, method, path, body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["code"] == status and error["message"]


def test_the_request_in_flight_was_served_whole(server, long_stream) -> None:
    events, thread = long_stream
    thread.join(timeout=300)
    assert not thread.is_alive()
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 256}
    assert len(last["output_ids"]) == 256
    assert len(last["meta_info"]["output_token_logprobs"]) == 256
    # the server still serves
    with server.client() as client:
        response = client.post("/generate", json={"input_ids": [1, 2],
                                                  "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 200 and len(response.json()["output_ids"]) <= 2
