"""Stop strings: found in the decoded output text (across tokens, inside a token),
the stop text and every token after the one completing it left out, finish reason
"stop" and ``stop_reason`` the matched string, as vLLM reports them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner import LLM, RequestError, SamplingParams
from kvrunner.engine.stop_strings import StopStringWatch
from kvrunner.models.tiny import build_tokenizer

ENGINE = dict(max_num_seqs=4, max_model_len=96, num_blocks=64, enforce_eager=True)
PROMPT = "The river was"
TOKENIZER = build_tokenizer()
IDS = st.integers(0, TOKENIZER.get_vocab_size() - 1)


def decode(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def first_stop(ids: list[int], stops: list[str]) -> tuple[int, int, str] | None:
    """The reference: the fewest tokens whose decode holds a stop and does not end in
    an incomplete character (unless they are all the tokens there are: nothing can
    complete it), the earliest ending stop there (ties: the first listed), and where
    it starts."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if text.endswith("\ufffd") and k < len(ids):
            continue  # the next token may still make it a character
        found = [(text.find(s) + len(s), i, s) for i, s in enumerate(stops) if s in text]
        if found:
            _, _, stop = min(found)
            return k, text.find(stop), stop
    return None


@settings(max_examples=60, deadline=None)
@given(data=st.data(), ids=st.lists(IDS, min_size=1, max_size=24))
def test_watch_finds_what_decoding_each_prefix_finds(data, ids) -> None:
    text = decode(ids)
    stops = data.draw(st.lists(
        st.one_of(
            st.tuples(st.integers(0, max(0, len(text) - 1)), st.integers(1, 6)).map(
                lambda a: text[a[0]: a[0] + a[1]]),
            st.text(min_size=1, max_size=4),
        ).filter(bool), min_size=1, max_size=3))
    watch = StopStringWatch(TOKENIZER, stops)
    matched = watch.feed(ids, 0, len(ids), final=True)
    expected = first_stop(ids, stops)
    if expected is None:
        assert not matched and watch.text == text
    else:
        k, cut, stop = expected
        assert matched and watch.num_seen == k and watch.matched == stop
        assert watch.output_text == decode(ids[:k])[:cut]


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab c€", min_size=1, max_size=20),
       stops=st.lists(st.text(alphabet="ab c€", min_size=1, max_size=3), min_size=1,
                      max_size=2))
def test_streamed_text_only_grows_and_never_holds_stop_text(text, stops) -> None:
    """Text a stream sent is never taken back: each streamable text extends the one
    before, holds no stop string, holds back only the start of one, and the last is
    the output text."""
    ids = TOKENIZER.encode(text).ids
    watch = StopStringWatch(TOKENIZER, stops)
    sent = ""
    for k in range(1, len(ids) + 1):
        matched = watch.feed(ids, 0, k, final=k == len(ids))
        now = watch.streamable_text
        assert now.startswith(sent), (sent, now)
        sent = now
        assert not any(s in sent for s in stops)
        if matched:
            assert sent == watch.output_text
            break
        # what is held back is the start of a stop string, and no more
        held = watch.text[len(sent):]
        assert not held or any(s.startswith(held) and len(held) < len(s) for s in stops)


def test_watch_holds_a_split_character_until_it_is_whole() -> None:
    euro = TOKENIZER.encode("€").ids  # three bytes, more than one token here
    assert len(euro) > 1
    watch = StopStringWatch(TOKENIZER, ["€"])
    ids = TOKENIZER.encode("a €b").ids
    assert watch.feed(ids, 0, len(ids))
    assert watch.output_text == "a " and decode(ids[: watch.num_seen]).endswith("€")


def test_watch_reads_from_the_output_start() -> None:
    prompt = TOKENIZER.encode("stop here").ids
    out = TOKENIZER.encode(" and go").ids
    watch = StopStringWatch(TOKENIZER, ["stop"])
    assert not watch.feed(prompt + out, len(prompt), len(out), final=True)  # not the prompt
    assert watch.text == " and go"


