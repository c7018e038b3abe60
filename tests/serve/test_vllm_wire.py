"""vLLM's wire contract as RL clients speak it (TRL's ``VLLMClient``, verifiers, prime-rl,
SkyRL): the vLLM sampling extras at their neutral values, ``return_token_ids``,
``prompt_logprobs`` and ``top_logprobs`` in vLLM's shapes, chat with tools and
``chat_template_kwargs``, ``/tokenize``, ``/detokenize``, ``/get_world_size``,
``/server_info``'s ``vllm_config`` and the tokens-in, tokens-out
``/inference/v1/generate``, each answer compared with the in-process ``LLM.generate``.
"""

from __future__ import annotations

import json

import pytest
from serve_kit import sse_payloads
from transformers import AutoTokenizer

from kvrunner import SamplingParams

MODEL = "tiny-qwen3"
NEUTRAL = {"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "include_stop_str_in_output": False,
           "skip_special_tokens": True, "spaces_between_special_tokens": True,
           "allowed_token_ids": None, "bad_words": [], "logit_bias": {}, "priority": 0}


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def _post(http, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _ids(entries: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in entries]


def test_the_neutral_vllm_extras_are_accepted_and_change_nothing(http, reference_llm) -> None:
    body = {"model": MODEL, "prompt": [5, 17, 42, 9], "max_tokens": 5, "temperature": 0.7,
            "seed": 3, "logprobs": 0, "return_token_ids": True, "ignore_eos": True}
    plain = _post(http, "/v1/completions", body)["choices"][0]
    extras = _post(http, "/v1/completions", body | NEUTRAL)["choices"][0]
    ref = reference_llm.generate([[5, 17, 42, 9]], SamplingParams(
        max_tokens=5, temperature=0.7, seed=3, logprobs=0, ignore_eos=True))[0]
    assert plain["token_ids"] == extras["token_ids"] == ref.token_ids
    assert plain["prompt_token_ids"] == [5, 17, 42, 9]


#: each of vLLM's sampling extras the engine does, as a client sends it and as
#: SamplingParams takes it (greedy, 24 tokens, unless it says otherwise)
EXTRAS = [
    ({"repetition_penalty": 50.0}, {"repetition_penalty": 50.0}),
    ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
    ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0}),
    ({"min_p": 0.5, "temperature": 2.0}, {"min_p": 0.5, "temperature": 2.0}),
    ({"min_tokens": 4, "stop_token_ids": [11], "logit_bias": {"11": 100}},
     {"min_tokens": 4, "stop_token_ids": [11], "logit_bias": {11: 100.0}}),
    # clamped: 7 and 3 tie above every other token, and their own logits pick
    ({"logit_bias": {"7": 250.0, "3": 100}}, {"logit_bias": {7: 100.0, 3: 100.0}}),
    ({"allowed_token_ids": [3, 4, 300]}, {"allowed_token_ids": [3, 4, 300]}),
]
GREEDY = {"model": MODEL, "prompt": [5, 17, 42, 9], "max_tokens": 24, "temperature": 0.0,
          "seed": 5, "return_token_ids": True, "ignore_eos": True}


def _reference(reference_llm, **params) -> list[int]:
    fields = dict(max_tokens=24, temperature=0.0, seed=5, ignore_eos=True) | params
    return reference_llm.generate([[5, 17, 42, 9]], SamplingParams(**fields))[0].token_ids


@pytest.mark.parametrize(("wire", "params"), EXTRAS, ids=lambda v: ",".join(v))
def test_the_vllm_sampling_extras_do_what_llm_generate_does_with_them(
        http, reference_llm, wire, params) -> None:
    plain = _post(http, "/v1/completions", GREEDY | {
        "temperature": wire.get("temperature", 0.0)})["choices"][0]["token_ids"]
    got = _post(http, "/v1/completions", GREEDY | wire)["choices"][0]["token_ids"]
    assert got == _reference(reference_llm, **params)
    assert got != plain  # each one changes these tokens


def test_bad_words_reach_the_engine(http, reference_llm) -> None:
    plain = _post(http, "/v1/completions", GREEDY)["choices"][0]["token_ids"]
    tokenizer = reference_llm.tokenizer
    # a token of the output that is a word of its own (vLLM bans a word's own tokens)
    token = next(t for t in plain if tokenizer.encode(
        tokenizer.decode([t]).lstrip(), add_special_tokens=False).ids == [t])
    word = tokenizer.decode([token])
    got = _post(http, "/v1/completions", GREEDY | {"bad_words": [word]})["choices"][0]
    assert got["token_ids"] == _reference(reference_llm, bad_words=[word])
    assert token not in got["token_ids"]


