"""A stream's text: its deltas join to the final output's text, never say what the
output drops (the start of a stop string), and each step decodes only the new tail."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner import LLM, AsyncLLM, SamplingParams
from kvrunner.async_engine.handoff import Channel
from kvrunner.async_engine.live_request import LiveRequest
from kvrunner.engine.sequence import Sequence
from kvrunner.models.tiny import build_tokenizer

PROMPTS = ["The river", "Hello there", [7, 8, 9]]


def sampled(seed: int, max_tokens: int, stop: list[str] | None = None) -> SamplingParams:
    # a hot temperature: near-random tokens, split characters and odd bytes included
    return SamplingParams(max_tokens=max_tokens, temperature=1.6, seed=seed, ignore_eos=True,
                          stop=stop or None)  # fmt: skip


def stop_strings(text: str) -> st.SearchStrategy[list[str]]:
    """Stops cut from the text the request makes without them (so they are met,
    across token boundaries or inside one token), or arbitrary ones."""
    cut = st.tuples(st.integers(0, max(0, len(text) - 1)), st.integers(1, 5)).map(
        lambda a: text[a[0] : a[0] + a[1]])
    return st.lists(st.one_of(cut, cut, st.text(alphabet="eat ", min_size=1, max_size=3))
                    .filter(bool), min_size=1, max_size=3)  # fmt: skip


async def stream(llm: LLM, prompt, params: SamplingParams) -> list:
    async with AsyncLLM.from_llm(llm) as engine:
        return [d async for d in engine.generate_stream(prompt, params)]


@settings(max_examples=10, deadline=None)
@given(data=st.data(), which=st.integers(0, len(PROMPTS) - 1), seed=st.integers(0, 2**16),
       max_tokens=st.integers(4, 24))  # fmt: skip
def test_streamed_text_joins_to_the_output_and_never_holds_a_stop_string(
    served: LLM, data, which, seed, max_tokens
) -> None:
    llm = served  # module-scoped: no weights change here
    prompt = PROMPTS[which]
    free = llm.generate(prompt, sampled(seed, max_tokens))[0]
    stops = data.draw(stop_strings(free.text), label="stops")
    params = sampled(seed, max_tokens, stops)
    want = llm.generate(prompt, params)[0]

    deltas = asyncio.run(stream(llm, prompt, params))
    out = deltas[-1].output
    assert (out.token_ids, out.text, out.finish_reason) == (
        want.token_ids, want.text, want.finish_reason)  # fmt: skip
    sent = ""
    for delta in deltas:
        sent += delta.text
        # what was sent is never taken back: it is the start of the final text, which
        # holds no stop string
        assert out.text.startswith(sent), (sent, out.text, stops)
    assert sent == out.text
    assert not any(s in sent for s in stops)


class CountingTokenizer:
    """The tiny tokenizer, recording how many tokens each decode call was given."""

    def __init__(self) -> None:
        self.tokenizer = build_tokenizer()
        self.windows: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.windows.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_long_stream_decodes_only_its_new_tokens_each_step() -> None:
    """Delta text costs the same at token 400 as at token 4: each step decodes the
    previous piece and the new token, not the whole output."""
    counting = CountingTokenizer()
    text = "The river was wide and the boat was slow. " * 40
    ids = counting.tokenizer.encode(text).ids
    assert len(ids) > 300
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=len(ids)))
    loop = asyncio.new_event_loop()
    live = LiveRequest("r", [1, 2, 3], seq, Channel(loop), True, versions=[(0, 0)])
    sent = ""
    for token in ids:
        seq.token_ids.append(token)  # one step's token
        sent += live.delta(counting).text
    loop.close()
    assert sent == text
    assert max(counting.windows) <= 8, max(counting.windows)
