"""The decode batch: a steady decode step's columns, kept from one step to the next.

Once every running sequence samples in step N (a decode step, or one whose new
requests prefill whole prompts), step N+1 is step N moved on: the same sequences in
the same order, each feeding one token from where its chunk in N ended, one more
output, the same sampling settings, state slots and table rows.
:class:`DecodeBatch` keeps step N's columns as arrays and lists and derives step N+1
from them in a few numpy passes, where the scheduler's row loop reads a dozen fields
off every ``Sequence`` (about a microsecond a row at batch 1,024; reading the same
columns off the objects in C-level passes costs as much, see docs/benchmarks.md).
Applying a decode step's tokens (:meth:`DecodeBatch.apply`) likewise computes the
new counts and finishes from the columns, and touches each sequence only to record
its token.

Why the derivation holds: a row's chunk starts where the step in flight (or, with
synchronous steps, the last applied one) leaves it, ``num_computed_tokens`` plus
what that step feeds it; after step N fed ``size`` tokens from ``start``, that is
``start + size`` whatever the step before fed, and as step N sampled for it, the
chunk is the one token sampled there. It holds for every row still running,
whoever else left since. A batch is made at the end of one ``schedule()`` and
continued at the start of the next; between the two nobody is admitted or preempted
(both happen only inside ``schedule()``), so only finishes and aborts change who
runs, and each only drops its row (the rows' statuses are read then, one C-level
pass, when the scheduler's count of departures moved). A step with an admission is
planned by the row loop, as always. Applying a step's tokens from its batch also
needs no preemption since it was planned (the next ``schedule()`` may preempt): a
preempted row keeps its token as a waiting sequence, which only the row loop does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import compress, repeat
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from kvrunner.batch import PLACEHOLDER_CHUNK, StepInput
from kvrunner.engine.sequence import Sequence, SequenceStatus
from kvrunner.engine.table_rows import TableRows

_token_ids = attrgetter("token_ids")
_logprobs = attrgetter("logprobs")
_top_logprobs = attrgetter("top_logprobs")
_stop_on = attrgetter("stop_on")
_length_limit = attrgetter("length_limit")
_table_row = attrgetter("table_row")
_status = attrgetter("status")


class Membership(NamedTuple):
    """The scheduler's counts of sequences that left ``running`` (finished, aborted or
    preempted), and of those preempted, ever."""

    departures: int
    preemptions: int


def _consume(iterator) -> None:
    """Run a C-level ``map`` for its side effects, keeping nothing."""
    deque(iterator, maxlen=0)


class DecodeBatch:
    """One planned step as columns: its sequences (every one running when it was
    planned), in running order, each feeding ``sizes`` tokens from ``starts`` and
    sampling.

    Made from a planned step (:meth:`of_step`, None unless it is such a step), moved
    on by :meth:`advance`. ``membership`` is the scheduler's when the step was planned.
    """

    __slots__ = ("limits", "membership", "outputs", "rows", "sampling", "seq_ids", "seqs",
                 "sizes", "starts", "state_slots", "stop_sets")  # fmt: skip

    def __init__(self, seqs: list[Sequence], step: StepInput, sizes: np.ndarray,
                 membership: Membership, limits: np.ndarray, rows: np.ndarray,
                 stop_sets: list) -> None:  # fmt: skip
        self.seqs = seqs
        self.seq_ids = step.seq_id
        self.starts = np.array(step.start_pos, np.int64)
        self.sizes = sizes
        self.outputs = np.array(step.num_output_tokens, np.int64)
        self.sampling = step.sampling
        self.state_slots = step.state_slot
        self.membership = membership
        self.limits = limits
        self.rows = rows
        self.stop_sets = stop_sets

    @classmethod
    def of_step(cls, seqs: list[Sequence], sizes: list[int], step: StepInput,
                num_running: int, membership: Membership) -> DecodeBatch | None:  # fmt: skip
        """The batch of a just planned step, if it is one: it holds ``num_running``
        sequences, every one that will still run when the next step is planned, and
        every row samples (and holds a persistent table row)."""
        n = len(seqs)
        if n != num_running or not all(step.sample):
            return None
        rows = np.fromiter(map(_table_row, seqs), np.int64, n)
        if n and rows.min() < 0:
            return None  # a table built by hand (tests): no row to gather from
        limits = np.fromiter(map(_length_limit, seqs), np.int64, n)
        return cls(seqs, step, np.array(sizes, np.int64), membership, limits, rows,
                   list(map(_stop_on, seqs)))

    def running_rows(self, now: Membership) -> list[bool] | None:
        """Which rows are still running (None: all of them, nobody left since)."""
        if now.departures == self.membership.departures:
            return None
        return [s is SequenceStatus.RUNNING for s in map(_status, self.seqs)]

    def advance(
        self,
        now: Membership,
        budget: int,
        in_flight: bool,
        block_size: int,
        tables: TableRows,
        make_room: Callable[[Sequence, int], bool],
    ) -> Continuation | None:
        """The next step of the rows still running, or None when the row loop must plan
        it (the budget does not cover every row, or making room preempted somebody).

        ``in_flight``: this batch's step is still running (asynchronous steps), so a row
        whose sample there is its last (its next start + 1 reaches its limit) has
        nothing to feed.
        ``make_room(seq, tokens)``: the scheduler's, for a row whose table is full.
        """
        starts = self.starts + self.sizes
        alive = self.running_rows(now)
        keep = None if alive is None else np.array(alive, bool)
        ending = 0
        if in_flight:
            done = starts + 1 >= self.limits
            if keep is not None:
                done &= keep
            ending = int(done.sum())
            if ending:
                keep = ~done if keep is None else keep & ~done
        cont = Continuation(self, starts, keep, in_flight, ending)
        if len(cont.seqs) > budget:
            return None
        rows = self.rows if keep is None else self.rows[keep]
        needs = np.flatnonzero(cont.starts + 1 > tables.lens[rows] * block_size)
        for i in needs.tolist():
            seq = cont.seqs[i]
            if not make_room(seq, int(cont.starts[i]) + 1 - seq.num_computed_tokens):
                return None
        return cont

    def apply(
        self,
        now: Membership,
        tokens: list[int],
        logprobs: list,
        tops: list,
        block_size: int,
        mark_computed: Callable[[Sequence, int], None],
        finish: Callable[[Sequence, str], None],
    ) -> None:
        """Apply this step's sampled tokens (one per row, in row order; nobody preempted
        since it was planned): each running row's computed count moves past the chunk
        it fed, the sampled token, logprob and top logprobs are recorded, and a row
        that ends is finished. A row that finished or was aborted since keeps nothing:
        its token was computed past its end.

        Rows whose chunk fills a block go through ``mark_computed`` (which
        publishes the block), and rows that end through ``finish``, one at a time in
        row order, as the row loop meets them; the others in C-level passes.
        """
        computed = self.starts + self.sizes  # every row fed its chunk
        fills = computed // block_size != self.starts // block_size
        # "stop" wins over "length" on the same token: the model ended on its own.
        stop = np.fromiter(map(frozenset.__contains__, self.stop_sets, tokens), bool,
                           len(tokens))  # fmt: skip
        length = computed + 1 >= self.limits  # the new token's length reaches the limit
        alive = self.running_rows(now)
        special_rows = fills | stop | length
        if alive is not None:
            gone = ~np.array(alive, bool)
            special_rows &= ~gone
        special = np.flatnonzero(special_rows).tolist()
        seqs = self.seqs
        plain_seqs, plain_computed = seqs, computed.tolist()
        plain_tokens, plain_logprobs, plain_tops = tokens, logprobs, tops
        if special or alive is not None:
            mask = [True] * len(seqs) if alive is None else alive
            for i in special:
                mask[i] = False
            plain_seqs = list(compress(seqs, mask))
            plain_computed = list(compress(plain_computed, mask))
            plain_tokens = list(compress(tokens, mask))
            plain_logprobs, plain_tops = list(compress(logprobs, mask)), list(compress(tops, mask))
        _consume(map(setattr, plain_seqs, repeat("num_computed_tokens"), plain_computed))
        _consume(map(list.append, map(_token_ids, plain_seqs), plain_tokens))
        _consume(map(list.append, map(_logprobs, plain_seqs), plain_logprobs))
        _consume(map(list.append, map(_top_logprobs, plain_seqs), plain_tops))
        for i in special:
            seq = seqs[i]
            if fills[i]:
                mark_computed(seq, int(self.sizes[i]))
            else:
                seq.num_computed_tokens = int(computed[i])
            seq.token_ids.append(tokens[i])
            seq.logprobs.append(logprobs[i])
            seq.top_logprobs.append(tops[i])
            if stop[i]:
                finish(seq, "stop")
            elif length[i]:
                finish(seq, "length")


class Continuation:
    """The step after a :class:`DecodeBatch`'s: its rows still running with a token
    left to feed (``keep``; None: every row), each from where its chunk ended."""

    __slots__ = ("batch", "ending", "in_flight", "keep", "keep_rows", "seqs", "starts")

    def __init__(self, batch: DecodeBatch, starts: np.ndarray, keep: np.ndarray | None,
                 in_flight: bool, ending: int) -> None:  # fmt: skip
        self.batch = batch
        #: the rows kept, as a mask for the arrays and as a list for ``compress``
        self.keep_rows = keep
        self.keep = None if keep is None else keep.tolist()
        self.in_flight = in_flight
        #: running rows left out because the step in flight samples their last token:
        #: they end when it is applied, before the next step is planned
        self.ending = ending
        self.seqs = batch.seqs if keep is None else list(compress(batch.seqs, self.keep))
        self.starts = starts if keep is None else starts[keep]

    def _pick(self, column: list) -> list:
        return list(column) if self.keep is None else list(compress(column, self.keep))

    def step(self, tables: TableRows) -> StepInput:
        """The step as the runner reads it, from the batch's columns."""
        batch, m = self.batch, len(self.seqs)
        if self.in_flight:
            tokens = [PLACEHOLDER_CHUNK] * m
        else:  # each feeds its newest token, sampled by the step just applied
            tokens = [(t[-1],) for t in map(_token_ids, self.seqs)]
        rows, outputs = batch.rows, batch.outputs + 1
        if self.keep_rows is not None:
            rows, outputs = rows[self.keep_rows], outputs[self.keep_rows]
        return StepInput(
            seq_id=self._pick(batch.seq_ids),
            token_ids=tokens,
            start_pos=self.starts.tolist(),
            block_table=tables.gather_rows(rows),
            state_slot=self._pick(batch.state_slots),
            sample=[True] * m,
            sampling=self._pick(batch.sampling),
            num_output_tokens=outputs.tolist(),
        )

    def batch_of(self, step: StepInput, membership: Membership) -> DecodeBatch:
        """The :class:`DecodeBatch` of ``step`` (this continuation's own), without
        reading the sequences again."""
        batch = self.batch
        rows, limits, stop_sets = batch.rows, batch.limits, batch.stop_sets
        if self.keep_rows is not None:
            rows, limits = rows[self.keep_rows], limits[self.keep_rows]
            stop_sets = list(compress(stop_sets, self.keep))
        return DecodeBatch(self.seqs, step, np.ones(len(self.seqs), np.int64), membership,
                           limits, rows, stop_sets)