def test_the_extras_reach_the_tokens_in_route_too(http, reference_llm) -> None:
    sampling = {"max_tokens": 6, "temperature": 0.0, "repetition_penalty": 3.0,
                "allowed_token_ids": [3, 4, 5, 6], "ignore_eos": True}
    ref = reference_llm.generate([[5, 17, 42, 9]], SamplingParams(**sampling))[0]
    answer = _post(http, "/inference/v1/generate", {"model": MODEL, "token_ids": [5, 17, 42, 9],
                                                    "sampling_params": sampling})
    assert answer["choices"][0]["token_ids"] == ref.token_ids


@pytest.mark.parametrize(("field", "value", "says"), [
    ("repetition_penalty", 0.0, "> 0"), ("presence_penalty", 2.5, "[-2, 2]"),
    ("min_p", 1.5, "[0, 1]"), ("min_tokens", 9, "max_tokens"),
    ("logit_bias", {"x": 1.0}, "token ids"), ("logit_bias", {"99999999": 1.0}, "vocabulary"),
    ("allowed_token_ids", [99999999], "vocabulary"), ("bad_words", [" "], "non-blank"),
])
def test_a_bad_extra_is_a_400_naming_it(http, field, value, says) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2],
                                                  "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"] and field in error["message"], error


def test_the_output_side_extras_shape_the_text_as_llm_generate_does(
        http, reference_llm) -> None:
    plain = _post(http, "/v1/completions", GREEDY | {"max_tokens": 12})["choices"][0]["text"]
    stop = plain[4:7]
    eos = sorted(reference_llm.engine.scheduler.eos_token_ids)[0]
    for wire, params in (
            ({"stop": [stop], "include_stop_str_in_output": True},
             {"stop": [stop], "include_stop_str_in_output": True}),
            ({"logit_bias": {str(eos): 100}, "skip_special_tokens": False,
              "spaces_between_special_tokens": False},
             {"logit_bias": {eos: 100.0}, "skip_special_tokens": False})):
        got = _post(http, "/v1/completions", GREEDY | {"max_tokens": 12} | wire)
        ref = reference_llm.generate([[5, 17, 42, 9]], SamplingParams(
            max_tokens=12, temperature=0.0, seed=5, ignore_eos=True, **params))[0]
        assert got["choices"][0]["text"] == ref.text
    assert ref.text and stop in _post(http, "/v1/completions", GREEDY | {
        "max_tokens": 12, "stop": [stop], "include_stop_str_in_output": True}
    )["choices"][0]["text"]


@pytest.mark.parametrize(("field", "value"), [("priority", 1)])
def test_an_extra_asking_for_what_kvrunner_does_not_do_is_a_400_naming_it(
        http, field, value) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2],
                                                  "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_logprobs_zero_gives_the_sampled_token_alone_and_n_gives_it_first(
        http, reference_llm) -> None:
    for n in (0, 2):
        body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 1.0,
                "seed": 9, "logprobs": n, "return_tokens_as_token_ids": True,
                "return_token_ids": True, "ignore_eos": True}
        choice = _post(http, "/v1/completions", body)["choices"][0]
        ref = reference_llm.generate([[3, 4, 5]], SamplingParams(
            max_tokens=4, temperature=1.0, seed=9, logprobs=n, ignore_eos=True))[0]
        tops = choice["logprobs"]["top_logprobs"]
        assert choice["token_ids"] == ref.token_ids
        for top, token, lp, want in zip(tops, ref.token_ids, ref.logprobs,
                                        ref.top_logprobs or [{}] * 4, strict=True):
            keys = _ids(list(top))
            assert keys[0] == token and top[f"token_id:{token}"] == pytest.approx(lp, abs=1e-5)
            assert set(keys) == {token, *want} and len(keys) <= n + 1


def test_prompt_logprobs_come_in_vllms_shape(http, reference_llm) -> None:
    prompt = [7, 8, 9, 10, 11]
    choice = _post(http, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                             "temperature": 0.0, "prompt_logprobs": 3}
                   )["choices"][0]
    ref = reference_llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                                          prompt_logprobs=3))[0]
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    for p in range(1, len(prompt)):
        entry = scored[p]
        assert entry[str(prompt[p])]["logprob"] == pytest.approx(ref.prompt_logprobs[p], abs=1e-5)
        rank = entry[str(prompt[p])]["rank"]
        assert rank == ref.prompt_ranks[p] >= 1
        # the rank counts the likelier tokens: those among the top-N are all counted
        likelier = sum(v > ref.prompt_logprobs[p] for v in ref.prompt_top_logprobs[p].values())
        assert rank == 1 + likelier or rank > len(ref.prompt_top_logprobs[p])
        top = sorted(((v["rank"], int(k), v["logprob"]) for k, v in entry.items()
                      if int(k) in ref.prompt_top_logprobs[p]))
        assert [t for _, t, _ in top] == list(ref.prompt_top_logprobs[p])  # ranks 1..N
        assert [r for r, _, _ in top] == [1, 2, 3]