@pytest.mark.parametrize(("stop", "named"), [
    ("", "stop must hold non-empty strings"), ([""], "stop must hold non-empty strings"),
    ([3], "stop must hold non-empty strings"), (7, "stop must be a string or a list"),
    (b"x", "stop must be a string or a list"), (["a", None], "stop must hold non-empty strings"),
])
def test_bad_stop_is_refused_naming_the_field(stop, named) -> None:
    with pytest.raises(RequestError, match=f"SamplingParams.{named}"):
        SamplingParams(stop=stop)


def test_stop_accepts_a_string_or_a_list() -> None:
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    with LLM("tiny-qwen3", async_scheduling=request.param, **ENGINE) as llm:
        yield llm


GREEDY = dict(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def plain(llm):
    return llm.generate(PROMPT, SamplingParams(**GREEDY))[0]


@pytest.mark.parametrize("at", [3, 8, 15])
def test_generate_stops_at_a_stop_string_and_leaves_it_out(llm, plain, at) -> None:
    full = plain.text
    stop = full[at: at + 4]
    k, cut, _ = first_stop(plain.token_ids, [stop])
    out = llm.generate(PROMPT, SamplingParams(**GREEDY, stop=stop))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == decode(plain.token_ids[:k])[:cut]
    assert stop not in out.text
    assert out.token_ids == plain.token_ids[:k]  # nothing after the completing token
    assert out.logprobs == plain.logprobs[:k] and len(out.top_logprobs) == k


def test_other_requests_of_the_batch_are_untouched(llm, plain) -> None:
    stop = plain.text[5:8]
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(**GREEDY, stop=stop),
                                           SamplingParams(**GREEDY)])
    assert outs[0].finish_reason == "stop"
    assert outs[1].token_ids == plain.token_ids and outs[1].stop_reason is None


def test_stop_on_the_last_allowed_token_is_a_stop(llm, plain) -> None:
    stop = plain.text[10:13]
    k, _, _ = first_stop(plain.token_ids, [stop])
    out = llm.generate(PROMPT, SamplingParams(**{**GREEDY, "max_tokens": k}, stop=stop))[0]
    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("stop", stop, k)


def test_an_absent_stop_changes_nothing(llm, plain) -> None:
    out = llm.generate(PROMPT, SamplingParams(**GREEDY, stop=["\x00never\x00"]))[0]
    assert (out.token_ids, out.text, out.finish_reason) == (plain.token_ids, plain.text, "length")
    assert out.stop_reason is None


def test_stop_token_id_is_the_stop_reason(llm, plain) -> None:
    token = plain.token_ids[4]
    out = llm.generate(PROMPT, SamplingParams(**GREEDY, stop_token_ids=[token]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == token
    assert out.token_ids == plain.token_ids[: plain.token_ids.index(token) + 1]


def test_each_sample_of_a_group_stops_on_its_own(llm) -> None:
    params = SamplingParams(n=3, seed=4, max_tokens=30, ignore_eos=True)
    free = llm.generate(PROMPT, params)
    stop = free[1].text[6:9]
    outs = llm.generate(PROMPT, SamplingParams(n=3, seed=4, max_tokens=30, ignore_eos=True,
                                               stop=stop))
    for got, ref in zip(outs, free, strict=True):
        hit = first_stop(ref.token_ids, [stop])
        if hit is None:
            assert got.token_ids == ref.token_ids and got.finish_reason == "length"
        else:
            assert got.token_ids == ref.token_ids[: hit[0]] and got.stop_reason == stop
    assert outs[1].finish_reason == "stop"


def test_a_model_without_a_tokenizer_refuses_stop_strings_at_admission() -> None:
    with LLM("tiny-qwen3", skip_tokenizer_init=True, **ENGINE) as llm:
        with pytest.raises(RequestError, match=r"request 1: SamplingParams.stop \['x'\] needs a "
                           r"tokenizer.*use stop_token_ids"):
            llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(), SamplingParams(stop="x")])
        assert not llm.engine.has_unfinished()  # nothing of the call was queued
        assert llm.generate([1, 2, 3], SamplingParams(max_tokens=2))[0].finish_reason
