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

When every row of a step samples (a decode step, or one whose new requests prefill
whole prompts), its columns are kept (``decode_batch.py``): the next step's chunks
for those rows, and the step's update, are derived from them. The row loops below
plan and apply every other step, and are what those columns are tested against.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from kvrunner.batch import NONFINITE_CAUSES, SampledToken, SampledTokens, StepInput
from kvrunner.config import SchedulerConfig
from kvrunner.engine.admission import check_request
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.decode_batch import DecodeBatch, Membership
from kvrunner.engine.in_flight import InFlight, StepChunks, check_step_result
from kvrunner.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvrunner.engine.step_columns import step_columns


class Scheduler:
    """Decides which sequences run each step and with how many tokens.

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
        #: in admission order, which is also arrival order (see the module docstring)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._unfinished: dict[int, Sequence] = {}
        self._arrivals = itertools.count()
        # the steps scheduled but not yet updated
        self._in_flight = InFlight()
        #: plan and apply steady decode steps from the last step's columns
        #: (``decode_batch.py``); False runs the row loops they must equal
        self.use_columns = True
        #: sequences that left ``running``, ever (``membership``)
        self.departures = 0
        # the last planned step's columns, if it was a steady decode step
        self._batch: DecodeBatch | None = None
        #: steps applied by ``update``, ever: a non-finite row's error names its step
        self.num_steps_applied = 0
        #: sampled rows whose logits were non-finite, each ending its request ("error")
        self.nonfinite_rows = 0

    # -- requests ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request; raises ValueError (queue untouched) if it can never run."""
        self.validate(seq)
        seq.set_limits(eos_token_ids=self.eos_token_ids, max_model_len=self.config.max_model_len)
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)
        self._unfinished[seq.seq_id] = seq

    def validate(self, seq: Sequence, *, name: str | None = None) -> None:
        """Raise RequestError naming the request and the limit if it can never run here.

        ``add`` calls this; call it first yourself to check a whole batch of requests
        before queueing any of them.

        :param name: how the message names the request (default ``request <seq_id>``).
        """
        name = name or f"request {seq.seq_id}"
        if seq.seq_id in self._unfinished:
            raise ValueError(f"{name}: a request with this id is already queued or running")
        check_request(seq, self.config, self.block_manager, name)

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
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
            self.departures += 1
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

    def forget_in_flight(self) -> int:
        """Drop every step in flight unapplied, once every request is withdrawn
        (:meth:`abort_all`): its tokens belong to nobody, and a step whose launch was
        interrupted has none. Returns how many were dropped."""
        if self._unfinished:
            raise RuntimeError("forget_in_flight() with requests unfinished: abort them first")
        dropped = len(self._in_flight)
        while len(self._in_flight):
            self._in_flight.pop_oldest()
        self._batch = None  # the next step is planned afresh
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
        newest = self._in_flight.newest()
        preemptions_before = self.num_preemptions
        # After a step whose every row sampled, this one's rows follow from its
        # columns; anything else (and a plan that preempted) is planned row by row.
        continued = None
        batch, self._batch = self._batch, None
        if batch is not None:
            continued = batch.advance(self.membership, budget, newest is not None,
                                      self.block_manager.block_size,
                                      self.block_manager.table_rows, self._room_or_stop)
        if continued is not None:
            seqs, starts = list(continued.seqs), continued.starts.tolist()
            sizes, samples = [1] * len(seqs), [True] * len(seqs)
            pending = [1 if newest is not None else 0] * len(seqs)
        else:
            seqs, sizes, starts, pending, samples = self._plan_by_row(
                budget,
                newest.num_tokens if newest is not None else {},
                newest.samples if newest is not None else set(),
            )
        budget -= sum(sizes)
        preempted = self.num_preemptions > preemptions_before

        # Admitting while another sequence just lost its blocks would only thrash. (So
        # a sequence preempted with a step in flight is back in the queue only after
        # that step's update(): a waiting sequence is never in flight.)
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
            self.running.append(seq)
            seqs.append(seq)
            sizes.append(n)
            starts.append(seq.num_computed_tokens)
            pending.append(0)
            samples.append(seq.num_computed_tokens + n == seq.num_tokens)
            budget -= n

        if not seqs:
            return None
        tables = self.block_manager.table_rows
        if continued is not None and len(seqs) == len(continued.seqs):  # nobody admitted
            step = continued.step(tables)
            # Rows it left out are gone, or end when the step in flight is applied.
            self._batch = continued.batch_of(step, self.membership)
        else:
            step = step_columns(seqs, sizes, starts, pending, samples, tables)
            if self.use_columns:
                # Rows the continuation left out end with the step in flight.
                staying = len(self.running) - (continued.ending if continued else 0)
                self._batch = DecodeBatch.of_step(seqs, sizes, step, staying,
                                                  self.membership)  # fmt: skip
        self._in_flight.push(StepChunks(seqs, step.seq_id, sizes, samples, self._batch))
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

    # -- internals --------------------------------------------------------------------

    def _plan_by_row(
        self, budget: int, fed_ahead: dict[int, int], sampling_ahead: set[int]
    ) -> tuple[list[Sequence], list[int], list[int], list[int], list[bool]]:
        """The running sequences' chunks, one row at a time: per row the sequence,
        tokens it feeds, from where (after what the step in flight feeds), 1 if the
        step in flight samples for it, whether this step samples.

        Every lookup it repeats per sequence is a local or a field cached on the
        sequence (``length_limit``), not a property call. A preemption pops
        ``running``'s tail, which simply ends the iteration there.
        """
        seqs: list[Sequence] = []
        sizes: list[int] = []
        starts: list[int] = []
        pending: list[int] = []
        samples: list[bool] = []
        block_size = self.block_manager.block_size
        for seq in self.running:
            if budget <= 0:
                break
            seq_id = seq.seq_id
            known = len(seq.token_ids)
            ahead = 0
            if seq_id in sampling_ahead:
                if known + 1 >= seq.length_limit:
                    continue  # the step in flight samples its last token: nothing to feed
                ahead = 1
            start = seq.num_computed_tokens + fed_ahead.get(seq_id, 0)
            # Without chunked prefill a running sequence is only still prefilling when it
            # resumed with more tokens than a step may hold; chunking is its way through.
            n = min(known + ahead - start, budget)
            if start + n > len(seq.block_table) * block_size and not self._make_room(
                seq, start + n - seq.num_computed_tokens
            ):
                break  # seq preempted itself: it was the last running sequence
            seqs.append(seq)
            sizes.append(n)
            starts.append(start)
            pending.append(ahead)
            samples.append(start + n == known + ahead)
            budget -= n
        return seqs, sizes, starts, pending, samples

    @property
    def membership(self) -> Membership:
        """Departures and preemptions so far (``decode_batch.py``)."""
        return Membership(self.departures, self.num_preemptions)

    def _room_or_stop(self, seq: Sequence, num_new_tokens: int) -> bool:
        """:meth:`_make_room`, False as soon as it preempts anybody: a plan from the
        last step's columns no longer holds, and the row loop re-plans (the rooms
        already made stand: growing a table is idempotent)."""
        before = self.num_preemptions
        return self._make_room(seq, num_new_tokens) and self.num_preemptions == before

    def _make_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Get blocks for ``seq``'s chunk, preempting latest arrivals; False if ``seq``
        itself had to go."""
        while not self.block_manager.ensure_slots(seq, num_new_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        assert self.running[-1] is seq, "only the latest admitted sequence is preempted"
        self.running.pop()
        self.departures += 1
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
