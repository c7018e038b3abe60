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
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from kvrunner.batch import SampledToken, StepInput
from kvrunner.config import SchedulerConfig
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvrunner.errors import RequestError


class Scheduler:
    """Decides which sequences run each step and with how many tokens.

    Protocol: ``schedule()`` then ``update()`` with the step's sampled tokens, strictly
    alternating (a step's chunks advance ``num_computed_tokens`` only in ``update``).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_id: int | Iterable[int] | None = None,
    ) -> None:
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
        # seq_id -> chunk length, for the step scheduled but not yet updated
        self._in_flight: dict[int, int] | None = None

    # -- requests ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request; raises ValueError (queue untouched) if it can never run."""
        self.validate(seq)
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
        if seq.status is not SequenceStatus.WAITING or seq.num_output_tokens or seq.block_table:
            raise RequestError(f"{name}: only a fresh sequence can be added")
        num_prompt = seq.num_prompt_tokens
        max_len = self.config.max_model_len
        if num_prompt == 0:
            raise RequestError(f"{name}: the prompt is empty")
        if num_prompt > max_len - 1:
            raise RequestError(
                f"{name}: prompt has {num_prompt} tokens but max_model_len={max_len} "
                f"allows at most {max_len - 1} (one token must be generated)"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and num_prompt > budget:
            raise RequestError(
                f"{name}: prompt has {num_prompt} tokens but max_num_batched_tokens={budget} "
                f"and chunked prefill is off"
            )
        # The last token is sampled, never fed, so it needs no KV.
        final_len = min(num_prompt + seq.sampling_params.max_tokens, max_len)
        bm = self.block_manager
        need = bm.blocks_needed(final_len - 1)
        if need > bm.num_blocks:
            raise RequestError(
                f"{name}: needs up to {need} KV blocks ({final_len - 1} tokens: prompt "
                f"{num_prompt} + max_tokens {seq.sampling_params.max_tokens}, capped by "
                f"max_model_len={max_len}) but the whole pool has {bm.num_blocks} blocks "
                f"of {bm.block_size} tokens; raise num_blocks (or the cache budget) or "
                f"lower max_tokens"
            )

    def abort(self, seq_id: int) -> Sequence | None:
        """Withdraw an unfinished request, freeing what it holds; None if unknown.

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
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return seq

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> tuple[StepInput, list[Sequence]] | None:
        """Pick this step's chunks; None when there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update() for the last step")
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preemptions_before = self.num_preemptions

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # Without chunked prefill a running sequence is only still prefilling when it
            # resumed with more tokens than a step may hold; chunking is its way through.
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, n):
                break  # seq preempted itself: it was the last running sequence
            scheduled.append((seq, n))
            budget -= n
            i += 1
        preempted = self.num_preemptions > preemptions_before

        # Admitting while another sequence just lost its blocks would only thrash.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            n = self._first_chunk(seq, budget)
            if n == 0 or not self.block_manager.can_allocate(seq, n):
                break  # FIFO: nobody overtakes the head of the queue
            self.block_manager.allocate(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n

        if not scheduled:
            return None
        self._in_flight = {seq.seq_id: n for seq, n in scheduled}
        return self._columns(scheduled), [seq for seq, _ in scheduled]

    def update(self, seqs: list[Sequence], sampled: list[SampledToken]) -> list[Sequence]:
        """Apply a finished step: advance computed tokens, append samples, finish.

        ``seqs`` is the list ``schedule()`` returned; ``sampled`` holds one token for
        every chunk that had ``sample=True`` (tokens for sequences aborted during the
        step are ignored). Returns the sequences that finished in this step.
        """
        if self._in_flight is None:
            raise RuntimeError("update() called without a scheduled step")
        in_flight = self._in_flight
        by_id = self._check_step_result(in_flight, seqs, sampled)
        self._in_flight = None

        finished: list[Sequence] = []
        for seq in seqs:
            if seq.is_finished:  # aborted while its step ran
                continue
            self.block_manager.mark_computed(seq, in_flight[seq.seq_id])
            token = by_id.get(seq.seq_id)
            if token is None:
                continue  # still prefilling
            seq.append_token(token.token_id, token.logprob, token.top_logprobs)
            reason = self._finish_reason(seq, token.token_id)
            if reason is not None:
                self.block_manager.free(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                del self._unfinished[seq.seq_id]
                finished.append(seq)
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
        return finished

    # -- internals --------------------------------------------------------------------

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

    @staticmethod
    def _columns(scheduled: list[tuple[Sequence, int]]) -> StepInput:
        """The step as columns (what the runner reads): sequence ``s`` feeds its ``n``
        tokens from ``num_computed_tokens`` on, and samples if they end its tokens."""
        return StepInput(
            seq_id=[s.seq_id for s, _ in scheduled],
            token_ids=[
                tuple(s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n])
                for s, n in scheduled
            ],
            start_pos=[s.num_computed_tokens for s, _ in scheduled],
            block_table=[tuple(s.block_table) for s, _ in scheduled],
            state_slot=[s.state_slot for s, _ in scheduled],
            sample=[s.num_computed_tokens + n == len(s.token_ids) for s, n in scheduled],
            sampling=[s.sampling_params for s, _ in scheduled],
            num_output_tokens=[s.num_output_tokens for s, _ in scheduled],
        )

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        # "stop" wins over "length" on the same token: the model ended on its own.
        params = seq.sampling_params
        is_eos = token_id in self.eos_token_ids
        if token_id in params.stop_token_ids or (is_eos and not params.ignore_eos):
            return "stop"
        if (
            seq.num_output_tokens >= params.max_tokens
            or seq.num_tokens >= self.config.max_model_len
        ):
            return "length"
        return None

    def _check_step_result(
        self, in_flight: dict[int, int], seqs: list[Sequence], sampled: list[SampledToken]
    ) -> dict[int, SampledToken]:
        """Validate update()'s arguments before anything changes; tokens by seq id."""
        ids = [s.seq_id for s in seqs]
        if sorted(ids) != sorted(in_flight):
            raise ValueError(f"update() got sequences {ids}, the step scheduled {list(in_flight)}")
        by_id: dict[int, SampledToken] = {}
        for token in sampled:
            if token.seq_id in by_id:
                raise ValueError(f"two sampled tokens for sequence {token.seq_id}")
            by_id[token.seq_id] = token
        for seq in seqs:
            if seq.is_finished:
                by_id.pop(seq.seq_id, None)
                continue
            samples = seq.num_computed_tokens + in_flight[seq.seq_id] == seq.num_tokens
            if samples and seq.seq_id not in by_id:
                raise ValueError(f"no sampled token for sequence {seq.seq_id}")
            if not samples and seq.seq_id in by_id:
                raise ValueError(f"sequence {seq.seq_id} was mid-prefill; it samples nothing")
        stray = set(by_id) - set(in_flight)
        if stray:
            raise ValueError(f"sampled tokens for sequences not in this step: {sorted(stray)}")
        return by_id
