"""One constrained request's place in its grammar: an xgrammar matcher fed its output.

The matcher is fed every output token the request keeps, in order, once the engine
has applied the step that sampled it (:meth:`RequestGrammar.catch_up`), and from it
the engine fills the request's mask for the next step (:meth:`RequestGrammar.fill`).
Both happen on the host between steps, which is why a running constrained request
makes the engine's steps synchronous (``engine/step_grammars.py``). A preempted request
keeps its output tokens, and so its matcher: the recompute samples its next token
under the mask of where it stands.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from kvrunner.engine.sequence import Sequence


class RequestGrammar:
    """The matcher of one request (see the module docstring)."""

    __slots__ = ("seq", "matcher", "fed", "error")

    def __init__(self, seq: Sequence, matcher: Any) -> None:
        self.seq = seq
        #: an ``xgrammar.GrammarMatcher`` over the compiled constraint
        self.matcher = matcher
        #: how many of the request's output tokens the matcher has taken
        self.fed = 0
        #: why the grammar refused a token (after :meth:`catch_up` returned "error")
        self.error: str | None = None

    def fill(self, bits: np.ndarray, row: int) -> None:
        """Write the tokens the request may sample next into row ``row`` of ``bits``
        (``[rows, words]`` int32, xgrammar's layout)."""
        self.matcher.fill_next_token_bitmask(bits, row)

    def catch_up(self) -> Literal["stop", "error"] | None:
        """Feed the matcher the output tokens it has not taken; returns None while the
        grammar goes on, ``"stop"`` once it is complete (the token that ends it was
        taken: nothing after it is fed), ``"error"`` for a token the grammar refuses
        (:attr:`error` names it; the mask allowed no such token, so this is a fault)."""
        seq = self.seq
        start = seq.num_prompt_tokens + self.fed
        for token in seq.token_ids[start:]:
            if not self.matcher.accept_token(token):
                self.error = (f"output token {self.fed} (id {token}) does not continue the "
                              f"request's structured-output grammar")
                return "error"
            self.fed += 1
            if self.matcher.is_terminated():
                return "stop"
        return None
