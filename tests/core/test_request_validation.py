"""Bad sampling settings and prompts are refused with RequestError naming the field or
request, before anything is queued; good ones are honoured exactly."""

from __future__ import annotations

import math
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import LLM, ConcurrentUseError, RequestError, SamplingParams
from kvrunner.prompts import normalize_requests, prompt_token_ids

ENGINE = dict(max_num_seqs=2, max_model_len=64, num_blocks=16, enforce_eager=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", **ENGINE) as llm:
        yield llm


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"top_p": math.nan}, "top_p must be a finite number"),
        ({"top_p": -math.inf}, "top_p must be a finite number"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5 (float)"),
        ({"max_tokens": "5"}, "max_tokens must be an integer, got '5' (str)"),
        ({"max_tokens": True}, "max_tokens must be an integer, got True (bool)"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"ignore_eos": "no"}, "ignore_eos must be True or False"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids must hold non-negative integers"),
        ({"stop_token_ids": 3}, "stop_token_ids must be a list"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
    ],
)
def test_bad_sampling_values_are_refused_naming_the_field(kwargs, named) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert named in str(info.value)
    assert isinstance(info.value, ValueError)  # what callers caught before


@pytest.mark.parametrize(
    ("prompt", "named"),
    [
        ([1.7, 2.2], "position 0 holds 1.7 (float)"),
        ([[1, 2], [3, 4.0]], "request 1: token ids must be integers; position 1 holds 4.0"),
        ([[1, True]], "position 1 holds True (bool)"),
        ([["1", "2"]], "position 0 holds '1' (str)"),
        ([None], "request 0: a prompt must be text or a list of token ids, got NoneType"),
        (7, "prompts must be a string, a list of token ids"),
    ],
)
def test_bad_prompts_are_refused_not_truncated(llm, prompt, named) -> None:
    with pytest.raises(RequestError) as info:
        llm.generate(prompt, SamplingParams(max_tokens=1))
    assert named in str(info.value)
    assert not llm.engine.has_unfinished()


def test_numpy_and_tensor_prompts_of_integers_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    prompts, _ = normalize_requests([np.array([1, 2]), torch.tensor([3, 4])], None)
    assert [prompt_token_ids(p, i, None) for i, p in enumerate(prompts)] == [[1, 2], [3, 4]]
    with pytest.raises(RequestError, match="position 0 holds 1.5"):
        prompt_token_ids(normalize_requests(torch.tensor([1.5]), None)[0][0], 0, None)


def test_a_full_pool_names_the_request_once_and_says_what_to_do() -> None:
    with LLM("tiny-qwen3", max_num_seqs=2, max_model_len=64, num_blocks=1,
             enforce_eager=True) as small, pytest.raises(RequestError) as info:
        small.generate([[1, 2, 3]], SamplingParams(max_tokens=40))
    message = str(info.value)
    assert message.count("request 0") == 1 and "raise num_blocks" in message


def test_a_second_thread_calling_generate_is_refused_clearly(llm) -> None:
    inside, release = threading.Event(), threading.Event()
    step = llm.engine.step

    def slow_step():
        inside.set()
        release.wait(30)
        return step()

    llm.engine.step = slow_step
    results: list = []
    worker = threading.Thread(
        target=lambda: results.append(llm.generate([[1, 2]], SamplingParams(max_tokens=2)))
    )
    try:
        worker.start()
        assert inside.wait(30)
        with pytest.raises(ConcurrentUseError, match="not thread-safe"):
            llm.generate([[3, 4]], SamplingParams(max_tokens=2))
    finally:
        release.set()
        worker.join(30)
        del llm.engine.step
    assert len(results[0][0].token_ids) == 2  # the first call was not disturbed
    assert len(llm.generate([[3, 4]], SamplingParams(max_tokens=2))[0].token_ids) == 2


#: values of every kind a caller might pass by mistake, and good ones
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3), st.lists(st.integers(0, 5), max_size=2),
)


@given(
    max_tokens=ANY_VALUE, temperature=ANY_VALUE, top_p=ANY_VALUE, top_k=ANY_VALUE,
    prompt=st.one_of(
        st.lists(st.integers(-2, 500), min_size=0, max_size=6),
        st.lists(st.floats(0, 10), min_size=1, max_size=3),
        st.lists(st.one_of(st.integers(0, 9), st.booleans(), st.text(max_size=1)), max_size=3),
    ),
)
def test_anything_is_either_honoured_or_refused_with_request_error(
    llm, max_tokens, temperature, top_p, top_k, prompt
) -> None:
    """Never a silent wrong answer, never an unexpected exception type."""
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, ignore_eos=True)
    except RequestError:
        return  # refused before any request exists
    # Accepted: every value is exactly what was asked for, of the right type.
    assert type(params.max_tokens) is int and params.max_tokens == max_tokens >= 1
    assert math.isfinite(params.temperature) and params.temperature == temperature >= 0
    assert 0 < params.top_p <= 1 and type(params.top_k) is int
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=min(params.max_tokens, 3),
                                                    temperature=0.0, ignore_eos=True))[0]
    except RequestError:
        assert not llm.engine.has_unfinished()
        return
    assert out.prompt_token_ids == prompt  # exactly the ids given, nothing rounded
    assert len(out.token_ids) == min(params.max_tokens, 3)


def test_a_stop_token_id_beyond_the_vocabulary_is_refused_naming_the_request(llm) -> None:
    vocab = llm.engine.vocab_size
    with pytest.raises(RequestError) as info:
        llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=2),
                                        SamplingParams(max_tokens=2, stop_token_ids=[5, vocab])])
    assert (f"request 1: SamplingParams.stop_token_ids [{vocab}] outside the vocabulary "
            f"[0, {vocab})") in str(info.value)
    # nothing was queued: the engine still serves the same call without the bad id
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_logprobs_above_max_logprobs_is_refused_naming_both(llm) -> None:
    assert llm.config.scheduler.max_logprobs == 20  # vLLM's default
    with pytest.raises(RequestError, match=r"request 1: SamplingParams.logprobs=21 exceeds "
                       r"max_logprobs=20"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=1),
                                         SamplingParams(max_tokens=1, logprobs=21)])
    assert not llm.engine.has_unfinished()  # nothing of the call was queued
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=20))[0]
    assert [len(top) for top in out.top_logprobs] == [20, 20]


def test_max_logprobs_raises_the_cap() -> None:
    with LLM("tiny-qwen3", max_logprobs=40, **ENGINE) as wide:
        out = wide.generate([[1, 2]], SamplingParams(max_tokens=1, logprobs=40))[0]
        assert len(out.top_logprobs[0]) == 40
        with pytest.raises(RequestError, match="logprobs=41 exceeds max_logprobs=40"):
            wide.generate([[1, 2]], SamplingParams(max_tokens=1, logprobs=41))
