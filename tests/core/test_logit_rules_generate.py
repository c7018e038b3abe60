"""vLLM's sampling extras through the whole engine on the tiny model: each changes what
it should, and a penalised request's tokens do not depend on async steps, graphs or
preemption (its token history is rebuilt from the host's tokens on re-admission)."""

from __future__ import annotations

import pytest

from kvrunner import LLM, RequestError, SamplingParams

ENGINE = dict(max_num_seqs=4, max_model_len=96, num_blocks=64, block_size=4, seed=0)
PROMPT = [5, 17, 42, 9, 5, 5, 5]


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", **ENGINE, enforce_eager=True) as llm:
        yield llm


def tokens(llm, **params) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(**params))[0].token_ids


def test_a_large_repetition_penalty_makes_greedy_never_repeat_a_token(llm) -> None:
    plain = tokens(llm, max_tokens=30, temperature=0.0, ignore_eos=True)
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself unpenalised
    penalised = tokens(
        llm, max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=100.0
    )
    assert len(set(penalised)) == len(penalised) and not set(penalised) & set(PROMPT)


def test_frequency_and_presence_penalties_change_a_repeating_greedy_output(llm) -> None:
    plain = tokens(llm, max_tokens=30, temperature=0.0, ignore_eos=True)
    for field in ("frequency_penalty", "presence_penalty"):
        out = tokens(llm, max_tokens=30, temperature=0.0, ignore_eos=True, **{field: 2.0})
        assert out != plain
        # the first repeat of the plain output is where the penalty first bites
        first_repeat = next(i for i, t in enumerate(plain) if t in plain[:i])
        assert out[:first_repeat] == plain[:first_repeat]


def test_min_tokens_holds_back_eos_until_reached(llm) -> None:
    eos = sorted(llm.engine.scheduler.eos_token_ids)[0]
    forced = dict(max_tokens=20, temperature=0.0, logit_bias={eos: 100.0})
    assert len(tokens(llm, **forced)) == 1  # EOS at once
    out = llm.generate([PROMPT], SamplingParams(**forced, min_tokens=6))[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos and out.finish_reason == "stop"


def test_min_tokens_holds_back_a_stop_token_id(llm) -> None:
    plain = tokens(llm, max_tokens=12, temperature=0.0, ignore_eos=True)
    stop = plain[2]
    assert (
        tokens(llm, max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])[-1]
        == stop
    )
    held = tokens(
        llm, max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], min_tokens=8
    )
    assert stop not in held[:8]


def test_allowed_token_ids_only_emits_those(llm) -> None:
    allowed = {3, 4, 7, 300}
    out = tokens(
        llm,
        max_tokens=24,
        temperature=1.5,
        seed=1,
        ignore_eos=True,
        allowed_token_ids=sorted(allowed),
    )
    assert set(out) <= allowed and len(set(out)) > 1


def test_a_logit_bias_of_100_forces_its_token(llm) -> None:
    assert (
        tokens(llm, max_tokens=8, temperature=1.0, seed=2, ignore_eos=True, logit_bias={11: 100.0})
        == [11] * 8
    )


