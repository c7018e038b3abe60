"""IncrementalDecoder: an output's text grown piece by piece equals the whole output
decoded at once, and each step decodes only the new tokens and the piece before them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvrunner.engine.incremental_decoder import IncrementalDecoder
from kvrunner.models.tiny import build_tokenizer

TOKENIZER = build_tokenizer()
IDS = st.integers(0, TOKENIZER.get_vocab_size() - 1)  # id 0 is the special token


def decode(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=True)


class CountingTokenizer:
    """The tiny tokenizer, recording how many tokens each decode call was given."""

    def __init__(self) -> None:
        self.windows: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.windows.append(len(ids))
        return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)


@given(prompt=st.lists(IDS, max_size=4), ids=st.lists(IDS, min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 40), max_size=12))  # fmt: skip
def test_pieces_join_to_the_whole_decode_for_any_tokens_and_steps(prompt, ids, cuts) -> None:
    """Random ids (split characters, stray continuation bytes, special tokens) fed in
    random steps: the text only grows, never ends in a held incomplete character
    before the last step, and is the whole decode at the end."""
    decoder = IncrementalDecoder(TOKENIZER)
    tokens = prompt + ids
    ends = sorted({min(c, len(ids)) for c in cuts} | {len(ids)})
    joined = ""
    for end in ends:
        last = end == len(ids)
        joined += decoder.decode_upto(tokens, len(prompt), end, last=last)
        assert joined == decoder.text
        assert decode(ids[:end]).startswith(decoder.text)
        if not last:
            assert not decoder.text.endswith("\ufffd")
    assert joined == decode(ids)


@given(text=st.text(alphabet="ab c\n€é😀", min_size=20, max_size=60))
def test_each_step_decodes_a_bounded_window_not_the_whole_output(text) -> None:
    """Fed one token at a time, no decode call sees more than the previous piece and
    the tokens of one unfinished character (at most 4 + 4 tokens for UTF-8), however
    long the output grows."""
    ids = TOKENIZER.encode(text).ids
    counting = CountingTokenizer()
    decoder = IncrementalDecoder(counting)
    for end in range(1, len(ids) + 1):
        decoder.decode_upto(ids, 0, end, last=end == len(ids))
    assert decoder.text == text
    assert max(counting.windows) <= 8, counting.windows
