"""One constrained request's place in its grammar: an xgrammar matcher fed its output.

The matcher is fed every output token the request keeps, in order, once the engine
has applied the step that sampled it (:meth:`RequestGrammar.catch_up`), and from it
the engine fills the request's mask for the next step (``engine/step_grammars.py``
fills a step's rows together).
Both happen on the host between steps, which is why a running constrained request
makes the engine's steps synchronous (``engine/step_grammars.py``). A preempted request
keeps its output tokens, and so its matcher: the recompute samples its next token
under the mask of where it stands.

A request with ``SamplingParams.reasoning_end_token_id`` reasons first: until its
output holds that token the grammar has not started (:attr:`RequestGrammar.started`
is False), its rows get no mask and the matcher is fed nothing; the tokens after it
are fed as above. The end token itself is not fed (vLLM's ``should_advance`` skips it
too).
"""

from __future__ import annotations

from typing import Any, Literal

from kvrunner.engine.sequence import Sequence


class RequestGrammar:
    """The matcher of one request (see the module docstring)."""

    __slots__ = ("seq", "matcher", "fed", "error", "end_token", "started")

    def __init__(self, seq: Sequence, matcher: Any) -> None:
        self.seq = seq
        #: an ``xgrammar.GrammarMatcher`` over the compiled constraint
        self.matcher = matcher
        #: how many of the request's output tokens were read: fed to the matcher, or
        #: passed over as reasoning
        self.fed = 0
        #: the token that ends the reasoning (None: the grammar applies from the start)
        self.end_token: int | None = seq.sampling_params.reasoning_end_token_id
        #: whether the grammar applies: the reasoning, if any, has ended
        self.started = self.end_token is None
        #: why the grammar refused a token (after :meth:`catch_up` returned "error")
        self.error: str | None = None

    def catch_up(self) -> Literal["stop", "error"] | None:
        """Feed the matcher the output tokens it has not read (only those after the
        reasoning's end, when the request reasons); returns None while the grammar goes
        on, ``"stop"`` once it is complete (the token that ends it was taken: nothing
        after it is fed), ``"error"`` for a token the grammar refuses (:attr:`error`
        names it; the mask allowed no such token, so this is a fault)."""
        seq = self.seq
        start = seq.num_prompt_tokens + self.fed
        new = seq.token_ids[start:]
        if not self.started:
            try:
                end = new.index(self.end_token)
            except ValueError:
                self.fed += len(new)  # still reasoning: nothing for the grammar
                return None
            self.fed += end + 1
            self.started = True
            new = new[end + 1:]
        for token in new:
            if not self.matcher.accept_token(token):
                self.error = (f"output token {self.fed} (id {token}) does not continue the "
                              f"request's structured-output grammar")
                return "error"
            self.fed += 1
            if self.matcher.is_terminated():
                return "stop"
        return None
