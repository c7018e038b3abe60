"""One request's logit adjustments, as the sampler applies them (vLLM's sampling extras).

A request whose ``SamplingParams.adjusts_logits`` holds gets one :class:`LogitRules`
when it is admitted to the running batch: its parameters with what the engine
resolved for them (the stop ids ``min_tokens`` holds back, EOS included unless
``ignore_eos``; its bad words as token ids) and, when it needs the tokens it has
seen (a penalty, or a bad word of several tokens), the row of the runner's token
history that keeps them on the device (``layers/token_history.py``). A step carries
its rows' rules beside the sampling columns; a request without any costs nothing.

No torch here: the rules cross to the runner as plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvrunner.sampling_params import SamplingParams

#: the rules of a row that has none (every field at its neutral value)
NEUTRAL_PENALTIES = (1.0, 0.0, 0.0)


@attrs.frozen(kw_only=True)
class LogitRules:
    """What the sampler does to one row's logits beyond temperature, top-k and top-p
    (``SamplingParams`` documents each field and the order they apply in)."""

    repetition_penalty: float = 1.0
    #: whose rules the penalties and the bias follow ("vllm" or "sglang")
    penalty_rules: str = "vllm"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    #: the token ids masked while fewer than ``min_tokens`` were generated
    min_tokens_stops: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    #: each bad word's token ids (a word may be banned under several tokenizations)
    bad_words: tuple[tuple[int, ...], ...] = ()
    #: the row of the runner's token history holding this request's tokens, -1 where
    #: it needs none
    history_row: int = -1

    @property
    def penalizes(self) -> bool:
        """Whether a penalty is away from neutral (it reads the token history)."""
        return (self.repetition_penalty, self.presence_penalty,
                self.frequency_penalty) != NEUTRAL_PENALTIES  # fmt: skip

    @property
    def window(self) -> int:
        """How many of the latest output tokens its bad words compare (their longest
        prefix)."""
        return max((len(w) - 1 for w in self.bad_words), default=0)


def needs_history(params: SamplingParams, bad_words: Sequence[Sequence[int]]) -> bool:
    """Whether a request's rules read its token history: a penalty, or a bad word of
    more than one token."""
    return (
        params.repetition_penalty,
        params.presence_penalty,
        params.frequency_penalty,
    ) != NEUTRAL_PENALTIES or any(len(w) > 1 for w in bad_words)


def logit_rules(
    params: SamplingParams,
    *,
    stop_on: frozenset[int],
    bad_words: tuple[tuple[int, ...], ...],
    history_row: int,
) -> LogitRules:
    """A request's rules: ``stop_on`` is what ends it (``Sequence.stop_on``: its stop
    ids and, unless ``ignore_eos``, EOS), ``bad_words`` its words' token ids
    (:func:`bad_word_token_ids`)."""
    return LogitRules(
        repetition_penalty=float(params.repetition_penalty),
        penalty_rules=params.penalty_rules,
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        min_p=float(params.min_p),
        min_tokens=int(params.min_tokens),
        min_tokens_stops=tuple(sorted(stop_on)) if params.min_tokens else (),
        logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids,
        bad_words=bad_words,
        history_row=history_row,
    )


def bad_word_token_ids(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token ids of each bad word as vLLM bans it: the word with its leading space
    stripped, and with one leading space when that tokenizes to as many tokens with a
    different first one (the word inside a text, for tokenizers that fold the space
    into the token)."""
    found: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False).ids)
        found.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            found.append(spaced)
    return tuple(found)