def test_min_p_one_draws_the_likeliest_token(llm) -> None:
    greedy = tokens(llm, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert tokens(llm, max_tokens=12, temperature=2.0, seed=3, ignore_eos=True, min_p=1.0) == greedy
    assert tokens(llm, max_tokens=12, temperature=2.0, seed=3, ignore_eos=True) != greedy


def test_a_bad_word_of_two_tokens_is_never_completed(llm) -> None:
    tokenizer = llm.tokenizer
    # two tokens whose text tokenizes back to them: a word of two tokens
    first, second = next(
        (a, b)
        for a in range(100, 400)
        for b in range(100, 140)
        if tokenizer.encode(tokenizer.decode([a, b]).lstrip(), add_special_tokens=False).ids
        == [a, b]
    )
    word = tokenizer.decode([first, second])
    free = dict(
        max_tokens=40, temperature=1.0, seed=4, ignore_eos=True, allowed_token_ids=[first, second]
    )
    pairs = list(zip(tokens(llm, **free)[:-1], tokens(llm, **free)[1:], strict=True))
    assert (first, second) in pairs  # drawn freely, the word comes up
    out = tokens(llm, **free, bad_words=[word])
    assert (first, second) not in list(zip(out[:-1], out[1:], strict=True))


def test_a_single_token_bad_word_is_never_emitted(llm) -> None:
    plain = tokens(llm, max_tokens=16, temperature=0.0, ignore_eos=True)
    word = llm.tokenizer.decode([plain[0]])
    banned = llm.tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
    assert len(banned) == 1
    out = tokens(llm, max_tokens=16, temperature=0.0, ignore_eos=True, bad_words=[word])
    assert banned[0] not in out and out != plain


def test_ids_past_the_vocabulary_are_refused_by_name(llm) -> None:
    for field, value in (("logit_bias", {10**6: 1.0}), ("allowed_token_ids", [10**6])):
        with pytest.raises(RequestError, match=f"SamplingParams.{field}"):
            llm.generate([PROMPT], SamplingParams(**{field: value}))


def test_text_holding_a_lone_surrogate_is_refused_by_name_and_the_engine_serves_on(llm) -> None:
    with pytest.raises(RequestError, match=r"request 1: .* \(U\+D800 at character 2\)"):
        llm.generate(["fine", "ab\ud800"], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match=r"bad_words 'x\\udfff' .* \(U\+DFFF at character 1\)"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, bad_words=["ok", "x\udfff"]))
    assert len(tokens(llm, max_tokens=3, ignore_eos=True)) == 3


MIX = [  # the penalised last: a preemption takes the latest admitted first
    SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True),
    SamplingParams(
        max_tokens=28,
        temperature=1.0,
        seed=8,
        ignore_eos=True,
        logit_bias={3: 4.0},
        bad_words=["hello world"],
    ),
    SamplingParams(
        max_tokens=28,
        temperature=0.9,
        seed=7,
        ignore_eos=True,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        min_p=0.05,
    ),
    SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
]
PROMPTS = [[9, 9, 8, 8, 7], [40, 41, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9], PROMPT]


def test_penalised_tokens_are_the_same_alone_batched_async_graphed_and_preempted() -> None:
    with LLM("tiny-qwen3", **ENGINE, enforce_eager=True) as alone:
        want = [alone.generate([p], s)[0].token_ids for p, s in zip(PROMPTS, MIX, strict=True)]
    settings = [
        dict(ENGINE, enforce_eager=True, async_scheduling=False),
        dict(ENGINE),  # decode graphs (the CPU stand-ins), async steps
        # a pool too small for the four at once: requests are preempted and recomputed
        dict(ENGINE, num_blocks=12, enforce_eager=True),
    ]
    for setting in settings:
        with LLM("tiny-qwen3", **setting) as llm:
            got = [o.token_ids for o in llm.generate(PROMPTS, MIX)]
            assert got == want, setting
            if setting["num_blocks"] == 12:
                assert llm.engine.scheduler.num_preemptions > 0


def test_a_greedy_step_with_rules_in_a_decode_graph_is_picked_from_the_rules() -> None:
    # every row greedy: the graph's own argmax would serve the step, were it not for
    # the rules
    params = SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=100.0
    )
    with LLM("tiny-qwen3", **ENGINE, enforce_eager=True) as eager:
        want = eager.generate([PROMPT], params)[0].token_ids
    with LLM("tiny-qwen3", **ENGINE) as graphed:
        assert graphed.generate([PROMPT], params)[0].token_ids == want
    assert len(set(want)) == len(want)


def test_include_stop_str_in_output_keeps_the_matched_stop_in_the_text(llm) -> None:
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0,
                                                  ignore_eos=True))[0].text
    stop = plain[4:7]
    at = plain.index(stop)
    for include, text in ((False, plain[:at]), (True, plain[: at + len(stop)])):
        out = llm.generate([PROMPT], SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop],
            include_stop_str_in_output=include))[0]
        assert out.text == text and out.stop_reason == stop


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(llm) -> None:
    eos = sorted(llm.engine.scheduler.eos_token_ids)[0]
    forced = dict(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={eos: 100.0})
    special = llm.tokenizer.decode([eos], skip_special_tokens=False)
    assert special  # the EOS token is a special token with a text of its own
    skipped = llm.generate([PROMPT], SamplingParams(**forced))[0]
    kept = llm.generate([PROMPT], SamplingParams(**forced, skip_special_tokens=False))[0]
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    assert skipped.text == "" and kept.text == special * 3