def test_truncate_prompt_tokens_keeps_the_prompts_tail(http, reference_llm) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3, "temperature": 0.0,
            "truncate_prompt_tokens": 2, "return_token_ids": True}
    choice = _post(http, "/v1/completions", body)["choices"][0]
    ref = reference_llm.generate([[5, 6]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert choice["prompt_token_ids"] == [5, 6] and choice["token_ids"] == ref.token_ids


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a town",
    "parameters": {"type": "object", "properties": {"town": {"type": "string"}}}}}]
#: an agent's turn: a tool call with null content, the tool's answer, the next question
HISTORY = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in the town?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call-1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"town\": \"river\"}"}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "rain"},
    {"role": "user", "content": "and tomorrow?"},
]


def test_chat_with_tools_renders_as_transformers_and_generates_as_llm(
        http, server, reference_llm, serve_home) -> None:
    answer = _post(http, "/v1/chat/completions", {
        "model": MODEL, "messages": HISTORY, "tools": TOOLS, "tool_choice": "none",
        "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 4,
        "temperature": 0.0, "return_token_ids": True, "logprobs": True, "top_logprobs": 0,
        "return_tokens_as_token_ids": True})
    hf = AutoTokenizer.from_pretrained(str(serve_home / "models" / MODEL))
    history = json.loads(json.dumps(HISTORY))
    history[2]["tool_calls"][0]["function"]["arguments"] = {"town": "river"}
    text = hf.apply_chat_template(history, tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True, enable_thinking=False)
    assert "<think>" in text and "get_weather" in text and "rain" in text
    assert answer["prompt_token_ids"] == hf.encode(text, add_special_tokens=False)
    ref = reference_llm.generate([answer["prompt_token_ids"]],
                                 SamplingParams(max_tokens=4, temperature=0.0))[0]
    (choice,) = answer["choices"]
    assert choice["token_ids"] == ref.token_ids
    assert _ids([e["token"] for e in choice["logprobs"]["content"]]) == ref.token_ids


@pytest.mark.parametrize(("extra", "param", "words"), [
    # OpenAI's default with tools is "auto", which (as in vLLM) needs the parser flags
    ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages.0", "image_url"),
])
def test_chat_features_that_need_a_parser_or_images_are_a_400_naming_them(
        http, extra, param, words) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2} | extra
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert words in response.json()["error"]["message"]


def test_tokenize_and_detokenize_round_trip_and_chat_tokenizes_as_the_chat_route(http) -> None:
    tokens = _post(http, "/tokenize", {"model": MODEL, "prompt": "the little engine",
                                       "return_token_strs": True})
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 0
    assert tokens["max_model_len"] > 0
    assert _post(http, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]}) == {
        "prompt": "the little engine"}
    chat = _post(http, "/tokenize", {"model": MODEL, "messages": HISTORY, "tools": TOOLS,
                                     "chat_template_kwargs": {"enable_thinking": False}})
    answer = _post(http, "/v1/chat/completions", {
        "model": MODEL, "messages": HISTORY, "tools": TOOLS, "tool_choice": "none",
        "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 1,
        "return_token_ids": True})
    assert chat["tokens"] == answer["prompt_token_ids"]


def test_world_size_and_vllm_config(http) -> None:
    assert http.get("/get_world_size").json() == {"world_size": 1}
    config = http.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert config["parallel_config"]["world_size"] == 1
    assert config["model_config"]["dtype"] in ("float32", "bfloat16", "float16")
    assert config["model_config"]["max_model_len"] > 0
    assert isinstance(http.get("/server_info").json()["vllm_config"], str)


def test_without_weight_transfer_config_the_transfer_routes_name_the_flag(http) -> None:
    config = http.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert config["weight_transfer_config"] is None  # TRL's init_communicator stops here
    for route in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                  "/finish_weight_update"):
        r = http.post(route, json={})
        assert r.status_code == 400 and "--weight-transfer-config" in r.text, (route, r.text)


