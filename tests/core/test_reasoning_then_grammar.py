"""Reasoning, then the grammar: ``SamplingParams.reasoning_end_token_id`` holds a
constrained request's grammar back until its output holds that token.

Property, over seeds and end tokens on the tiny model: up to and including the end
token, the output is the one the same seeded request draws unconstrained (no mask
applied before it); every token after it is one the grammar accepts, read by a fresh
matcher from the grammar's start (the matcher was fed nothing before). A request whose
reasoning never ends is never masked.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

xgr = pytest.importorskip("xgrammar")

from kvrunner import LLM, RequestError, SamplingParams  # noqa: E402
from kvrunner.engine.grammar_compiler import GrammarCompiler  # noqa: E402
from kvrunner.structured_outputs import StructuredOutputsParams  # noqa: E402

ENGINE = dict(max_num_seqs=8, max_model_len=256, num_blocks=256, block_size=4, seed=0)
PROMPT = [5, 17, 42]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 999}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
CONSTRAINT = {"json": SCHEMA, "disable_any_whitespace": True}


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", **ENGINE) as llm:
        yield llm


def fresh_matcher(llm):
    engine = llm.engine
    compiler = GrammarCompiler(llm.tokenizer, engine.vocab_size,
                               engine.scheduler.eos_token_ids)
    return xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams.of(CONSTRAINT)))


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), data=st.data(),
       temperature=st.sampled_from([0.7, 1.0, 1.5]))
def test_the_grammar_starts_after_the_reasoning_end_token(llm, seed, data, temperature) -> None:
    # stopping at EOS as the constrained request does: an EOS drawn while thinking ends it
    free = SamplingParams(max_tokens=16, temperature=temperature, seed=seed)
    unconstrained = llm.generate([PROMPT], free)[0].token_ids
    at = data.draw(st.integers(0, len(unconstrained) - 1), label="at")
    end = unconstrained[at]  # a token the seeded run draws: its first place ends the thinking
    first = unconstrained.index(end)
    params = SamplingParams(max_tokens=first + 1 + 40, temperature=temperature, seed=seed,
                            structured_outputs=CONSTRAINT, reasoning_end_token_id=end)
    out = llm.generate([PROMPT], params)[0]
    assert out.token_ids[:first + 1] == unconstrained[:first + 1]
    if end in llm.engine.scheduler.eos_token_ids:  # the thinking ended the request: no answer
        assert out.token_ids == unconstrained[:first + 1] and out.finish_reason == "stop"
        return
    answer = out.token_ids[first + 1:]
    matcher = fresh_matcher(llm)
    assert all(matcher.accept_token(t) for t in answer), out.text
    assert out.finish_reason in ("stop", "length"), out.error
    if out.finish_reason == "stop":
        assert matcher.is_terminated()
        text = llm.tokenizer.decode(answer[:-1])
        assert set(json.loads(text)) == {"n", "ok"}


def test_a_request_whose_reasoning_never_ends_is_never_masked(llm) -> None:
    free = SamplingParams(max_tokens=24, temperature=1.0, seed=9, ignore_eos=True,
                          logprobs=1)
    unconstrained = llm.generate([PROMPT], free)[0]
    never = next(t for t in range(1, llm.engine.vocab_size) if t not in unconstrained.token_ids)
    out = llm.generate([PROMPT], SamplingParams(
        max_tokens=24, temperature=1.0, seed=9, ignore_eos=True, logprobs=1,
        structured_outputs=CONSTRAINT, reasoning_end_token_id=never))[0]
    assert out.token_ids == unconstrained.token_ids
    assert out.logprobs == pytest.approx(unconstrained.logprobs, abs=1e-5)


def test_the_end_token_is_refused_without_a_constraint_or_outside_the_vocabulary(llm) -> None:
    with pytest.raises(RequestError, match="reasoning_end_token_id=7 says where"):
        SamplingParams(reasoning_end_token_id=7)
    outside = SamplingParams(max_tokens=2, structured_outputs=CONSTRAINT,
                             reasoning_end_token_id=llm.engine.vocab_size)
    with pytest.raises(RequestError, match="request 1: SamplingParams.reasoning_end_token_id"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2), outside])
    assert not llm.engine.has_unfinished()
