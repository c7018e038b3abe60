"""The engine's structured outputs: compile each request's constraint, mask each step's
constrained rows, feed the matchers what was sampled, end the requests whose grammar
is complete.

``LLMEngine`` calls it at four points:

* ``make_request``: :meth:`StepGrammars.compile` compiles the request's
  ``SamplingParams.structured_outputs`` (``engine/grammar_compiler.py``) before it is
  queued, so a bad schema, pattern or grammar is a ``RequestError`` naming the field
  and nothing is queued;
* ``add_request``: :meth:`StepGrammars.admit` gives it a matcher
  (``engine/request_grammar.py``);
* after ``Scheduler.schedule``: :meth:`StepGrammars.constrain` packs, for every row of
  the step that samples a constrained request's next token, the tokens its grammar
  allows (``engine/token_masks.py``) into the step's sampling columns; the sampler sets
  every other token of that row to -inf;
* after ``Scheduler.update``: :meth:`StepGrammars.advance` feeds each matcher the
  tokens the step added. A grammar that is complete (its stop token taken) ends its
  request with finish reason ``"stop"``, as vLLM's does, even under ``ignore_eos``.

**The rule for asynchronous steps**: a mask for step N+1 needs step N's token in the
matcher, and with asynchronous steps that token is still on the device when N+1 is
planned. So while any constrained request is live (:attr:`StepGrammars.live`), the
engine steps synchronously: it applies the step in flight before it plans the next,
and applies each step before it returns. :meth:`constrain` checks it: a constrained
row's matcher must have taken every token of its request. Steps without a
constrained request stay asynchronous, and cost nothing here (``live`` is one dict's
truth value).

**Graphs**: a decode graph ends at the logits for a step with masks: the masks are
applied after the replay, to a copy of the graph's logits, and such a step is sampled
eagerly (``SamplingColumns.adjusted``, ``runner/capture/graph_sampling.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from kvrunner.engine.grammar_compiler import GrammarCompiler, xgrammar
from kvrunner.engine.request_grammar import RequestGrammar
from kvrunner.engine.sequence import Sequence, SequenceStatus
from kvrunner.engine.step_io import PLACEHOLDER_TOKEN, StepInput
from kvrunner.engine.token_masks import TokenMasks, mask_width
from kvrunner.errors import RequestError
from kvrunner.sampling_params import SamplingParams


class StepGrammars:
    """Every live constrained request's matcher (see the module docstring)."""

    def __init__(self, tokenizer: Any | None, vocab_size: int,
                 eos_token_ids: Iterable[int]) -> None:  # fmt: skip
        """:param tokenizer: the engine's ``tokenizers.Tokenizer`` (None: a constrained
        request is refused).
        :param vocab_size: the width of the model's logits.
        :param eos_token_ids: the model's EOS ids: what a complete grammar allows."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._live: dict[int, RequestGrammar] = {}

    @property
    def live(self) -> bool:
        """Whether some admitted request not known to be finished is constrained: the
        engine then steps synchronously."""
        return bool(self._live)

    def compile(self, params: SamplingParams, name: str) -> Any | None:
        """The compiled constraint of a request with ``params`` (None: it has none).

        :raises RequestError: naming the request and the field (a constraint that does
            not parse, a model without a tokenizer, xgrammar not installed).
        """
        constraint = params.structured_outputs
        if constraint is None:
            return None
        if self._tokenizer is None:
            raise RequestError(
                f"{name}: SamplingParams.structured_outputs needs the model's tokenizer to "
                f"match its grammar to the vocabulary, but this model has none (no "
                f"tokenizer.json, or skip_tokenizer_init is set)"
            )
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos)
        return self._compiler.compile(constraint, name=f"{name}: ")

    def admit(self, seq: Sequence) -> None:
        """Start the matcher of a queued request that has a compiled constraint."""
        if seq.grammar is not None:
            self._live[seq.seq_id] = RequestGrammar(seq, xgrammar().GrammarMatcher(seq.grammar))

    def forget(self, seq_id: int) -> None:
        """Drop a request's matcher (it was aborted)."""
        self._live.pop(seq_id, None)

    def clear(self) -> None:
        """Drop every matcher (every request was withdrawn)."""
        self._live.clear()

    def constrain(self, step: StepInput, seqs: list[Sequence]) -> StepInput:
        """``step`` with the token masks of its rows that sample a constrained request's
        next token (itself when it has none).

        :raises RuntimeError: when such a row's matcher has not taken every token of its
            request, or its last token is still on the device (a step planned while
            the step before was in flight).
        """
        live = self._live
        rows = [i for i, (seq, samples) in enumerate(zip(seqs, step.sample, strict=True))
                if samples and seq.seq_id in live]  # fmt: skip
        if not rows:
            return step
        bits = np.empty((len(rows), mask_width(self._vocab_size)), np.int32)
        for k, i in enumerate(rows):
            state = live[seqs[i].seq_id]
            pending = step.token_ids[i][-1] == PLACEHOLDER_TOKEN
            if pending or state.fed != seqs[i].num_output_tokens:
                where = "is still on the device" if pending else "was not fed to the grammar"
                raise RuntimeError(
                    f"request {seqs[i].seq_id} is constrained but its last token {where}: "
                    f"a constrained step must be planned after the step before it is applied"
                )
            state.fill(bits, k)
        masks = TokenMasks(np.array(rows, np.int64), bits)
        return attrs.evolve(step, sampling=attrs.evolve(step.sampling, masks=masks))

    def advance(self, end: Any, finished: list[Sequence]) -> None:
        """Feed every live matcher its request's new tokens (after a step was applied);
        a request whose grammar is complete is ended with ``"stop"``, one whose token the
        grammar refuses with ``"error"``, through ``end(seq_id, reason=...)`` (the
        scheduler's ``abort``), and added to ``finished``. Finished requests' matchers
        are dropped."""
        for seq_id, state in list(self._live.items()):
            seq = state.seq
            if seq.status is SequenceStatus.FINISHED:
                del self._live[seq_id]
                continue
            outcome = state.catch_up()
            if outcome is None:
                continue
            del self._live[seq_id]
            end(seq_id, reason=outcome)
            if outcome == "error":
                seq.error = state.error
            finished.append(seq)
