"""The official ``openai`` client against a live ``kvrunner serve``: its tokens and
logprobs are the in-process ``LLM.generate``'s for the same seed and prompt."""

from __future__ import annotations

import openai
import pytest
from serve_kit import API_KEY

from kvrunner import SamplingParams

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def _vllm_top(token: int, logprob: float, top: dict[int, float]) -> dict[int, float]:
    """vLLM's ``top_logprobs`` entry at a position: the token's own logprob first, then
    the top-N (the token once, where it is among them)."""
    return {token: logprob} | {t: v for t, v in top.items() if t != token}


def _keyed(entry: dict[str, float]) -> dict[int, float]:
    return {int(k.split(":")[1]): v for k, v in entry.items()}


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":", 1)[1]) for t in tokens]


@pytest.mark.parametrize("prompt", ["the cat sat on the", [5, 17, 42, 9]],
                         ids=["text", "token_ids"])
def test_completion_equals_in_process_generate(client, reference_llm, prompt) -> None:
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0.8, seed=11, logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    ref = reference_llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.8, seed=11, logprobs=2,
                                 ignore_eos=True))[0]
    (choice,) = response.choices
    assert _ids(choice.logprobs.tokens) == ref.token_ids
    assert choice.text == ref.text
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    for got, token, lp, want in zip(choice.logprobs.top_logprobs, ref.token_ids, ref.logprobs,
                                    ref.top_logprobs, strict=True):
        assert list(_keyed(got)) == list(_vllm_top(token, lp, want))  # the token first
        assert _keyed(got) == pytest.approx(_vllm_top(token, lp, want), abs=1e-5)
    assert choice.finish_reason == ref.finish_reason == "length"
    assert response.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert response.usage.completion_tokens == len(ref.token_ids) == 6
    assert response.model == MODEL


def test_streaming_gives_the_same_tokens_as_one_response(client) -> None:
    kwargs = dict(model=MODEL, prompt="once upon a time", max_tokens=8, temperature=1.0,
                  seed=3, logprobs=0,
                  extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    pieces = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in pieces) == whole.text
    streamed = [t for c in pieces for t in (c.choices[0].logprobs.tokens
                                            if c.choices[0].logprobs else [])]
    assert _ids(streamed) == _ids(whole.logprobs.tokens)
    streamed_lp = [x for c in pieces for x in (c.choices[0].logprobs.token_logprobs
                                               if c.choices[0].logprobs else [])]
    assert streamed_lp == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    assert [c.choices[0].finish_reason for c in pieces][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


@pytest.mark.parametrize("prompts", [["a b c", "the dog"], [[3, 4, 5], [9, 8]]],
                         ids=["texts", "token_id_lists"])
def test_a_batch_of_prompts_answers_in_order(client, reference_llm, prompts) -> None:
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    refs = reference_llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0,
                                                          ignore_eos=True))
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [r.text for r in refs]


def test_models_lists_the_served_model(client) -> None:
    (card,) = client.models.list().data
    assert card.id == MODEL
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_the_embedded_model_chats_out_of_the_box(client, reference_llm) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0.0, extra_body={"return_token_ids": True})
    prompt = response.model_extra["prompt_token_ids"]
    text = reference_llm.tokenizer.decode(prompt, skip_special_tokens=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ref = reference_llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert response.choices[0].message.content == ref.text


def test_a_wrong_model_name_is_404_naming_model(client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert caught.value.body["param"] == "model"


def test_echo_puts_the_prompt_and_its_logprobs_in_front(client, reference_llm) -> None:
    prompt = "the cat sat on the"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0, logprobs=2, echo=True,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    ref = reference_llm.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2,
                                 prompt_logprobs=2, ignore_eos=True))[0]
    (choice,) = response.choices
    n = len(ref.prompt_token_ids)
    assert choice.text == reference_llm.tokenizer.decode(
        ref.prompt_token_ids, skip_special_tokens=False) + ref.text
    assert _ids(choice.logprobs.tokens) == list(ref.prompt_token_ids) + ref.token_ids
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:n] == pytest.approx(ref.prompt_logprobs[1:],
                                                                abs=1e-5)
    assert choice.logprobs.token_logprobs[n:] == pytest.approx(ref.logprobs, abs=1e-5)
    tops = choice.logprobs.top_logprobs
    assert tops[0] is None and len(tops) == n + 4
    for got, token, lp, want in zip(tops[1:n], ref.prompt_token_ids[1:], ref.prompt_logprobs[1:],
                                    ref.prompt_top_logprobs[1:], strict=True):
        assert _keyed(got) == pytest.approx(_vllm_top(token, lp, want), abs=1e-5)
    assert response.usage.completion_tokens == 4


def test_echo_with_stream_is_refused_naming_echo(client) -> None:
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt="a b", max_tokens=2, echo=True,
                                  stream=True)
