"""SGLang's ``/generate`` ``sampling_params`` extras, as SGLang documents them and as
slime and AReaL send them: each one the engine does reaches ``SamplingParams`` with
SGLang's meaning (``min_new_tokens`` is ``min_tokens``, ``no_stop_trim`` is
``include_stop_str_in_output``, ``logit_bias`` keys are token ids as text and not
clamped, the penalties and the bias follow SGLang's rules: ``penalty_rules="sglang"``,
the repetition penalty over the output's tokens alone); a neutral or null
value is always accepted; what kvrunner cannot do (a grammar, a stop regex, custom
logit-processor parameters) is a 400 naming the field. Against a live ``kvrunner
serve``, each answer is the in-process ``LLM.generate``'s with the mapped params.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import SamplingParams
from kvrunner.serve.generate_routes import sglang_extras
from kvrunner.serve.request_params import resolve
from kvrunner.serve.rl_protocol import SGLangSamplingParams

PROMPT = [5, 17, 42, 9, 5, 17]
#: every extra at its neutral value, and the same ones null (SGLang's default)
NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
           "min_p": 0.0, "min_new_tokens": 0, "logit_bias": {}, "no_stop_trim": False,
           "skip_special_tokens": True, "spaces_between_special_tokens": True,
           "stop_token_ids": [], "regex": None, "json_schema": None, "ebnf": None,
           "structural_tag": None, "stop_regex": None, "custom_params": None,
           "stream_interval": None}
NULLS = dict.fromkeys(NEUTRAL)
BASE = {"max_new_tokens": 24, "temperature": 0.0, "sampling_seed": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def _generate(http, sampling: dict, prompt: list[int] = PROMPT) -> dict:
    response = http.post("/generate", json={"input_ids": prompt, "sampling_params": sampling,
                                            "return_logprob": True})
    assert response.status_code == 200, response.text
    return response.json()


def _reference(reference_llm, prompt: list[int] = PROMPT, **params):
    fields = dict(max_tokens=24, temperature=0.0, seed=5, ignore_eos=True, logprobs=0,
                  penalty_rules="sglang") | params
    return reference_llm.generate([prompt], SamplingParams(**fields))[0]


def _same(answer: dict, ref) -> None:
    """The answer's tokens and output logprobs are the reference's."""
    assert answer["output_ids"] == ref.token_ids
    logprobs = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(ref.logprobs, abs=1e-5)


@pytest.mark.parametrize("extras", [NEUTRAL, NULLS], ids=["neutral", "null"])
def test_the_extras_at_neutral_or_null_are_accepted_and_change_nothing(
        http, reference_llm, extras) -> None:
    plain = _generate(http, BASE)
    _same(_generate(http, BASE | extras), _reference(reference_llm))
    assert plain["output_ids"] == _generate(http, BASE | extras)["output_ids"]


#: each extra as an SGLang client sends it, and the SamplingParams it means
EXTRAS = [
    ({"repetition_penalty": 2.0}, {"repetition_penalty": 2.0}),
    ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
    ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0}),
    ({"min_p": 0.5, "temperature": 2.0}, {"min_p": 0.5, "temperature": 2.0}),
    ({"min_new_tokens": 4, "stop_token_ids": [11], "logit_bias": {"11": 100}},
     {"min_tokens": 4, "stop_token_ids": [11], "logit_bias": {11: 100.0}}),
    # not clamped to 100 as vLLM's: 7's 250 beats 3's 100 and every logit
    ({"logit_bias": {"7": 250.0, "3": 100}}, {"logit_bias": {7: 250.0, 3: 100.0}}),
]


@pytest.mark.parametrize(("wire", "params"), EXTRAS, ids=lambda v: ",".join(v))
def test_each_sglang_extra_does_what_llm_generate_does_with_its_mapped_params(
        http, reference_llm, wire, params) -> None:
    plain = _generate(http, BASE | {"temperature": wire.get("temperature", 0.0)})
    got = _generate(http, BASE | wire)
    _same(got, _reference(reference_llm, **params))
    assert got["output_ids"] != plain["output_ids"]  # each one changes these tokens


def test_the_repetition_penalty_counts_the_output_alone_as_sglangs(
        http, reference_llm) -> None:
    repeats = [5, 17] * 4
    got = _generate(http, BASE | {"repetition_penalty": 2.0}, repeats)["output_ids"]
    assert got == _reference(reference_llm, repeats, repetition_penalty=2.0).token_ids
    # vLLM's rule (the prompt counted too) picks other tokens here
    assert got != _reference(reference_llm, repeats, repetition_penalty=2.0,
                             penalty_rules="vllm").token_ids


def test_the_text_side_extras_shape_the_text_as_llm_generate_does(http, reference_llm
                                                                  ) -> None:
    plain = _generate(http, BASE | {"max_new_tokens": 12})["text"]
    stop = plain[4:7]
    eos = sorted(reference_llm.engine.scheduler.eos_token_ids)[0]
    for wire, params in (
            ({"stop": [stop], "no_stop_trim": True},
             {"stop": [stop], "include_stop_str_in_output": True}),
            ({"stop": [stop], "no_stop_trim": False}, {"stop": [stop]}),
            ({"logit_bias": {str(eos): 100}, "skip_special_tokens": False,
              "spaces_between_special_tokens": False},
             {"logit_bias": {eos: 100.0}, "skip_special_tokens": False,
              "spaces_between_special_tokens": False})):
        got = _generate(http, BASE | {"max_new_tokens": 12} | wire)
        ref = _reference(reference_llm, max_tokens=12, **params)
        assert got["text"] == ref.text
        _same(got, ref)
    kept = _generate(http, BASE | {"max_new_tokens": 12, "stop": [stop], "no_stop_trim": True})
    assert kept["text"].endswith(stop)
    special = _generate(http, BASE | {"max_new_tokens": 12, "logit_bias": {str(eos): 100},
                                      "skip_special_tokens": False})
    assert special["text"] != _generate(http, BASE | {
        "max_new_tokens": 12, "logit_bias": {str(eos): 100}})["text"]


@pytest.mark.parametrize(("field", "value"), [
    ("stop_regex", "a+"), ("custom_params", {"x": 1}),
    ("stream_interval", 4),
])
def test_a_field_kvrunner_cannot_do_is_a_400_naming_it(http, field, value) -> None:
    response = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2, field: value}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == f"sampling_params.{field}"


def test_a_custom_logit_processor_is_a_400_naming_it(http) -> None:
    response = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2}, "custom_logit_processor": "{\"callable\": \"x\"}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "custom_logit_processor"


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 0.0), ("repetition_penalty", 2.5), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("min_p", 1.5), ("min_new_tokens", -1),
    ("min_new_tokens", 9), ("logit_bias", {"x": 1.0}), ("logit_bias", {"-1": 1.0}),
    ("logit_bias", {"99999999": 1.0}), ("no_stop_trim", "yes"),
])
def test_a_bad_extra_is_a_400_naming_it(http, field, value) -> None:
    response = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 4, field: value}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == f"sampling_params.{field}", error


#: SGLang's extras: its name -> (the SamplingParams field, how its value is written there)
DOCUMENTED = {
    "frequency_penalty": ("frequency_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "repetition_penalty": ("repetition_penalty", float),
    "min_p": ("min_p", float),
    "min_new_tokens": ("min_tokens", int),
    "logit_bias": ("logit_bias", lambda v: tuple(sorted((int(k), b) for k, b in v.items()))),
    "no_stop_trim": ("include_stop_str_in_output", bool),
    "skip_special_tokens": ("skip_special_tokens", bool),
    "spaces_between_special_tokens": ("spaces_between_special_tokens", bool),
}
_PENALTY = st.floats(-2.0, 2.0)
BODIES = st.fixed_dictionaries({}, optional={
    "frequency_penalty": st.none() | _PENALTY,
    "presence_penalty": st.none() | _PENALTY,
    "repetition_penalty": st.none() | st.floats(0.01, 2.0),
    "min_p": st.none() | st.floats(0.0, 1.0),
    "min_new_tokens": st.none() | st.integers(0, 16),
    "logit_bias": st.none() | st.dictionaries(st.integers(0, 500).map(str),
                                              st.floats(-500.0, 500.0), max_size=4),
    "no_stop_trim": st.none() | st.booleans(),
    "skip_special_tokens": st.none() | st.booleans(),
    "spaces_between_special_tokens": st.none() | st.booleans(),
})


@given(BODIES)
def test_random_sglang_bodies_map_as_documented(body: dict) -> None:
    defaults = SamplingParams(max_tokens=16)
    asked = sglang_extras(SGLangSamplingParams.model_validate(body))
    got = resolve(asked, defaults=defaults, max_n=4, max_logprobs=20, bias_limit=None)
    want = {"penalty_rules": "sglang"}
    for name, value in body.items():
        field, write = DOCUMENTED[name]
        if value is not None:
            want[field] = write(value)
    assert got == attrs.evolve(defaults, **want)
