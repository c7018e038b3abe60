"""One output's text, decoded as its tokens arrive, each new piece against only the few
tokens before it.

Decoding the whole output again at every step costs time quadratic in its length.
Decoding each new token alone is wrong: a tokenizer's decoder needs the tokens
before a piece for word boundaries (a sentencepiece ``"▁word"`` loses its space at
the start of a string) and for characters split across tokens (one UTF-8 character
in several byte tokens). So each piece is decoded after the piece before it, and the
new text is that decode less the previous piece's own; text that ends in an
incomplete character (``"\\ufffd"``) is held until the tokens completing it arrive.
The joined pieces equal the whole output decoded at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: what a decoder gives for bytes that do not yet form a whole character
INCOMPLETE = "\ufffd"


class IncrementalDecoder:
    """The text of one output, grown token by token.

    :param tokenizer: a ``tokenizers.Tokenizer`` (its ``decode``).
    :param skip_special_tokens: whether special tokens are left out of the text (the
        request's ``SamplingParams.skip_special_tokens``).
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        #: the output's text decoded so far (a held incomplete character aside)
        self.text = ""
        # Output tokens [_context, _decoded) are the piece whose text ends ``text``:
        # the next piece is decoded after them, less their own decode.
        self._context = 0
        self._decoded = 0

    def decode_upto(
        self, token_ids: Sequence[int], start: int, end: int, *, last: bool = False
    ) -> str:
        """Decode output tokens up to ``end`` (``token_ids[start:]`` is the output) and
        return the text they add to :attr:`text`: "" while that text ends inside an
        incomplete character (unless ``last``: no token follows, so it stays as it
        is, as in the whole decode), or when the tokens add no text at all.

        Only the previous piece and the new tokens are decoded.
        """
        decode = self._decode
        before = decode(list(token_ids[start + self._context : start + self._decoded]),
                        skip_special_tokens=self._skip)  # fmt: skip
        after = decode(list(token_ids[start + self._context : start + end]),
                       skip_special_tokens=self._skip)  # fmt: skip
        if len(after) <= len(before) or (after.endswith(INCOMPLETE) and not last):
            return ""
        new = after[len(before) :]
        self.text += new
        self._context, self._decoded = self._decoded, end
        return new
