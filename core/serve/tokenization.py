"""The server's tokenizer work, kept off the event loop: :class:`ServerTokenizer`.

The event loop never tokenises, detokenises or renders a chat template: each runs on
a small thread pool (``TOKENIZER_WORKERS`` threads), through the ``tokenizers``
batch calls, which release the GIL while they work (``Tokenizer.encode`` holds it:
6 s of one 6 MB prompt would stall every client, ``/health`` included). A single
token's text, which the logprob answers name per token, is read from a table
decoded once at start-up (``decode([t])`` for every id), not detokenised.

Before a text prompt is tokenised, a cheap bound refuses what cannot fit. A token
covers at most L bytes of the normalised text, L the vocabulary's longest entry (a
byte-level entry stores one character per byte; a SentencePiece entry one per
character). Every character is at least one byte, and a normaliser that composes
characters (NFC, NFKC) replaces at most three of them by one of at least two bytes,
so a text's normalised bytes are at least half its characters: a prompt longer than
``max_model_len × 2L`` characters has more than ``max_model_len`` tokens. The bound
is applied only to a tokenizer that drops nothing of a text (checked at start-up:
``decode(encode(probe))`` gives back a probe of spaces, tabs, newlines, punctuation,
accents, CJK and an emoji); for any other, the body limit is the only bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from kvrunner.serve.errors import APIError
from kvrunner.unicode_text import lone_surrogate

#: threads tokenising, detokenising and rendering templates for the server; a
#: bounded pool also bounds how much of that work (and its memory) runs at once
TOKENIZER_WORKERS = 2
#: text the tokenizer must give back whole for the length bound to apply
_PROBE = "  Hello,\n\n\tworld!  é ü 你好 🙂 \r\n end  "
#: normalised bytes per input character, at least (see the module docstring)
_BYTES_PER_CHAR = 0.5

T = TypeVar("T")


def _drops_nothing(tokenizer: Any) -> bool:
    ids = tokenizer.encode_batch([_PROBE], add_special_tokens=False)[0].ids
    return tokenizer.decode_batch([ids], skip_special_tokens=False)[0] == _PROBE


def _longest_entry(tokenizer: Any) -> int:
    """The longest vocabulary entry, in characters of its stored form (a byte-level
    entry stores one character per byte): an upper bound on the characters one token
    covers."""
    return max(len(entry) for entry in tokenizer.get_vocab(with_added_tokens=True))


class ServerTokenizer:
    """One server's tokenizer, used off the event loop.

    :param tokenizer: a ``tokenizers.Tokenizer``.
    :param max_model_len: the engine's; with the vocabulary it gives
        :attr:`max_prompt_chars`.
    """

    def __init__(self, tokenizer: Any, *, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(TOKENIZER_WORKERS, thread_name_prefix="kvrunner-tokenize")
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._texts: list[str] = tokenizer.decode_batch([[t] for t in range(size)],
                                                        skip_special_tokens=False)
        self._special = {t for t, token in tokenizer.get_added_tokens_decoder().items()
                         if token.special}
        #: the most characters one token covers (the bound's unit)
        self.longest_token_chars = _longest_entry(tokenizer)
        #: the longest text prompt tokenised (characters); None: no bound but the body's
        self.max_prompt_chars: int | None = (
            int(max_model_len * self.longest_token_chars / _BYTES_PER_CHAR)
            if _drops_nothing(tokenizer) else None)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the pool (a template's rendering, say)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def check_length(self, text: str, *, param: str) -> None:
        """A 400 naming ``param`` and the bound when ``text`` is too long to fit."""
        bound = self.max_prompt_chars
        if bound is not None and len(text) > bound:
            raise APIError(400, f"{param} has {len(text)} characters, more than the {bound} "
                           f"that can fit in max_model_len tokens (max_model_len × 2 × "
                           f"{self.longest_token_chars}, the most bytes one token covers); "
                           f"it was refused before tokenising", param=param)

    async def prompt_ids(self, text: str, *, param: str,
                         add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids, refused first if it cannot fit (see
        :meth:`check_length`)."""
        self.check_length(text, param=param)
        return (await self.encode(text, param=param, add_special_tokens=add_special_tokens)).ids

    async def encode(self, text: str, *, param: str, add_special_tokens: bool) -> Any:
        """The ``tokenizers.Encoding`` of ``text`` (no length bound); a 400 naming
        ``param`` for a text that is not Unicode (a JSON body may carry a lone UTF-16
        surrogate, ``"\\ud800"``, which Python keeps and the tokenizer refuses)."""
        found = lone_surrogate(text)
        if found is not None:
            raise APIError(400, f"{param} {found}", param=param)
        encodings = await self.run(partial(self.tokenizer.encode_batch, [text],
                                           add_special_tokens=add_special_tokens))
        return encodings[0]

    async def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        """The text of ``ids``."""
        texts = await self.run(partial(self.tokenizer.decode_batch, [ids],
                                       skip_special_tokens=skip_special_tokens))
        return texts[0]

    def token_text(self, token_id: int, *, skip_special_tokens: bool) -> str:
        """One token's text, as ``decode([token_id])`` gives it (from the table)."""
        if skip_special_tokens and token_id in self._special:
            return ""
        # an id past the tokenizer's vocabulary (a model's padded embedding) has no
        # text: decode() gives "" for it too
        return self._texts[token_id] if 0 <= token_id < len(self._texts) else ""

    def close(self) -> None:
        """Stop the pool's threads once their work is done."""
        self._pool.shutdown(wait=False)
