"""Prompt logprobs on SGLang's ``/generate``, as slime and AReaL read them: with
``return_logprob``, ``meta_info["input_token_logprobs"]`` holds a ``[logprob, token id,
text or null]`` triple per prompt position from ``logprob_start_len`` on (the first
with a null logprob), ``input_top_logprobs`` the top-N there, beside the output's;
``max_new_tokens: 0`` scores without generating. Against a live ``kvrunner serve``: the
values are the in-process ``LLM``'s ``prompt_logprobs`` bit for bit, and under
``--deterministic`` scoring prompt + response reproduces the logprobs generation
returned for the response, bit for bit (old-policy logprobs)."""

from __future__ import annotations

import asyncio

import pytest
from serve_kit import ENGINE_KWARGS, ServeProcess, stream_events

from kvrunner import LLM, SamplingParams

PROMPT = [5, 17, 29, 101, 55, 66, 77, 88, 9, 40, 41]
TOP = 2
GREEDY = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}


def _generate(client, body: dict) -> dict:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _scored(start: int, sampling: dict = GREEDY, **extra: object) -> dict:
    return {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True,
            "logprob_start_len": start} | extra


@pytest.fixture(scope="module")
def client(server: ServeProcess):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def whole(client) -> dict:
    """The server's scores of every PROMPT position (``logprob_start_len`` 0), top-2."""
    return _generate(client, _scored(0, top_logprobs_num=TOP))["meta_info"]


def test_input_token_logprobs_are_the_in_process_prompt_logprobs(whole, reference_llm
                                                                 ) -> None:
    ref = reference_llm.generate([PROMPT], SamplingParams(
        max_tokens=3, temperature=0.0, logprobs=TOP, prompt_logprobs=TOP,
        ignore_eos=True))[0]
    got = whole["input_token_logprobs"]
    assert [t for _, t, _ in got] == PROMPT
    assert got[0][0] is None and whole["input_top_logprobs"][0] is None
    # another process's CPU products (bitwise under --deterministic: see below)
    assert [lp for lp, _, _ in got[1:]] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-5)
    for top, want in zip(whole["input_top_logprobs"][1:], ref.prompt_top_logprobs[1:],
                         strict=True):
        assert [t for _, t, _ in top] == list(want)
        assert [lp for lp, _, _ in top] == pytest.approx(list(want.values()), abs=1e-5)
    assert [t for _, t, _ in whole["output_token_logprobs"]] == ref.token_ids


@pytest.mark.parametrize("start", [1, 4, len(PROMPT) - 2, len(PROMPT) - 1, -1, None])
def test_logprob_start_len_picks_the_first_returned_prompt_position(client, whole,
                                                                    start) -> None:
    meta = _generate(client, _scored(start, top_logprobs_num=TOP))["meta_info"]
    # SGLang's -1 (and null, its default): the last prompt token
    first = len(PROMPT) - 1 if start in (-1, None) else start
    got = meta["input_token_logprobs"]
    # one entry per position from ``first`` on; the one at ``first`` has no logprob, the
    # others are the whole prompt's scores there
    assert [t for _, t, _ in got] == PROMPT[first:]
    assert got == [[None, PROMPT[first], None], *whole["input_token_logprobs"][first + 1:]]
    assert meta["input_top_logprobs"] == [None, *whole["input_top_logprobs"][first + 1:]]
    assert meta["output_token_logprobs"] == whole["output_token_logprobs"]


def test_without_return_logprob_nothing_is_reported_and_the_start_is_ignored(client
                                                                            ) -> None:
    for start in (0, len(PROMPT) + 5):  # as in SGLang, unchecked without return_logprob
        meta = _generate(client, {"input_ids": PROMPT, "sampling_params": GREEDY,
                                  "logprob_start_len": start})["meta_info"]
        assert not {k for k in meta if "logprobs" in k}


def test_return_text_in_logprobs_puts_each_tokens_text_third(client, reference_llm) -> None:
    meta = _generate(client, _scored(2, return_text_in_logprobs=True))["meta_info"]
    decode = reference_llm.tokenizer.decode
    assert [text for _, _, text in meta["input_token_logprobs"]] == [
        decode([t], skip_special_tokens=True) for t in PROMPT[2:]]
    assert "input_top_logprobs" not in meta  # no top_logprobs_num


