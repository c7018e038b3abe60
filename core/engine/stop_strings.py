"""Stop strings: one request's output decoded as it grows, searched for its stops.

A stop string may span tokens (``"\\n\\n"`` from two ``"\\n"`` tokens) or end inside
one (a token ``" end."`` for the stop ``"end"``), so it is searched in the decoded
text, not in the token ids. The text grows one token at a time through an
:class:`~kvrunner.engine.incremental_decoder.IncrementalDecoder` (each token decoded
against the few before it; an incomplete UTF-8 character held until it is whole).
Only the tail that the new text can complete is searched, so a long completion is
not scanned again every step.

On a match the request's output ends: its text stops before the stop string (after
it with ``include_stop_str_in_output``) and its tokens after the one completing it
are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrunner.engine.incremental_decoder import IncrementalDecoder


class StopStringWatch:
    """Decodes one request's output tokens, one at a time, and finds its stop strings.

    :param tokenizer: a ``tokenizers.Tokenizer`` (its ``decode``).
    :param stops: the non-empty stop strings, in the request's order.
    :param include_stop: the output text keeps the matched stop string
        (``SamplingParams.include_stop_str_in_output``), and a stream holds nothing
        back.
    :param skip_special_tokens: special tokens are left out of the text.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str], *, include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:  # fmt: skip
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stops = tuple(stops)
        self.include_stop = include_stop
        #: output tokens fed so far
        self.num_seen = 0
        #: the matched stop string, once one is found
        self.matched: str | None = None
        #: where ``text`` is cut when a stop matched: the stop string's start (its end
        #: with ``include_stop``)
        self.cut: int | None = None

    def feed(self, token_ids: Sequence[int], start: int, upto: int, *, final: bool = False) -> bool:
        """Feed output tokens ``num_seen .. upto - 1`` (``token_ids[start:]`` is the
        output); True at the first one whose text completes a stop string, leaving
        ``num_seen`` on it (the output keeps ``num_seen`` tokens), ``matched`` and
        ``cut`` set.

        :param final: no token follows ``upto``: text held as an incomplete character
            is taken as it is (the output text has it so).
        """
        while self.num_seen < upto:
            self.num_seen += 1
            last = final and self.num_seen == upto
            new = self._decoder.decode_upto(token_ids, start, self.num_seen, last=last)
            if new and self._find(new):
                return True
        return False

    @property
    def text(self) -> str:
        """The output's text decoded so far (a held incomplete character aside)."""
        return self._decoder.text

    def _find(self, new: str) -> bool:
        """Whether the text, grown by ``new``, now holds a stop string. The earliest
        match to end wins (ties go to the first in the request's order): it is the
        one a reader of the text would meet first."""
        text = self.text
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            # A stop completed now ends inside ``new``, so it starts at most
            # len(stop) - 1 characters before it; earlier text was searched already.
            at = text.find(stop, max(0, len(text) - len(new) - len(stop) + 1))
            if at != -1 and (best is None or at + len(stop) < best[0]):
                best = (at + len(stop), at, stop)
        if best is None:
            return False
        end, self.cut, self.matched = best
        if self.include_stop:
            self.cut = end
        return True

    @property
    def streamable_text(self) -> str:
        """The text a stream may send now: all of it but the longest tail that begins
        a stop string (a later token may complete that stop, and the stop text is
        never output; with ``include_stop``, all of it); once a stop matched, the text up
        to the cut."""
        if self.cut is not None:
            return self.text[: self.cut]
        text = self.text
        if self.include_stop:
            return text
        held = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return text[: len(text) - held]

    @property
    def output_text(self) -> str:
        """The text up to the cut: before the matched stop string, or through it with
        ``include_stop`` (call only once one matched)."""
        assert self.cut is not None, "no stop string matched"
        return self.text[: self.cut]
