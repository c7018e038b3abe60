"""The engine's structured outputs: compile each request's constraint, mask each step's
constrained rows, feed the matchers what was sampled, end the requests whose grammar
is complete.

``LLMEngine`` calls it at these points:

* ``make_request``: :meth:`StepGrammars.check` refuses, with a ``RequestError`` naming
  the field, a constraint the engine cannot serve at all (no tokenizer, xgrammar not
  installed). Whether the schema, pattern or grammar parses is learnt by compiling it;
  the fronts check that up front (``LLM.generate`` and the server parse it, no
  vocabulary needed, before anything is queued);
* ``add_request``: :meth:`StepGrammars.start` has the constraint compiled off the
  engine's thread (``engine/grammar_compiles.py``); the request waits there, not in
  the scheduler, so the other requests step on meanwhile;
* at the start of every step: :meth:`StepGrammars.ready` hands back the requests whose
  grammar is ready, each with its matcher (``engine/request_grammar.py``), for the
  engine to queue, and ends with ``"error"`` (``Sequence.error`` naming the field and
  the parser's complaint) each whose constraint could not be parsed or compiled;
* after ``Scheduler.schedule``: :meth:`StepGrammars.constrain` packs, for every row of
  the step that samples a constrained request's next token, the tokens its grammar
  allows (``engine/token_masks.py``) into the step's sampling columns; the sampler sets
  every other token of that row to -inf. A request that reasons first
  (``SamplingParams.reasoning_end_token_id``) gets no mask until its reasoning ended;
* after ``Scheduler.update``: :meth:`StepGrammars.advance` feeds each matcher the
  tokens the step added. A grammar that is complete (its stop token taken) ends its
  request with finish reason ``"stop"``, as vLLM's does, even under ``ignore_eos``.

**The rule for asynchronous steps**: a mask for step N+1 needs step N's token in the
matcher (or, while a request reasons, the knowledge whether that token ended the
reasoning), and with asynchronous steps that token is still on the device when N+1 is
planned. So while any constrained request is live (:attr:`StepGrammars.live`: queued
or running with its matcher, not those still compiling), the engine steps
synchronously: it applies the step in flight before it plans the next, and applies
each step before it returns. :meth:`constrain` checks it: a constrained row's matcher
must have read every token of its request. Steps without a constrained request stay
asynchronous, and cost nothing here (``live`` is one dict's truth value).

**Graphs**: a decode graph ends at the logits for a step with masks: the masks are
applied after the replay, to a copy of the graph's logits, and such a step is sampled
eagerly (``SamplingColumns.adjusted``, ``runner/capture/graph_sampling.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from kvrunner.engine.grammar_compiler import xgrammar
from kvrunner.engine.grammar_compiles import GrammarCompiles
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
        #: the requests whose grammar is being compiled
        self.compiles = GrammarCompiles(tokenizer, vocab_size, eos_token_ids)
        self._live: dict[int, RequestGrammar] = {}
        #: xgrammar's batch matcher, made with the first mask: it fills a step's rows
        #: on a pool of threads (the fill is the host's cost of a constrained step, and
        #: the step waits for it)
        self._batch: Any = None

    @property
    def live(self) -> bool:
        """Whether some queued or running request not known to be finished is
        constrained: the engine then steps synchronously."""
        return bool(self._live)

    def check(self, params: SamplingParams, name: str) -> None:
        """Refuse a constraint this engine cannot serve at all.

        :raises RequestError: naming the request and the field (a model without a
            tokenizer, xgrammar not installed).
        """
        if params.structured_outputs is None:
            return
        if self._tokenizer is None:
            raise RequestError(
                f"{name}: SamplingParams.structured_outputs needs the model's tokenizer to "
                f"match its grammar to the vocabulary, but this model has none (no "
                f"tokenizer.json, or skip_tokenizer_init is set)"
            )
        xgrammar()
        if params.reasoning_end_token_id is not None \
                and params.reasoning_end_token_id >= self._vocab_size:
            raise RequestError(
                f"{name}: SamplingParams.reasoning_end_token_id "
                f"{params.reasoning_end_token_id} is outside the vocabulary "
                f"[0, {self._vocab_size})"
            )

    def start(self, seq: Sequence, name: str) -> None:
        """Have ``seq``'s constraint compiled; it waits until :meth:`ready` returns it."""
        self.compiles.start(seq, name)

    def ready(self, failed: list[Sequence]) -> list[Sequence]:
        """The waiting requests whose grammar is ready, each with its matcher, in the
        order they came; each whose constraint could not be parsed or compiled is ended
        with ``"error"`` (``Sequence.error`` says why) and added to ``failed``."""
        ready = []
        for seq, grammar, error in self.compiles.done():
            if error is not None:
                seq.status, seq.finish_reason, seq.error = \
                    SequenceStatus.FINISHED, "error", error
                failed.append(seq)
                continue
            seq.grammar = grammar
            self._live[seq.seq_id] = RequestGrammar(seq, xgrammar().GrammarMatcher(grammar))
            ready.append(seq)
        return ready

    def forget(self, seq_id: int) -> Sequence | None:
        """Drop a request's matcher, or its wait for its grammar (it was aborted); the
        request if it was waiting (the scheduler never knew it), else None."""
        self._live.pop(seq_id, None)
        return self.compiles.drop(seq_id)

    def clear(self) -> list[Sequence]:
        """Drop every matcher and every wait (every request was withdrawn); the requests
        that were waiting for their grammar."""
        self._live.clear()
        return self.compiles.drop_all()

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
        for i in rows:
            state = live[seqs[i].seq_id]
            pending = step.token_ids[i][-1] == PLACEHOLDER_TOKEN
            if pending or state.fed != seqs[i].num_output_tokens:
                where = "is still on the device" if pending else "was not fed to the grammar"
                raise RuntimeError(
                    f"request {seqs[i].seq_id} is constrained but its last token {where}: "
                    f"a constrained step must be planned after the step before it is applied"
                )
        rows = [i for i in rows if live[seqs[i].seq_id].started]  # not while reasoning
        if not rows:
            return step
        bits = np.empty((len(rows), mask_width(self._vocab_size)), np.int32)
        if self._batch is None:
            self._batch = xgrammar().BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask([live[seqs[i].seq_id].matcher
                                                   for i in rows], bits)
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