def test_max_new_tokens_0_scores_the_prompt_and_generates_nothing(client, whole) -> None:
    sampling = {"max_new_tokens": 0, "temperature": 1.0}
    answer = _generate(client, _scored(0, sampling, top_logprobs_num=TOP))
    meta = answer["meta_info"]
    assert answer["output_ids"] == [] and answer["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == len(PROMPT)
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
    assert meta["input_token_logprobs"] == whole["input_token_logprobs"]
    assert meta["input_top_logprobs"] == whole["input_top_logprobs"]
    # SGLang's default start for a score-only request is past the prompt: nothing
    for start in (-1, len(PROMPT)):
        meta = _generate(client, _scored(start, sampling))["meta_info"]
        assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs"] == []


@pytest.mark.parametrize("max_new_tokens", [3, 0])
def test_a_stream_carries_the_input_logprobs_from_its_first_event(server, max_new_tokens
                                                                  ) -> None:
    sampling = GREEDY | {"max_new_tokens": max_new_tokens}
    body = _scored(1, sampling, top_logprobs_num=TOP)
    with server.client() as c:
        whole = _generate(c, body)["meta_info"]

    async def go() -> list[dict]:
        async with server.async_client() as c:
            return await stream_events(c, "/generate", body)

    events = asyncio.run(go())
    assert len(events) == max(1, max_new_tokens)
    for event in events:  # SGLang's events are cumulative: each has the whole prompt's
        assert event["meta_info"]["input_token_logprobs"] == whole["input_token_logprobs"]
        assert event["meta_info"]["input_top_logprobs"] == whole["input_top_logprobs"]
    assert events[-1]["output_ids"] == [t for _, t, _ in whole["output_token_logprobs"]]
    assert events[-1]["meta_info"]["output_token_logprobs"] == whole["output_token_logprobs"]


@pytest.mark.parametrize(("start", "sampling"), [
    (len(PROMPT), GREEDY),  # generating: the last prompt token is the last start
    (len(PROMPT) + 1, {"max_new_tokens": 0}),  # scoring: one past the end at most
    (-2, GREEDY),
    ("0", GREEDY),
    (1.5, GREEDY),
    (True, GREEDY),
], ids=["past-the-last-token", "past-the-end-score-only", "negative", "string", "float",
        "bool"])
def test_a_bad_logprob_start_len_is_a_400_naming_it(client, start, sampling) -> None:
    response = client.post("/generate", json=_scored(start, sampling))  # type: ignore[arg-type]
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logprob_start_len"


# ---------------------------------------------------------------------------
# deterministic mode: old-policy logprobs by scoring prompt + response
# ---------------------------------------------------------------------------

ROLLOUTS = [[3, 4, 5, 6, 7, 8], [90, 91, 92], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def test_input_token_logprobs_are_the_in_process_prompt_logprobs_bit_for_bit(
        deterministic_server) -> None:
    """Both engines deterministic: the products' bits do not depend on the process's
    threads or the batch, so the server's JSON floats are the in-process values."""
    llm = LLM(**ENGINE_KWARGS, deterministic=True)
    try:
        ref = llm.generate([PROMPT], SamplingParams(
            max_tokens=3, temperature=0.0, logprobs=TOP, prompt_logprobs=TOP,
            ignore_eos=True))[0]
    finally:
        llm.shutdown()
    with deterministic_server.client() as c:
        meta = _generate(c, _scored(0, top_logprobs_num=TOP))["meta_info"]
    assert meta["input_token_logprobs"] == [
        [lp, t, None] for lp, t in zip(ref.prompt_logprobs, PROMPT, strict=True)]
    assert meta["input_top_logprobs"] == [None, *(
        [[lp, t, None] for t, lp in top.items()] for top in ref.prompt_top_logprobs[1:])]
    assert meta["output_token_logprobs"] == [
        [lp, t, None] for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]


def slime_opd_payload(tokens: list[int]) -> dict:
    """What slime's on-policy distillation sends its teacher to score a sample."""
    return {"input_ids": tokens,
            "sampling_params": {"temperature": 0, "max_new_tokens": 0,
                                "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0}


def slime_opd_parse(answer: dict, response_length: int) -> list[float]:
    """How slime reads the teacher's answer: every entry's logprob after the first,
    the response's last ``response_length``."""
    logprobs = [item[0] for item in answer["meta_info"]["input_token_logprobs"][1:]]
    return logprobs[-response_length:]


def test_scoring_prompt_and_response_reproduces_generations_logprobs_bit_for_bit(
        deterministic_server) -> None:
    """The rollouts are generated side by side (seeded sampling), then scored side by
    side with ``max_new_tokens: 0`` (slime's payload, and from the last prompt token
    with the top-2), so every step's batch differs from the other's."""
    async def go() -> tuple[list[dict], list[dict], list[dict]]:
        async with deterministic_server.async_client() as c:
            async def post(body: dict) -> dict:
                response = await c.post("/generate", json=body)
                assert response.status_code == 200, response.text
                return response.json()

            rollouts = await asyncio.gather(*(post({
                "input_ids": p, "return_logprob": True, "top_logprobs_num": TOP,
                "sampling_params": {"max_new_tokens": 6 + k, "temperature": 0.9,
                                    "sampling_seed": 40 + k, "ignore_eos": True},
            }) for k, p in enumerate(ROLLOUTS)))
            tokens = [p + r["output_ids"] for p, r in zip(ROLLOUTS, rollouts, strict=True)]
            slime = await asyncio.gather(*(post(slime_opd_payload(t)) for t in tokens))
            scores = await asyncio.gather(*(post({
                "input_ids": t, "return_logprob": True, "top_logprobs_num": TOP,
                "logprob_start_len": len(p) - 1, "sampling_params": {"max_new_tokens": 0},
            }) for p, t in zip(ROLLOUTS, tokens, strict=True)))
            return rollouts, slime, scores

    rollouts, slime, scores = asyncio.run(go())
    for rollout, teacher, score in zip(rollouts, slime, scores, strict=True):
        out, scored = rollout["meta_info"], score["meta_info"]
        assert len(out["output_token_logprobs"]) == len(rollout["output_ids"]) >= 6
        assert slime_opd_parse(teacher, len(rollout["output_ids"])) == [
            lp for lp, _, _ in out["output_token_logprobs"]]
        # from the last prompt token: entry 0 (no logprob), then the response's tokens
        assert scored["input_token_logprobs"][1:] == out["output_token_logprobs"]
        assert scored["input_top_logprobs"][1:] == out["output_top_logprobs"]
