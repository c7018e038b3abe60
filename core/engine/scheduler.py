"""Continuous batching with chunked prefill and preemption by recompute.

Each step: every RUNNING sequence gets its next chunk first (1 token when decoding,
the rest of its prefill when still prefilling), then WAITING sequences are admitted
in arrival order while ``max_num_seqs`` and ``max_num_batched_tokens`` allow.

Fairness: admission is strictly FIFO (the queue head blocks the ones behind it), so
every running sequence arrived before every waiting one. When a running sequence
needs a block and none is free, the most recently admitted running sequence - the
latest arrival - is preempted: freed, reset to 0 computed tokens and put back at the
*front* of the queue with its generated tokens kept, so re-admission recomputes its
KV (cheaply, if its own blocks are still in the prefix cache) and it carries on. An
earlier arrival is never preempted for a later one, so the oldest running sequence
always makes progress: ``add`` refuses any request that could not finish alone in
the whole pool.

Asynchronous steps: ``schedule()`` may run once more before ``update()`` of the step
in flight. It then plans from where that step leaves each sequence: its chunk counts
as computed, and the token it samples is fed as ``PLACEHOLDER_TOKEN`` (the runner
has it on the device). A sequence that step certainly ends (``max_tokens``,
``max_model_len``) is not scheduled again; one it ends by a stop token or EOS runs
one step too many, whose token ``update()`` discards. That step writes only KV slots
and a state slot the sequence still held when it was scheduled: freed ones are
handed out again only by a later ``schedule()``, whose steps run after it.

Every step is planned from the running batch (``running_batch.py``): the running
sequences' state as columns, changed in place where a sequence is admitted, moves
on, finishes, is aborted or is preempted. ``update()`` applies the plain rows of a
step (running, sampling, nothing to publish or finish) in C-level passes over those
columns and the step's own, and the others one at a time.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from itertools import compress, repeat
from operator import attrgetter

import numpy as np

from kvrunner.config import SchedulerConfig
from kvrunner.engine.admission import check_request
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.in_flight import InFlight, StepChunks, check_step_result
from kvrunner.engine.running_batch import RunningBatch
from kvrunner.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvrunner.engine.step_columns import step_columns
from kvrunner.engine.step_extras import StepExtras
from kvrunner.engine.step_io import (
    NONFINITE_CAUSES,
    SampledToken,
    SampledTokens,
    StepInput,
)

_token_ids = attrgetter("token_ids")
_logprobs = attrgetter("logprobs")
_top_logprobs = attrgetter("top_logprobs")


def _consume(iterator) -> None:
    """Run a C-level ``map`` for its side effects, keeping nothing."""
    deque(iterator, maxlen=0)


class Scheduler:
    """Decides which sequences run each step and with how many tokens, and applies
    what each step sampled.

    Protocol: ``schedule()`` then ``update()`` with the step's sampled tokens, in
    order; at most two steps in flight (a step's chunks advance
    ``num_computed_tokens`` only in ``update``). Synchronous engines alternate.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_id: int | Iterable[int] | None = None,
    ) -> None:
        if config.max_num_batched_tokens is None:
            raise ValueError(
                "the scheduler needs a resolved max_num_batched_tokens (the ranks resolve "
                "an unset one by device when they start); got None"
            )
        if config.max_model_len is None:
            raise ValueError(
                "the scheduler needs a resolved max_model_len (the ranks resolve an unset "
                "one from the model and the pool when they start); got None"
            )
        self.config = config
        self.block_manager = block_manager
        # Checkpoints may name several EOS ids (config and generation_config differ).
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset((eos_token_id,))
        else:
            self.eos_token_ids = frozenset(eos_token_id)
        self.waiting: deque[Sequence] = deque()
        #: the running sequences' columns; its ``seqs`` is :attr:`running`
        self.batch = RunningBatch()
        self.num_preemptions = 0
        self._unfinished: dict[int, Sequence] = {}
        #: prompt scores, routes and kept masses recorded on their requests
        self._extras = StepExtras(self._unfinished)
        self._arrivals = itertools.count()
        # the steps scheduled but not yet updated
        self._in_flight = InFlight()
        #: steps applied by ``update``, ever: a non-finite row's error names its step
        self.num_steps_applied = 0
        #: sampled rows whose logits were non-finite, each ending its request ("error")
        self.nonfinite_rows = 0

    @property
    def running(self) -> list[Sequence]:
        """The running sequences, in admission order (which is also arrival order, see
        the module docstring): the running batch's rows."""
        return self.batch.seqs

    # -- requests ---------------------------------------------------------------------

    def add(self, seq: Sequence, *, checked: bool = False) -> None:
        """Queue a new request; raises ValueError (queue untouched) if it can never run.

        :param checked: :meth:`validate` passed it already (``LLMEngine.make_request``
            checks each request as it makes it, naming it as its caller does): only
            its id is checked again, against the requests queued since.
        """
        if checked:
            self._check_id(seq, f"request {seq.seq_id}")
        else:
            self.validate(seq)
        seq.set_limits(eos_token_ids=self.eos_token_ids, max_model_len=self.config.max_model_len)
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)
        self._unfinished[seq.seq_id] = seq
        self._extras.admit(seq)

    def validate(self, seq: Sequence, *, name: str | None = None) -> None:
        """Raise RequestError naming the request and the limit if it can never run here.

        ``add`` calls this unless told it passed already; call it first yourself to
        check a whole batch of requests before queueing any of them (then ``add`` them
        with ``checked=True``).

        :param name: how the message names the request (default ``request <seq_id>``).
        """
        name = name or f"request {seq.seq_id}"
        self._check_id(seq, name)
        check_request(seq, self.config, self.block_manager, name)

    def _check_id(self, seq: Sequence, name: str) -> None:
        if seq.seq_id in self._unfinished:
            raise ValueError(f"{name}: a request with this id is already queued or running")

    def abort(self, seq_id: int, *, reason: FinishReason = "abort") -> Sequence | None:
        """Withdraw an unfinished request, freeing what it holds; None if unknown.

        ``reason`` is its finish reason: ``"stop"`` for one the engine ended on a stop
        string found after its token was applied.

        Safe between ``schedule()`` and ``update()``: ``update`` skips the sequence, and
        the step in flight only writes blocks it held alone (never a published prefix
        block), which nobody else gets before the next ``schedule()``.
        """
        seq = self._unfinished.pop(seq_id, None)
        if seq is None:
            return None
        self._extras.forget(seq_id)
        if seq.status is SequenceStatus.RUNNING:
            self._in_flight.renumber(self.batch.remove([self.running.index(seq)]))
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return seq

    def abort_all(self) -> list[Sequence]:
        """Withdraw every unfinished request (as :meth:`abort` does each); returns them."""
        return [seq for seq_id in list(self._unfinished) if (seq := self.abort(seq_id))]

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def unfinished_ids(self) -> list[int]:
        """The ids of the requests not yet finished, oldest first."""
        return list(self._unfinished)

    def forget_in_flight(self) -> int:
        """Drop every step in flight unapplied, once every request is withdrawn
        (:meth:`abort_all`): its tokens belong to nobody, and a step whose launch was
        interrupted has none. Returns how many were dropped."""
        if self._unfinished:
            raise RuntimeError("forget_in_flight() with requests unfinished: abort them first")
        dropped = len(self._in_flight)
        while len(self._in_flight):
            self._in_flight.pop_oldest()
        # (the running batch is empty: every request was withdrawn, its row with it)
        return dropped

    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> tuple[StepInput, list[Sequence]] | None:
        """Pick this step's chunks; None when there is nothing to run.

        With a step in flight, plan from where it leaves each sequence (see the
        module docstring).
        """
        if len(self._in_flight) > 1:
            raise RuntimeError("schedule() called again before update() for the last step")
        budget = self.config.max_num_batched_tokens
        batch = self.batch
        preemptions_before = self.num_preemptions
        rows, sizes, total = batch.chunks(budget)
        if len(rows):
            rows, sizes, total = self._make_rooms(rows, sizes, total)
        budget -= total
        preempted = self.num_preemptions > preemptions_before

        # Admitting while another sequence just lost its blocks would only thrash. (So
        # a sequence preempted with a step in flight is back in the queue only after
        # that step's update(): a waiting sequence is never in flight.)
        new_rows: list[int] = []
        new_sizes: list[int] = []
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            n = self._first_chunk(seq, budget)
            # A sample whose group's first sample is still computing the shared prompt
            # waits one step for it, then finds that prompt in the prefix cache.
            if n == 0 or seq.waits_for_prefix() or not self.block_manager.can_allocate(seq, n):
                break  # FIFO: nobody overtakes the head of the queue
            self.block_manager.allocate(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            new_rows.append(batch.append(seq))
            new_sizes.append(n)
            budget -= n
        if new_rows:
            rows = np.concatenate([rows, np.array(new_rows, np.intp)])
            sizes = np.concatenate([sizes, np.array(new_sizes, np.int64)])
        if not len(rows):
            return None
        step, seqs, starts, samples = step_columns(batch, rows, sizes,
                                                   self.block_manager.table_rows,
                                                   score_prompts=self._extras.score_prompts,
                                                   routes=self._extras.routes)  # fmt: skip
        self._in_flight.push(StepChunks(seqs, step.seq_id, rows, starts, sizes, samples,
                                        step.sample))  # fmt: skip
        return step, seqs

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
        tokens, logprobs, tops = check_step_result(chunks, seqs, sampled)
        self._in_flight.pop_oldest()
        masses = self._extras.record_before_apply(sampled)
        finished: list[Sequence] = []
        nonfinite = min(sampled.token_ids, default=0) < 0  # a code: see NONFINITE_CAUSES
        gone = self._apply(chunks, tokens, logprobs, tops, nonfinite, finished)
        if gone:
            self._in_flight.renumber(self.batch.remove(gone))
        self._extras.record_masses(masses)
        return finished

    # -- internals --------------------------------------------------------------------

    def _make_rooms(self, rows: np.ndarray, sizes: np.ndarray, total: int
                    ) -> tuple[np.ndarray, np.ndarray, int]:  # fmt: skip
        """Grow the tables of the planned ``rows`` whose chunk passes their last block,
        in row order, preempting latest arrivals where the pool is short; the rows
        still running, their chunks, and the tokens those feed (``total`` before)."""
        batch = self.batch
        block_size = self.block_manager.block_size
        at = slice(0, len(rows)) if batch.every_row(rows) else rows  # a slice is cheaper
        ends = batch.pos[at] + sizes
        lens = self.block_manager.table_rows.lens[batch.table_row[at]]
        short = ends > lens * block_size
        for k in np.flatnonzero(short).tolist() if short.any() else ():
            i = int(rows[k])
            if i >= len(batch):
                break  # preempted already, with every row after it
            seq = batch.seqs[i]
            if not self._make_room(seq, int(ends[k]) - seq.num_computed_tokens):
                break  # seq preempted itself: it was the last running sequence
        if int(rows[-1]) >= len(batch):
            keep = rows < len(batch)
            rows, sizes = rows[keep], sizes[keep]
            total = int(sizes.sum())
        return rows, sizes, total

    def _apply(self, chunks: StepChunks, tokens: list, logprobs: list, tops: list,
               nonfinite: bool, finished: list[Sequence]) -> list[int]:  # fmt: skip
        """Apply a step's tokens (aligned with its rows); the running batch's rows of the
        sequences that finished.

        A row is plain when its sequence still runs, its chunk fills no block and,
        if it sampled, its token is finite and ends nothing: plain rows get their
        computed count and token in C-level passes. Every other row, in row order:
        :meth:`_apply_row`. ``nonfinite``: some sampled token is a non-finite code."""
        batch = self.batch
        rows = chunks.rows
        block_size = self.block_manager.block_size
        starts = chunks.starts
        computed = starts + chunks.sizes
        sample = chunks.sample_mask
        running = None if chunks.intact else rows >= 0
        all_running = running is None or np.count_nonzero(running) == len(rows)
        every_row = all_running and batch.every_row(rows)
        if every_row:
            at = slice(0, len(rows))  # a slice is cheaper
        elif all_running:
            at = rows
        else:  # a gone row reads row 0's columns (or a cleared row's): it is special anyway
            at = np.where(running, rows, 0)
        # "stop" wins over "length" on the same token: the model ended on its own.
        if every_row:
            stop_on = batch.stop_on
        else:
            nothing: frozenset[int] = frozenset()  # a gone row's: it is special anyway
            stop_on = [batch.stop_on[i] if i >= 0 else nothing for i in rows.tolist()]
        stop = np.fromiter(map(frozenset.__contains__, stop_on, tokens), bool, len(tokens))
        # A row filling a block publishes it; a sampled token may reach the length limit.
        # (Every chunk fits its sequence's tokens and table: the plan made it so, and
        # mark_computed checks both again for a row that fills a block.)
        special = (computed % block_size < chunks.sizes) | stop  # passed a block's end
        length = computed + 1 >= batch.limit[at]
        special |= length if chunks.all_sample else sample & length
        if not all_running:
            special |= ~running
        if nonfinite:
            special |= np.fromiter((t is not None and t < 0 for t in tokens), bool, len(tokens))
        seqs = chunks.seqs
        special_rows = np.flatnonzero(special).tolist() if special.any() else []
        if special_rows:
            plain = (~special).tolist()
            plain_seqs = list(compress(seqs, plain))
            plain_computed = list(compress(computed.tolist(), plain))
            with_token = (sample & ~special).tolist()
            token_seqs = list(compress(seqs, with_token))
            tokens_, logprobs_, tops_ = (list(compress(c, with_token))
                                         for c in (tokens, logprobs, tops))
            # (a running row that fails ends, and its row goes with it)
            batch.applied(rows[sample if running is None else sample & running])
        else:
            plain_seqs, plain_computed = seqs, computed.tolist()
            if chunks.all_sample:
                token_seqs, tokens_, logprobs_, tops_ = seqs, tokens, logprobs, tops
            else:
                with_token = chunks.sample
                token_seqs = list(compress(seqs, with_token))
                tokens_, logprobs_, tops_ = (list(compress(c, with_token))
                                             for c in (tokens, logprobs, tops))
            batch.applied(rows if chunks.all_sample else rows[sample])
        _consume(map(setattr, plain_seqs, repeat("num_computed_tokens"), plain_computed))
        _consume(map(list.append, map(_token_ids, token_seqs), tokens_))
        _consume(map(list.append, map(_logprobs, token_seqs), logprobs_))
        _consume(map(list.append, map(_top_logprobs, token_seqs), tops_))
        gone: list[int] = []
        for k in special_rows:
            self._apply_row(chunks, k, tokens[k], logprobs[k], tops[k], finished, gone)
        return gone

    def _apply_row(self, chunks: StepChunks, k: int, token: int | None,
                   logprob: float | None, top: dict | None, finished: list[Sequence],
                   gone: list[int]) -> None:  # fmt: skip
        """Apply row ``k`` of a step on its own: a sequence that left ``running`` since
        (finished: nothing; preempted: its token stands), a non-finite sample, a chunk
        that fills a block, a token that ends its request. A sequence it finishes
        while running adds its batch row to ``gone``."""
        seq = chunks.seqs[k]
        status = seq.status
        if status is SequenceStatus.FINISHED:
            return  # aborted, or ended one step early: a token past the end
        row = int(chunks.rows[k])
        if token is not None and token < 0:
            # Non-finite logits: the request ends and keeps nothing of this step
            # (no token, no logprob, no computed count: its KV may be poisoned).
            self._fail(seq, token, finished)
            if status is SequenceStatus.RUNNING:
                gone.append(row)
            return
        if status is SequenceStatus.RUNNING:  # else preempted since: its token stands
            n = int(chunks.sizes[k])
            computed = seq.num_computed_tokens + n
            if (
                computed // self.block_manager.block_size
                == (computed - n) // self.block_manager.block_size
                and computed <= len(seq.token_ids)
                and computed <= len(seq.block_table) * self.block_manager.block_size
            ):
                seq.num_computed_tokens = computed  # no block filled: nothing to publish
            else:
                self.block_manager.mark_computed(seq, n)
        if token is None:
            return  # still prefilling
        token_ids = seq.token_ids
        token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.top_logprobs.append(top)
        # "stop" wins over "length" on the same token: the model ended on its own.
        if token in seq.stop_on:
            reason: FinishReason = "stop"
        elif len(token_ids) >= seq.length_limit:
            reason = "length"
        else:
            return
        self._finish(seq, reason, finished)
        if status is SequenceStatus.RUNNING:
            gone.append(row)

    def _fail(self, seq: Sequence, code: int, finished: list[Sequence]) -> None:
        """End ``seq`` with ``"error"``: its row in the step just applied was non-finite
        (``code``, one of :data:`~kvrunner.engine.step_io.NONFINITE_CAUSES`)."""
        position = len(seq.token_ids) - seq.num_prompt_tokens
        seq.error = (
            f"step {self.num_steps_applied} (output token {position}): {NONFINITE_CAUSES[code]}"
        )
        self.nonfinite_rows += 1
        self._finish(seq, "error", finished)

    def _finish(self, seq: Sequence, reason: FinishReason, finished: list[Sequence]) -> None:
        """End ``seq`` with ``reason``: free what it holds (or take it off the queue,
        if it was preempted while its last step ran). The caller drops its row from
        the running batch."""
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._unfinished[seq.seq_id]
        self._extras.forget(seq.seq_id)
        finished.append(seq)

    def _make_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Get blocks for ``seq``'s chunk, preempting latest arrivals; False if ``seq``
        itself had to go."""
        while not self.block_manager.ensure_slots(seq, num_new_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def retract_running(self) -> int:
        """Send every running sequence back to the front of the queue, in admission
        order, its blocks and state slot freed: each is recomputed (prompt and the
        tokens it has) when re-admitted. Only with no step in flight. Returns how many."""
        if len(self._in_flight):
            raise RuntimeError("retract_running() with a step in flight: settle first")
        count = len(self.running)
        while self.running:
            self._preempt(self.running[-1])
        self.num_preemptions -= count  # asked for, not forced by a full pool
        return count

    def _preempt(self, seq: Sequence) -> None:
        assert self.running[-1] is seq, "only the latest admitted sequence is preempted"
        n = len(self.running) - 1
        self.batch.truncate(n)
        self._in_flight.renumber(n)
        self.block_manager.free(seq)  # also resets num_computed_tokens to 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _first_chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens a waiting sequence computes on admission (0: it must wait)."""
        remaining = seq.num_tokens - self.block_manager.num_cached_tokens(seq)
        if remaining <= budget:
            return remaining
        if self.config.enable_chunked_prefill:
            return budget
        # A prompt must fit whole; only a resumed sequence that outgrew the budget
        # altogether (add() refuses such prompts) is chunked, or it could never resume.
        return budget if remaining > self.config.max_num_batched_tokens else 0
