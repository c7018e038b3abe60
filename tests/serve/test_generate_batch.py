"""SGLang's batch form of ``/generate``: ``input_ids`` a list of token-id lists (or
``text`` a list of strings), each per-request field one value for all or a list of one
per prompt. The answer is a list, prompt-major then sample, and on a ``--deterministic``
server each of its entries is what that prompt alone gets, bit for bit: tokens, text and
logprobs, prompt logprobs included."""

from __future__ import annotations

import asyncio

import pytest
from serve_kit import stream_events

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
SAMPLING = [{"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
            {"max_new_tokens": 6, "temperature": 0.8, "sampling_seed": 3, "ignore_eos": True},
            {"max_new_tokens": 5, "temperature": 0.8, "sampling_seed": 9, "ignore_eos": True}]
STARTS = [0, -1, 2]


def _without_timing(answer: dict) -> dict:
    meta = {k: v for k, v in answer["meta_info"].items() if k not in ("e2e_latency", "id")}
    return answer | {"meta_info": meta}


@pytest.fixture(scope="module")
def client(deterministic_server):
    with deterministic_server.client() as c:
        yield c


def _post(client, body: dict) -> object:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _alone(client, k: int, **extra: object) -> dict:
    return _post(client, {"input_ids": PROMPTS[k], "sampling_params": SAMPLING[k],
                          "return_logprob": True, "logprob_start_len": STARTS[k],
                          "top_logprobs_num": 2} | extra)


def test_a_batch_answers_each_prompt_as_it_is_answered_alone(client) -> None:
    rids = [f"batch-{k}" for k in range(3)]
    answers = _post(client, {"input_ids": PROMPTS, "sampling_params": SAMPLING,
                             "return_logprob": True, "logprob_start_len": STARTS,
                             "top_logprobs_num": 2, "rid": rids})
    assert [a["meta_info"]["id"] for a in answers] == rids
    for k, answer in enumerate(answers):
        assert _without_timing(answer) == _without_timing(_alone(client, k))
        assert len(answer["output_ids"]) == SAMPLING[k]["max_new_tokens"]


def test_one_value_of_a_per_prompt_field_holds_for_every_prompt(client) -> None:
    answers = _post(client, {"input_ids": PROMPTS, "sampling_params": SAMPLING[0],
                             "return_logprob": [True, False, True]})
    assert len(answers) == 3
    for k, answer in enumerate(answers):
        alone = _post(client, {"input_ids": PROMPTS[k], "sampling_params": SAMPLING[0],
                               "return_logprob": k != 1})
        assert _without_timing(answer) == _without_timing(alone)
    assert "output_token_logprobs" not in answers[1]["meta_info"]


def test_a_score_only_prompt_shares_a_batch_with_a_generating_one(client) -> None:
    body = {"input_ids": PROMPTS[:2], "return_logprob": True, "logprob_start_len": [-1, 0],
            "sampling_params": [SAMPLING[0], {"max_new_tokens": 0}]}
    generated, scored = _post(client, body)
    assert len(generated["output_ids"]) == 4 and scored["output_ids"] == []
    alone = _post(client, {"input_ids": PROMPTS[1], "return_logprob": True,
                           "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
    assert scored["meta_info"]["input_token_logprobs"] == alone["meta_info"][
        "input_token_logprobs"]
    assert len(scored["meta_info"]["input_token_logprobs"]) == len(PROMPTS[1])


def test_a_batch_of_texts_and_n_samples_answers_prompt_major(client, reference_llm) -> None:
    texts = ["the cat", "a dog sat on"]
    sampling = {"max_new_tokens": 3, "temperature": 0.9, "sampling_seed": 5, "n": 2,
                "ignore_eos": True}
    answers = _post(client, {"text": texts, "sampling_params": sampling,
                             "rid": ["t0", "t1"]})
    assert [a["meta_info"]["id"] for a in answers] == ["t0-0", "t0-1", "t1-0", "t1-1"]
    for i, text in enumerate(texts):
        group = _post(client, {"text": text, "sampling_params": sampling, "rid": f"t{i}"})
        assert [_without_timing(a) for a in answers[2 * i:2 * i + 2]] == [
            _without_timing(a) for a in group]
        n = len(reference_llm.tokenizer.encode(text).ids)
        assert answers[2 * i]["meta_info"]["prompt_tokens"] == n


def test_a_streamed_batch_tags_each_event_with_its_answers_index(deterministic_server,
                                                                client) -> None:
    body = {"input_ids": PROMPTS[:2], "sampling_params": SAMPLING[:2],
            "return_logprob": True, "logprob_start_len": STARTS[:2], "top_logprobs_num": 2}
    whole = _post(client, body)

    async def go() -> list[dict]:
        async with deterministic_server.async_client() as c:
            return await stream_events(c, "/generate", body)

    events = asyncio.run(go())
    last = {}
    for event in events:
        last[event.pop("index")] = event
    assert sorted(last) == [0, 1]
    for k in range(2):
        assert last[k]["output_ids"] == whole[k]["output_ids"]
        for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs",
                    "output_top_logprobs", "finish_reason"):
            assert last[k]["meta_info"][key] == whole[k]["meta_info"][key], key


@pytest.mark.parametrize(("body", "param"), [
    ({"input_ids": PROMPTS, "rid": "one-id"}, "rid"),
    ({"input_ids": PROMPTS, "rid": ["a", "b"]}, "rid"),
    ({"input_ids": PROMPTS, "sampling_params": SAMPLING[:2]}, "sampling_params"),
    ({"input_ids": PROMPTS, "sampling_params": [{"max_new_tokens": 2}, {"beam": 2},
                                                {}]}, "sampling_params.1.beam"),
    ({"input_ids": PROMPTS, "return_logprob": True, "logprob_start_len": [0, 3, 0]},
     "logprob_start_len"),
    ({"input_ids": PROMPTS, "top_logprobs_num": [1, 2]}, "top_logprobs_num"),
    ({"input_ids": [[1, 2], [3, 2.5]]}, "input_ids.1.1"),
    ({"input_ids": [[1, 2], [3, 10**9]]}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "input_ids.1"),
    ({"input_ids": [1, 2], "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params"),
    ({"input_ids": [1, 2], "logprob_start_len": [0]}, "logprob_start_len"),
], ids=["rid-not-a-list", "rid-too-short", "sampling-too-short", "unknown-field-in-one",
        "start-past-one-prompt", "tops-too-short", "float-token", "out-of-vocab",
        "empty-prompt", "list-for-one-prompt", "start-list-for-one-prompt"])
def test_a_bad_batch_is_a_400_naming_the_field(client, body, param) -> None:
    response = client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
