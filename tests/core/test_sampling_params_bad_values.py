"""Every ``SamplingParams`` field refuses bad values with a RequestError naming it.

The fields are discovered from the class, so a field added without a bad-value
strategy here fails with "add a bad-value strategy for SamplingParams.X". Each
strategy draws values a caller could pass by mistake (the wrong type, out of
range); each must be refused by ``SamplingParams(...)`` itself, or, for a limit
only the engine knows (the vocabulary, ``max_logprobs``, the tokenizer), by
``generate`` before anything is queued: never by a traceback from deeper code.
"""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner import LLM, KvrunnerError, RequestError, SamplingParams

ENGINE = dict(max_num_seqs=2, max_model_len=64, num_blocks=16, enforce_eager=True)

FIELDS = [f.name for f in attrs.fields(SamplingParams)]

# Values of the wrong type, by the kind of field. None is absent where it means
# "not set" (seed, logprobs) or "none" (stop, stop_token_ids).
odd_objects = st.sampled_from([[1], (1,), {"a": 1}, {1}, b"1", object(), 1j])
not_a_number = st.sampled_from(["1", "", "nan", True, False]) | odd_objects
not_an_int = not_a_number | st.floats(allow_nan=True, allow_infinity=True) | st.none()
not_an_optional_int = not_an_int.filter(lambda v: v is not None)
not_a_float = not_a_number | st.sampled_from([math.nan, math.inf, -math.inf]) | st.none()
not_a_bool = st.sampled_from([0, 1, "true", "", [True], 1.0, None])
not_a_list = st.integers() | st.floats() | st.sampled_from([b"12", {1: 2}, True, object()])


def list_with(bad: st.SearchStrategy) -> st.SearchStrategy:
    """A list holding at least one bad entry among good ones."""
    return st.tuples(st.lists(st.integers(0, 9), max_size=2), bad).map(
        lambda parts: [*parts[0], parts[1]])


#: how each field is refused when SamplingParams is built
BAD: dict[str, st.SearchStrategy] = {
    "max_tokens": not_an_int | st.integers(max_value=0),
    "temperature": not_a_float | st.floats(max_value=0, exclude_max=True, allow_nan=False,
                                           allow_infinity=False),
    "top_k": not_an_int,
    "top_p": not_a_float | st.floats(max_value=0, allow_nan=False)
    | st.floats(min_value=1, exclude_min=True, allow_nan=False),
    "seed": not_an_optional_int,
    "ignore_eos": not_a_bool,
    "stop_token_ids": not_a_list | st.text(max_size=3)
    | list_with(st.integers(max_value=-1) | st.floats() | st.text(max_size=2) | st.booleans()),
    "logprobs": not_an_optional_int | st.integers(max_value=-1),
    "prompt_logprobs": not_an_optional_int | st.integers(max_value=-1),
    "n": not_an_int | st.integers(max_value=0),
    "stop": not_a_list | st.just("") | st.lists(
        st.one_of(st.just(""), st.integers(), st.none(), st.binary(max_size=2)),
        min_size=1, max_size=3) | st.tuples(st.text(min_size=1), st.just("")).map(list),
    "presence_penalty": not_a_float | st.floats(min_value=2, exclude_min=True, allow_nan=False)
    | st.floats(max_value=-2, exclude_max=True, allow_nan=False),
    "frequency_penalty": not_a_float | st.floats(min_value=2, exclude_min=True,
                                                 allow_nan=False),
    "repetition_penalty": not_a_float | st.floats(max_value=0, allow_nan=False),
    "min_p": not_a_float | st.floats(min_value=1, exclude_min=True, allow_nan=False)
    | st.floats(max_value=0, exclude_max=True, allow_nan=False),
    "min_tokens": not_an_int | st.integers(max_value=-1) | st.integers(17, 1 << 40),
    "logit_bias": st.integers() | st.text(max_size=2) | st.sampled_from([True, 1.5, b"1"])
    | st.dictionaries(st.integers(max_value=-1) | st.text(max_size=2) | st.floats(),
                      st.floats(-5, 5), min_size=1, max_size=2)
    | st.dictionaries(st.integers(0, 9), st.sampled_from([math.nan, math.inf, "1", None]),
                      min_size=1, max_size=2),
    "allowed_token_ids": not_a_list | st.text(max_size=3) | st.just([])
    | list_with(st.integers(max_value=-1) | st.floats() | st.text(max_size=2) | st.booleans()),
    "bad_words": not_a_list | st.lists(st.sampled_from(["", " ", 3, None]), min_size=1,
                                       max_size=2),
    "include_stop_str_in_output": not_a_bool,
    "skip_special_tokens": not_a_bool,
    "spaces_between_special_tokens": not_a_bool,
    "return_routed_experts": not_a_bool,
    "return_kept_mass": not_a_bool,
    "penalty_rules": st.sampled_from(["VLLM", "", "hf", None, 1, True]) | odd_objects,
    "structured_outputs": st.sampled_from([1, "x", [1], True, 1.5, b"{}"])
    | st.sampled_from([{}, {"nope": 1}, {"json_object": False}, {"json": "{"}, {"json": 3},
                       {"regex": "a", "choice": ["b"]}, {"choice": []}, {"choice": "ab"},
                       {"choice": ["a", 2]}, {"regex": ""}, {"grammar": 5},
                       {"json_object": 1}, {"json_object": True, "disable_any_whitespace": 0}]),
    # a bad type or range, or any id without structured_outputs to start
    "reasoning_end_token_id": not_an_optional_int | st.integers(max_value=-1)
    | st.integers(0, 1 << 40),
}