def test_tokens_in_tokens_out_generate_equals_llm_generate(http, reference_llm) -> None:
    body = {"model": MODEL, "token_ids": [5, 6, 7], "request_id": "trl-1",
            "sampling_params": {"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 4,
                                "logprobs": 0, "repetition_penalty": 1.0, "top_k": 0,
                                "min_p": 0.0, "output_kind": 2}}
    answer = _post(http, "/inference/v1/generate", body)
    refs = reference_llm.generate([[5, 6, 7]], SamplingParams(
        n=2, temperature=1.0, seed=5, max_tokens=4, logprobs=0))
    assert answer["request_id"] == "trl-1"
    assert [c["token_ids"] for c in answer["choices"]] == [r.token_ids for r in refs]
    for choice, ref in zip(answer["choices"], refs, strict=True):
        content = choice["logprobs"]["content"]
        assert _ids([e["token"] for e in content]) == ref.token_ids
        assert [e["logprob"] for e in content] == pytest.approx(ref.logprobs, abs=1e-5)
        assert all(_ids([t["token"] for t in e["top_logprobs"]]) == [t]
                   for e, t in zip(content, ref.token_ids, strict=True))
    streamed = []
    with http.stream("POST", "/inference/v1/generate",
                     json=body | {"stream": True, "request_id": "trl-2"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    streamed.append((choice["index"], choice["token_ids"]))
    assert [sum((ids for i, ids in streamed if i == k), []) for k in (0, 1)] == [
        r.token_ids for r in refs]


def test_tokens_in_generate_takes_a_bridged_turns_routed_experts_prompt_start(
        http, reference_llm) -> None:
    sampling = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    body = {"model": MODEL, "token_ids": [5, 17, 42, 9], "sampling_params": sampling}
    bridged = _post(http, "/inference/v1/generate", body | {
        "sampling_params": sampling | {"routed_experts_prompt_start": 3}})
    ref = reference_llm.generate([[5, 17, 42, 9]], SamplingParams(**sampling))[0]
    assert bridged["choices"][0]["token_ids"] == ref.token_ids
    response = http.post("/inference/v1/generate", json=body | {
        "sampling_params": sampling | {"routed_experts_prompt_start": -1}})
    assert response.status_code == 400, response.text
    assert "routed_experts_prompt_start" in response.json()["error"]["param"]


def test_tokens_in_generate_refuses_features_and_content_parts_by_name(http) -> None:
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}
    for field, value in (("features", {"mm_hashes": {"image": ["x"]}}),
                         ("content_parts", [{"type": "image_url", "url": "data:,"}])):
        response = http.post("/inference/v1/generate", json=body | {
            field: value, "return_token_ids": True})
        assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_tokens_in_generate_answers_the_prompts_ids_when_asked(http) -> None:
    body = {"model": MODEL, "token_ids": [5, 17, 42, 9],
            "sampling_params": {"max_tokens": 3, "truncate_prompt_tokens": 3}}
    assert "prompt_token_ids" not in _post(http, "/inference/v1/generate", body)
    asked = _post(http, "/inference/v1/generate", body | {"return_token_ids": True,
                                                         "content_parts": []})
    assert asked["prompt_token_ids"] == [17, 42, 9]
    with http.stream("POST", "/inference/v1/generate", json=body | {
            "return_token_ids": True, "stream": True}) as response:
        chunks = sse_payloads(list(response.iter_lines()))
    assert chunks[0]["prompt_token_ids"] == [17, 42, 9]
    assert all("prompt_token_ids" not in c for c in chunks[1:])


def test_sglang_generate_takes_arealls_empty_image_data_and_refuses_real_images(http) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
            "image_data": [], "lora_path": None, "return_logprob": True}
    assert len(_post(http, "/generate", body)["output_ids"]) == 2
    response = http.post("/generate", json=body | {"image_data": ["data:image/png;base64,AA"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "image_data"


@pytest.mark.parametrize(("port", "taken"), [(29500, 29500), ("29500", 29500), (" 8000", 8000)])
def test_a_weight_group_port_is_an_int_or_its_decimal_text_as_sglang_takes_it(
        port, taken) -> None:
    from kvrunner.serve.weight_routes import InitWeightsUpdateGroupRequest

    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2}
    assert InitWeightsUpdateGroupRequest.model_validate(body).master_port == taken


@pytest.mark.parametrize("port", ["port", "70000", 0, 2.5, True])
def test_a_weight_group_port_that_is_no_port_is_refused(port) -> None:
    from pydantic import ValidationError

    from kvrunner.serve.weight_routes import InitWeightsUpdateGroupRequest

    with pytest.raises(ValidationError, match="master_port"):
        InitWeightsUpdateGroupRequest.model_validate(
            {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
             "world_size": 2})
