"""Structured outputs through the whole engine on the tiny model.

Every sampled output under a constraint is one the constraint accepts (a JSON schema,
a regex, a choice, any JSON object), over seeds and temperatures, with decode graphs
and asynchronous steps on; an unconstrained request beside constrained ones gets the
tokens it gets alone; a bad constraint is refused by name and the engine serves on.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

xgr = pytest.importorskip("xgrammar")

from kvrunner import LLM, RequestError, SamplingParams  # noqa: E402
from kvrunner.engine.grammar_compiler import GrammarCompiler  # noqa: E402
from kvrunner.structured_outputs import StructuredOutputsParams  # noqa: E402

ENGINE = dict(max_num_seqs=8, max_model_len=256, num_blocks=256, block_size=4, seed=0)
PROMPT = [5, 17, 42]
SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
REGEX = "[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]


def schema_holds(text: str) -> bool:
    """Whether ``text`` is a JSON document :data:`SCHEMA` accepts (checked here, not by
    xgrammar)."""
    value = json.loads(text)
    return (isinstance(value, dict) and set(value) == {"n", "ok"}
            and type(value["n"]) is int and 0 <= value["n"] <= 999
            and type(value["ok"]) is bool)  # fmt: skip


#: each constraint and the independent check of a complete output under it
CONSTRAINTS = {
    "json": ({"json": SCHEMA, "disable_any_whitespace": True}, schema_holds),
    "regex": ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
    "choice": ({"choice": CHOICES}, lambda text: text in CHOICES),
    "json_object": ({"json_object": True, "disable_any_whitespace": True},
                    lambda text: isinstance(json.loads(text), dict)),
}


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", **ENGINE) as llm:  # decode graphs and asynchronous steps on
        yield llm


def fresh_matcher(llm, constraint: dict):
    """An xgrammar matcher of ``constraint`` over the engine's vocabulary, built apart
    from the engine's own."""
    engine = llm.engine
    compiler = GrammarCompiler(llm.tokenizer, engine.vocab_size,
                               engine.scheduler.eos_token_ids)
    return xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams.of(constraint)))


def accepted(llm, constraint: dict, tokens: list[int]) -> tuple[bool, bool]:
    """Whether a fresh matcher takes every token, and whether it is complete after."""
    matcher = fresh_matcher(llm, constraint)
    return all(matcher.accept_token(t) for t in tokens), matcher.is_terminated()


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]))
def test_every_sampled_output_is_accepted_by_its_constraint(llm, seed, temperature) -> None:
    names = list(CONSTRAINTS)
    params = [SamplingParams(max_tokens=64, temperature=temperature, seed=seed + i,
                             structured_outputs=CONSTRAINTS[name][0])
              for i, name in enumerate(names)]  # fmt: skip
    outs = llm.generate([PROMPT] * len(names), params)
    for name, out in zip(names, outs, strict=True):
        constraint, holds = CONSTRAINTS[name]
        takes, complete = accepted(llm, constraint, out.token_ids)
        assert takes, f"{name}: {out.text!r} leaves the grammar"
        assert out.finish_reason in ("stop", "length"), (name, out.finish_reason, out.error)
        if out.finish_reason == "stop":
            assert complete and holds(out.text), f"{name}: {out.text!r}"


def test_most_constrained_outputs_complete_and_choice_returns_a_choice(llm) -> None:
    for constraint, holds in CONSTRAINTS.values():
        outs = llm.generate([PROMPT] * 4, [
            SamplingParams(max_tokens=64, temperature=0.7, seed=s, structured_outputs=constraint)
            for s in range(4)])
        done = [o for o in outs if o.finish_reason == "stop"]
        assert len(done) >= 3, [(o.text, o.finish_reason) for o in outs]
        assert all(holds(o.text) for o in done), [o.text for o in done]


def test_an_unconstrained_request_gets_the_tokens_it_gets_alone(llm) -> None:
    plain = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True,
                           logprobs=2)
    alone = llm.generate([[9, 8, 7, 6]], plain)[0]
    beside = llm.generate(
        [PROMPT, [9, 8, 7, 6], PROMPT],
        [SamplingParams(max_tokens=40, temperature=1.0, seed=1,
                        structured_outputs=CONSTRAINTS["regex"][0]),
         plain,
         SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"choice": CHOICES})],
    )[1]
    assert beside.token_ids == alone.token_ids
    assert beside.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_async_steps_graphs_and_eager_give_the_same_constrained_tokens() -> None:
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, structured_outputs=c)
              for s, (c, _) in enumerate(CONSTRAINTS.values())]
    results = []
    for extra in ({}, {"enforce_eager": True}, {"async_scheduling": False}):
        with LLM("tiny-qwen3", **ENGINE, **extra) as llm:
            results.append([o.token_ids for o in llm.generate([PROMPT] * len(params), params)])
    assert results[0] == results[1] == results[2]


def test_the_logprob_of_a_token_the_grammar_forces_is_zero(llm) -> None:
    # as vLLM reports it: the logprobs are those of the masked logits, so a position
    # where the grammar allows one token (here the stop token after a complete match)
    # gives it all the mass
    out = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=3,
                                                logprobs=1, structured_outputs={"regex": "ab"}))[0]
    assert out.text == "ab" and out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.scheduler.eos_token_ids
    assert out.logprobs[-1] == pytest.approx(0.0, abs=1e-6)
    assert out.top_logprobs[-1] == {out.token_ids[-1]: pytest.approx(0.0, abs=1e-6)}


def test_a_complete_grammar_ends_its_request_even_under_ignore_eos(llm) -> None:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0,
                                                ignore_eos=True,
                                                structured_outputs={"choice": CHOICES}))[0]
    assert out.text in CHOICES and out.finish_reason == "stop"


def test_each_sample_of_a_group_is_held_to_the_constraint(llm) -> None:
    (group,) = [llm.generate([PROMPT], SamplingParams(
        n=4, max_tokens=24, temperature=1.5, seed=2, structured_outputs={"regex": REGEX}))]
    texts = [o.text for o in group]
    assert len(texts) == 4 and all(re.fullmatch(REGEX, t) for t in texts), texts
    assert len(set(texts)) > 1


@pytest.mark.parametrize(("constraint", "field", "words"), [
    ({"json": '{"type": "nonsense"}'}, "json", "nonsense"),
    ({"regex": "a(b"}, "regex", "parenthesis"),
    ({"grammar": "root ::= missing"}, "grammar", "missing"),
    ({"json": "{not json"}, "json", "not valid JSON"),
    ({"regex": "a", "choice": ["b"]}, "", "exactly one"),
])
def test_a_bad_constraint_is_refused_by_name_and_the_engine_serves_on(
        llm, constraint, field, words) -> None:
    with pytest.raises(RequestError) as caught:
        llm.generate([PROMPT, PROMPT], [
            SamplingParams(max_tokens=4), SamplingParams(max_tokens=4,
                                                         structured_outputs=constraint)])
    message = str(caught.value)
    assert f"SamplingParams.structured_outputs{'.' + field if field else ''}" in message
    assert words in message
    assert not llm.engine.has_unfinished()
    assert llm.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids


def test_an_engine_without_a_tokenizer_refuses_a_constraint_by_name() -> None:
    needs = "structured_outputs needs the model's tokenizer"
    with (LLM("tiny-qwen3", **ENGINE, enforce_eager=True, skip_tokenizer_init=True) as llm,
          pytest.raises(RequestError, match=needs)):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs={"regex": "a"}))
