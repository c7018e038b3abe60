"""The length bound that refuses a text prompt before it is tokenised never refuses a
text that fits: no text has fewer than ``len(text) / (2 L)`` tokens, with or without
a composing normaliser (NFC, as Qwen's tokenizers have); and a tokenizer that drops
text (a whitespace pre-tokenizer) gets no bound. The texts a token names come from
the start-up table and equal ``decode([t])``.
"""

from __future__ import annotations

import asyncio

import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.models.tiny import ensure_default_model
from kvrunner.serve.errors import APIError
from kvrunner.serve.tokenization import ServerTokenizer

#: characters that compose under NFC (bases, combining marks, Hangul jamo) and the rest
#: of Unicode (not the surrogates, U+D800-DFFF: no text holds one alone, and a prompt
#: that does is refused before tokenising, as the test below it checks)
_COMPOSING = "aeiouAEOsSyY\u0301\u0300\u0302\u0303\u0308\u030a\u0323\u1100\u1161\u11a8"
TEXTS = st.text(alphabet=st.one_of(st.characters(exclude_categories=["Cs"]),
                                   st.sampled_from(_COMPOSING)),
                max_size=400)


def _tokenizer(normalizer: object = None) -> tokenizers.Tokenizer:
    path = ensure_default_model("tiny-qwen3") / "tokenizer.json"
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return tokenizer


@pytest.fixture(scope="module", params=["none", "nfc", "nfkc"])
def served(request) -> ServerTokenizer:
    normalizer = {"none": None, "nfc": tokenizers.normalizers.NFC(),
                  "nfkc": tokenizers.normalizers.NFKC()}[request.param]
    tokens = ServerTokenizer(_tokenizer(normalizer), max_model_len=64)
    yield tokens
    tokens.close()


def test_a_byte_level_tokenizer_gets_a_bound(served) -> None:
    assert served.max_prompt_chars == 64 * 2 * served.longest_token_chars


@given(text=TEXTS)
def test_the_bound_never_undercounts_tokens(served, text) -> None:
    ids = served.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) * 2 * served.longest_token_chars >= len(text)


@given(text=TEXTS, surrogate=st.characters(categories=["Cs"]), at=st.integers(0, 400))
def test_a_prompt_holding_a_lone_surrogate_is_refused_naming_it(served, text, surrogate,
                                                                  at) -> None:
    at = min(at, len(text))
    with pytest.raises(APIError) as refused:
        asyncio.run(served.prompt_ids(text[:at] + surrogate + text[at:], param="prompt"))
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert f"U+{ord(surrogate):04X} at character {at}" in refused.value.message


def test_a_text_over_the_bound_is_refused_and_one_at_it_is_tokenised(served) -> None:
    bound = served.max_prompt_chars
    with pytest.raises(APIError) as refused:
        asyncio.run(served.prompt_ids("a" * (bound + 1), param="prompt"))
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert str(bound) in refused.value.message
    assert len(asyncio.run(served.prompt_ids("a" * bound, param="prompt"))) > 0


def test_a_tokenizer_that_drops_whitespace_gets_no_bound() -> None:
    tokenizer = _tokenizer()
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.BPEDecoder()
    tokens = ServerTokenizer(tokenizer, max_model_len=64)
    try:
        assert tokens.max_prompt_chars is None
        tokens.check_length(" " * 10_000, param="prompt")  # only the body limit bounds it
    finally:
        tokens.close()


def test_a_tokens_text_is_what_decoding_it_alone_gives() -> None:
    tokenizer = _tokenizer()
    tokens = ServerTokenizer(tokenizer, max_model_len=64)
    try:
        for t in range(tokenizer.get_vocab_size(with_added_tokens=True)):
            for skip in (False, True):
                assert tokens.token_text(t, skip_special_tokens=skip) == \
                    tokenizer.decode([t], skip_special_tokens=skip)
        assert tokens.token_text(10**6, skip_special_tokens=False) == ""
    finally:
        tokens.close()
