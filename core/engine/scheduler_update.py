"""Applying a step's sampled tokens (a part of :class:`~kvrunner.engine.scheduler.Scheduler`).

``update`` advances each row's computed tokens, appends its sample and finishes the
requests that end; a row the runner reports non-finite (a negative code,
:data:`~kvrunner.batch.NONFINITE_CAUSES`) ends its request with ``"error"`` and
appends nothing. A step whose every row sampled was kept as a
:class:`~kvrunner.engine.decode_batch.DecodeBatch`, and is applied from its columns
unless somebody was preempted since; any other step, and every step when
``use_columns`` is off, row by row. Both give the same result: the row loop is the
specification the columns are tested against.
"""

from __future__ import annotations

from collections import deque

from kvrunner.batch import NONFINITE_CAUSES, SampledToken, SampledTokens
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.decode_batch import Membership
from kvrunner.engine.in_flight import InFlight, check_step_result
from kvrunner.engine.sequence import FinishReason, Sequence, SequenceStatus


class SchedulerUpdate:
    """``update`` for :class:`~kvrunner.engine.scheduler.Scheduler`.

    Uses the scheduler's ``block_manager``, ``running``, ``waiting``,
    ``_unfinished``, ``_in_flight``, ``use_columns``, ``departures``,
    ``membership``, ``num_steps_applied`` and ``nonfinite_rows``.
    """

    block_manager: BlockManager
    running: list[Sequence]
    waiting: deque[Sequence]
    _unfinished: dict[int, Sequence]
    _in_flight: InFlight
    use_columns: bool
    #: sequences that left ``running`` (finished, aborted, preempted), ever
    departures: int
    membership: Membership
    num_steps_applied: int
    nonfinite_rows: int

    def update(
        self, seqs: list[Sequence], sampled: SampledTokens | list[SampledToken]
    ) -> list[Sequence]:
        """Apply the oldest step in flight: advance computed tokens, append samples,
        finish.

        ``seqs`` is the list ``schedule()`` returned; ``sampled`` holds one token for
        every chunk that had ``sample=True`` (tokens for sequences that finished during
        the step - aborted, or ended by the step before - are dropped), as the
        runner's columns or as ``SampledToken`` objects. Returns the sequences that
        finished in this step.
        """
        chunks = self._in_flight.oldest()
        sampled = SampledTokens.of(sampled)
        self.num_steps_applied += 1
        finished: list[Sequence] = []
        batch = chunks.batch
        now = self.membership
        if (
            self.use_columns
            and batch is not None
            and batch.membership.preemptions == now.preemptions  # every row running or gone
            and seqs == chunks.seqs
            and sampled.seq_ids == chunks.sample_ids  # one token a row, in row order
            # a non-finite row's code (below 0) ends its request: the row loop's case
            and min(sampled.token_ids, default=0) >= 0
        ):
            self._in_flight.pop_oldest()
            batch.apply(now, sampled.token_ids, sampled.logprobs, sampled.top_logprobs,
                        self.block_manager.block_size, self.block_manager.mark_computed,
                        lambda seq, reason: self._finish(seq, reason, finished))  # fmt: skip
        else:
            sizes, tokens, logprobs, tops = check_step_result(chunks, seqs, sampled)
            self._in_flight.pop_oldest()
            self._apply_by_row(seqs, sizes, tokens, logprobs, tops, finished)
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
        return finished

    def _apply_by_row(self, seqs, sizes, tokens, logprobs, tops, finished) -> None:
        """The specification: one pass over the step's rows, locals only, and the
        block manager called only for a chunk that fills a block (to publish it) or one
        whose count it must refuse."""
        block_manager = self.block_manager
        block_size = block_manager.block_size
        for seq, n, token, logprob, top in zip(seqs, sizes, tokens, logprobs, tops,
                                               strict=True):  # fmt: skip
            status = seq.status
            if status is SequenceStatus.FINISHED:
                continue  # aborted, or ended one step early: a token past the end
            if token is not None and token < 0:
                # Non-finite logits: the request ends and keeps nothing of this step
                # (no token, no logprob, no computed count: its KV may be poisoned).
                self._fail(seq, token, finished)
                continue
            if status is SequenceStatus.RUNNING:  # else preempted since: its token stands
                computed = seq.num_computed_tokens + n
                if (
                    computed // block_size == (computed - n) // block_size
                    and computed <= len(seq.token_ids)
                    and computed <= len(seq.block_table) * block_size
                ):
                    seq.num_computed_tokens = computed  # no block filled: nothing to publish
                else:
                    block_manager.mark_computed(seq, n)
            if token is None:
                continue  # still prefilling
            token_ids = seq.token_ids
            token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.top_logprobs.append(top)
            # "stop" wins over "length" on the same token: the model ended on its own.
            if token in seq.stop_on:
                self._finish(seq, "stop", finished)
            elif len(token_ids) >= seq.length_limit:
                self._finish(seq, "length", finished)

    def _fail(self, seq: Sequence, code: int, finished: list[Sequence]) -> None:
        """End ``seq`` with ``"error"``: its row in the step just applied was non-finite
        (``code``, one of :data:`~kvrunner.batch.NONFINITE_CAUSES`)."""
        position = len(seq.token_ids) - seq.num_prompt_tokens
        seq.error = (
            f"step {self.num_steps_applied} (output token {position}): {NONFINITE_CAUSES[code]}"
        )
        self.nonfinite_rows += 1
        self._finish(seq, "error", finished)

    def _finish(self, seq: Sequence, reason: FinishReason, finished: list[Sequence]) -> None:
        """End ``seq`` with ``reason``: free what it holds (or take it off the queue,
        if it was preempted while its last step ran)."""
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.free(seq)
            self.departures += 1
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._unfinished[seq.seq_id]
        finished.append(seq)