#: values SamplingParams accepts that the engine refuses at admission (it knows the
#: vocabulary, max_logprobs and whether there is a tokenizer), with the LLM's settings
AT_ADMISSION: dict[str, tuple[st.SearchStrategy, dict]] = {
    "stop_token_ids": (st.lists(st.integers(min_value=512, max_value=1 << 40), min_size=1,
                                max_size=3), {}),
    "logprobs": (st.integers(min_value=21, max_value=1 << 40), {}),
    "prompt_logprobs": (st.integers(min_value=21, max_value=1 << 40), {}),
    "stop": (st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=2),
             {"skip_tokenizer_init": True}),
    "logit_bias": (st.dictionaries(st.integers(min_value=512, max_value=1 << 40),
                                   st.floats(-5, 5), min_size=1, max_size=2), {}),
    "allowed_token_ids": (st.lists(st.integers(min_value=512, max_value=1 << 40), min_size=1,
                                   max_size=3), {}),
    "bad_words": (st.lists(st.text(min_size=1, max_size=4).filter(str.strip), min_size=1,
                           max_size=2), {"skip_tokenizer_init": True}),
    # an engine started without enable_return_routed_experts records no route
    "return_routed_experts": (st.just(True), {}),
    # a constraint the grammar parser refuses (only xgrammar reads it)
    "structured_outputs": (st.sampled_from([{"regex": "a(b"}, {"json": '{"type": "nope"}'},
                                            {"grammar": "root ::= undefined_rule"}]), {}),
}


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_refuses_bad_values_naming_it(name: str) -> None:
    if name not in BAD:
        pytest.fail(f"add a bad-value strategy for SamplingParams.{name}")

    @settings(max_examples=40)
    @given(bad=BAD[name])
    def refused(bad: object) -> None:
        with pytest.raises(RequestError) as e:
            SamplingParams(**{name: bad})
        assert f"SamplingParams.{name}" in str(e.value), f"{name}={bad!r}: {e.value}"

    refused()


@pytest.mark.parametrize("name", sorted(AT_ADMISSION))
def test_limits_only_the_engine_knows_are_refused_at_admission(name: str) -> None:
    strategy, extra = AT_ADMISSION[name]
    with LLM("tiny-qwen3", **ENGINE, **extra) as llm:
        assert llm.engine.vocab_size <= 512  # the strategy's ids are past it

        @settings(max_examples=15, deadline=None)
        @given(bad=strategy)
        def refused(bad: object) -> None:
            params = SamplingParams(max_tokens=2, **{name: bad})  # accepted when built
            with pytest.raises(KvrunnerError) as e:
                llm.generate([[1, 2], [3]], [SamplingParams(max_tokens=2), params])
            message = str(e.value)
            assert isinstance(e.value, RequestError) and "request 1" in message
            assert f"SamplingParams.{name}" in message, f"{name}={bad!r}: {message}"
            assert not llm.engine.has_unfinished()  # nothing of the call was queued

        refused()


def test_every_strategy_belongs_to_a_field() -> None:
    """A strategy left for a field that no longer exists is dead: remove it."""
    assert set(BAD) <= set(FIELDS) and set(AT_ADMISSION) <= set(FIELDS)


@pytest.mark.parametrize("value", [None, (), [], iter([])])
def test_none_and_empty_mean_no_stops(value) -> None:
    params = SamplingParams(stop=value, stop_token_ids=value)
    assert params.stop == () and params.stop_token_ids == ()
