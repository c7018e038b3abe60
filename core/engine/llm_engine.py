"""The engine loop: schedule, let the runner compute, feed tokens back.

The engine decides who runs; it hands the runner plain ``StepInput`` data and gets
the sampled tokens back as plain columns (``SampledTokens``), so the runner can live
in another process.

Asynchronous steps (``scheduler.async_scheduling``, the default): each ``step()``
schedules and launches step N+1 *before* it waits for step N's tokens, so the host's
scheduling, step preparation and bookkeeping overlap the device's work. The tokens
step N samples stay on the device and feed step N+1 there (placeholders in its
``StepInput``); the host learns them one step later, in ``update``, which also
discards any token computed past a request's end. While a request under a
structured-output constraint is live the steps are synchronous instead: its next mask
needs its last token (``engine/step_grammars.py``). Such a request's grammar is
compiled off the engine's thread: it waits, outside the scheduler, until its grammar
is ready, while the other requests step on (``engine/grammar_compiles.py``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence as Seq
from typing import Any, Protocol

import attrs

from kvrunner.config import EngineConfig
from kvrunner.engine.block_manager import BlockManager
from kvrunner.engine.cache_salt import WeightVersion, check_cache_salt
from kvrunner.engine.logit_rules import bad_word_token_ids
from kvrunner.engine.scheduler import Scheduler
from kvrunner.engine.sequence import Sequence, SequenceStatus
from kvrunner.engine.step_grammars import StepGrammars
from kvrunner.engine.step_io import SampledToken, SampledTokens, StepInput
from kvrunner.engine.stop_strings import StopStringWatch
from kvrunner.errors import NonFiniteLogitsError, RequestError
from kvrunner.sampling_params import SamplingParams
from kvrunner.unicode_text import lone_surrogate

#: the longest a step with nothing to run but grammars being compiled waits for one of
#: them (then it returns, so that the caller's loop can look at its commands)
GRAMMAR_WAIT_S = 0.02

#: a step's sampled tokens as an executor answers them: the runner's columns, or (an
#: executor of the tests') one ``SampledToken`` per row; ``Scheduler.update`` reads both
Sampled = SampledTokens | list[SampledToken]


def group_size(params: SamplingParams) -> int:
    """How many samples (sequences) one request with ``params`` is: the group
    :meth:`LLMEngine.make_group` makes."""
    return params.n


class PendingTokens(Protocol):
    """A launched step's tokens, which ``result()`` waits for."""

    def result(self) -> Sampled: ...


class Executor(Protocol):
    """What the engine needs from the runner side (one runner or a TP group).

    ``submit`` (optional) launches a step and returns at once; an executor without it
    is driven through ``execute``, which returns the tokens.
    """

    num_blocks: int

    def execute(self, step: StepInput) -> Sampled: ...


@attrs.frozen
class _Done:
    """Tokens already in hand (an executor without ``submit``)."""

    tokens: Sampled

    def result(self) -> Sampled:
        return self.tokens


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        uses_state_slots: bool,
        tokenizer: Any | None = None,
    ) -> None:
        """:param tokenizer: the model's ``tokenizers.Tokenizer``, for stop strings
        (None: a request with stop strings is refused)."""
        self.config = config
        self.tokenizer = tokenizer
        # the unfinished requests with stop strings, by id: only these are decoded
        self._watched: dict[int, Sequence] = {}
        self.executor = executor
        self.vocab_size = vocab_size
        # The block manager is built on the count the runner derived and agreed on:
        # the engine never sizes anything itself.
        self.block_manager = BlockManager(
            num_blocks=executor.num_blocks,
            block_size=config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            num_state_slots=config.scheduler.max_num_seqs if uses_state_slots else 0,
            salt_by_weight_version=config.cache.salt_prefix_cache_by_weight_version,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, eos_token_id=eos_token_ids)
        #: the constrained requests' matchers (``SamplingParams.structured_outputs``)
        self.grammars = StepGrammars(tokenizer, vocab_size, eos_token_ids)
        self._ids = itertools.count()
        self.peak_blocks_used = 0  # most KV blocks in use after any step, since reset
        self.async_scheduling = config.scheduler.async_scheduling
        # launched steps whose tokens the host has not applied yet, oldest first (at
        # most one between two step() calls; two inside an asynchronous step())
        self._launched: deque[tuple[list[Sequence], PendingTokens]] = deque()
        #: requests are parked (``park``): they keep their KV blocks and state slots,
        #: nothing is in flight, and ``step`` refuses until ``unpark``
        self.parked = False
        #: weight updates completed since start (the default version of the next)
        self.num_weight_updates = 0

    @property
    def weight_version(self) -> WeightVersion:
        """The version of the weights the runner holds: 0 at start, then what the last
        completed update named (unnamed: the count of updates, 1, 2, ...)."""
        return self.block_manager.weight_version

    def weights_changed(self, version: WeightVersion | None = None) -> WeightVersion:
        """Record a completed weight update; returns the version now in force. Requests
        admitted from here on are keyed under it (``BlockManager``); running ones keep
        the version they were admitted under."""
        self.num_weight_updates += 1
        new = self.num_weight_updates if version is None else version
        self.block_manager.weight_version = new
        return new

    def make_request(
        self, token_ids: Seq[int], params: SamplingParams, index: int | str, *,
        cache_salt: str | None = None,
    ) -> Sequence:
        """A checked, not yet queued request of one sample; raises ``RequestError``
        naming it as ``request <index>`` (its position in a call, or its request id).

        Every check a request needs is made here, once: the prompt's token ids against
        the vocabulary, what ``SamplingParams`` cannot know itself (the vocabulary,
        ``max_logprobs``, a tokenizer for stop strings; it checked its own fields when
        it was built), the ``cache_salt`` (``engine/cache_salt.py``), then the
        scheduler's limits (``Scheduler.validate``: an empty prompt, one past
        ``max_model_len - 1``, the token budget, the pool).
        :meth:`add_request` queues the request without checking it again.
        """
        name = f"request {index}"
        cache_salt = check_cache_salt(cache_salt, name)
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"{name}: token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        # SamplingParams cannot know the vocabulary; an id past it could never match,
        # so the stop the caller asked for would silently never happen.
        stops = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if stops:
            raise RequestError(
                f"{name}: SamplingParams.stop_token_ids {stops[:5]} outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        for field, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                           ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = [t for t in ids if t >= self.vocab_size]
            if outside:
                raise RequestError(
                    f"{name}: SamplingParams.{field} token id(s) {outside[:5]} outside the "
                    f"vocabulary [0, {self.vocab_size})"
                )
        bad_word_ids = self._bad_word_ids(params, name)
        if params.n != 1:
            raise RequestError(
                f"{name}: SamplingParams.n={params.n} asks for a group of samples; make "
                f"them with make_group (one request is one sample)"
            )
        cap = self.config.scheduler.max_logprobs
        for field in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, field)
            if asked is not None and asked > cap:
                raise RequestError(
                    f"{name}: SamplingParams.{field}={asked} exceeds "
                    f"max_logprobs={cap} (raise the max_logprobs setting to allow it)"
                )
        if params.return_routed_experts and not self.config.enable_return_routed_experts:
            raise RequestError(
                f"{name}: SamplingParams.return_routed_experts needs an engine started with "
                f"enable_return_routed_experts=True (a mixture-of-experts model), which "
                f"records every token's experts"
            )
        watch = None
        if params.stop:
            if self.tokenizer is None:
                raise RequestError(
                    f"{name}: SamplingParams.stop {list(params.stop)[:3]!r} needs "
                    f"a tokenizer to find stop strings in the text, but this model has none "
                    f"(no tokenizer.json, or skip_tokenizer_init is set); use "
                    f"stop_token_ids instead"
                )
            watch = StopStringWatch(self.tokenizer, params.stop,
                                    include_stop=params.include_stop_str_in_output,
                                    skip_special_tokens=params.skip_special_tokens)
        self.grammars.check(params, name)
        seq = Sequence(next(self._ids), list(token_ids), params, stop_watch=watch,
                       bad_word_ids=bad_word_ids, cache_salt=cache_salt, name=name)
        self.scheduler.validate(seq, name=name)
        return seq

    def _bad_word_ids(self, params: SamplingParams, name: str) -> tuple[tuple[int, ...], ...]:
        """``params.bad_words`` as token ids, checked against the vocabulary."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise RequestError(
                f"{name}: SamplingParams.bad_words {list(params.bad_words)[:3]!r} needs a "
                f"tokenizer to find the words' tokens, but this model has none (no "
                f"tokenizer.json, or skip_tokenizer_init is set); use logit_bias instead"
            )
        for word in params.bad_words:
            found = lone_surrogate(word)
            if found is not None:
                raise RequestError(f"{name}: SamplingParams.bad_words {word!r} {found}")
        ids = bad_word_token_ids(self.tokenizer, params.bad_words)
        outside = [t for word in ids for t in word if not 0 <= t < self.vocab_size]
        if outside or not all(ids):
            raise RequestError(
                f"{name}: SamplingParams.bad_words tokenize to id(s) {outside[:5]} outside "
                f"the vocabulary [0, {self.vocab_size})" if outside else
                f"{name}: SamplingParams.bad_words holds a word with no tokens"
            )
        return ids

    def make_group(
        self, token_ids: Seq[int], params: SamplingParams, index: int | str, *,
        cache_salt: str | None = None,
    ) -> list[Sequence]:
        """The samples of one request, checked and not yet queued: ``group_size(params)``
        of them, sample ``k`` with ``params.for_sample(k)``; raises ``RequestError``
        naming ``index`` (see :meth:`make_request`). Every sample has ``cache_salt``.

        This is where a request's ``n`` is dealt with; everything else asks the group
        it returns (or :func:`group_size`). Samples after the first wait for the first
        one's prefill (see ``Sequence.waits_for_prefix``) when the prefix cache can
        share a block of the prompt: queue every group's first sample before the
        others, or a waiting sample holds up the queue behind it for that step.
        """
        first = self.make_request(token_ids, params.for_sample(0), index, cache_salt=cache_salt)
        group = [first]
        shares = (
            self.block_manager.enable_prefix_caching
            and len(token_ids) - 1 >= self.block_manager.block_size
        )
        for k in range(1, group_size(params)):
            seq = self.make_request(token_ids, params.for_sample(k), index,
                                    cache_salt=cache_salt)
            seq.sample_index = k
            seq.prefix_leader = first if shares else None
            group.append(seq)
        return group

    def add_request(self, seq: Sequence) -> None:
        """Queue a request :meth:`make_request` (or :meth:`make_group`) made and checked.

        A request with ``structured_outputs`` first waits for its grammar, compiled off
        this thread; a later :meth:`step` queues it once the grammar is ready, or ends
        it with ``"error"`` when its constraint could not be parsed or compiled."""
        if seq.sampling_params.structured_outputs is not None and seq.grammar is None:
            self.grammars.start(seq, seq.name or f"request {seq.seq_id}")
            return
        self._queue(seq)

    def _queue(self, seq: Sequence) -> None:
        self.scheduler.add(seq, checked=True)
        if seq.stop_watch is not None:
            self._watched[seq.seq_id] = seq

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar to compile (not yet in the scheduler)."""
        return len(self.grammars.compiles)

    def abort_request(self, seq_id: int) -> Sequence | None:
        """Withdraw request ``seq_id`` (finish reason ``"abort"``), freeing its blocks
        and state slot at once; None if it is unknown or already finished. A request
        waiting for its grammar stops waiting (the compile's result is discarded).

        Safe with a step in flight: that step's token for it is dropped when the step
        is applied (``Scheduler.abort``)."""
        waiting = self.grammars.forget(seq_id)
        if waiting is not None:
            waiting.status, waiting.finish_reason = SequenceStatus.FINISHED, "abort"
            return waiting
        return self.scheduler.abort(seq_id)

    def abort_all(self) -> list[Sequence]:
        """Withdraw every unfinished request, those waiting for their grammar too (as
        :meth:`abort_request` does each); returns them."""
        waiting = self.grammars.clear()
        for seq in waiting:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return waiting + self.scheduler.abort_all()

    def step(self) -> list[Sequence]:
        """Run one scheduled step; returns the sequences that finished in it.

        With asynchronous steps: launch the next step, then apply the one launched
        before it (so the sequences returned finished one step back). While a
        constrained request is live: apply the step in flight, then launch and apply
        the next (each mask needs the token before it).

        An exception out of here (a failed rank) leaves the steps in flight
        unapplied: :meth:`abort_and_settle` then makes the engine usable again. A
        Ctrl-C must not land inside: a driver on the main thread holds it to the step's
        end (``held_sigint.SigintAtStepEnd``, as ``LLM.generate`` does); mid-step it
        can leave a request half admitted, which no abort undoes.
        """
        if self.parked:
            raise RuntimeError("step() while the engine is parked: unpark() first")
        finished: list[Sequence] = []
        failed: list[Sequence] = []  # constraints that did not compile
        if self.grammars.compiles:
            for seq in self.grammars.ready(failed):
                self._queue(seq)
        synchronous = not self.async_scheduling or self.grammars.live
        if synchronous and self._launched:
            finished = self._apply_oldest()
        scheduled = self.scheduler.schedule()
        if scheduled is not None:
            step, seqs = scheduled
            if self.grammars.live:
                step = self.grammars.constrain(step, seqs)
            self._launched.append((seqs, self._submit(step)))
            self._note_blocks_used()
        if self._launched and (synchronous or len(self._launched) > 1 or scheduled is None):
            finished += self._apply_oldest()
        elif scheduled is None and not self._launched and not failed and self.grammars.compiles:
            self.grammars.compiles.wait(GRAMMAR_WAIT_S)  # nothing else to do: no spinning
        self._raise_nonfinite(finished)
        return failed + finished

    def settle(self) -> list[Sequence]:
        """Apply the step in flight, if any, and launch none; returns the sequences
        that finished in it. Afterwards every unfinished request's KV and state are
        written up to its last applied token and nothing runs on the device."""
        finished: list[Sequence] = []
        while self._launched:
            finished += self._apply_oldest()
        self._raise_nonfinite(finished)
        return finished

    def park(self) -> list[Sequence]:
        """Settle, then hold every unfinished request where it is (``step`` refuses)
        until :meth:`unpark`: the requests keep their blocks and state slots, so
        the weights may change under them; returns the sequences that finished."""
        finished = self.settle()
        self.parked = True
        return finished

    def retract(self) -> list[Sequence]:
        """Settle, send every running request back to the queue with its KV blocks and
        state slot freed, and hold them (``step`` refuses) until :meth:`unpark`: each
        is then recomputed from its prompt and the tokens it has, under whatever
        weights are loaded by then. Returns the sequences that finished settling."""
        finished = self.settle()
        self.scheduler.retract_running()
        self.parked = True
        return finished

    def unpark(self) -> None:
        """Let parked requests run again (from their next token, no recompute)."""
        self.parked = False

    def _apply_oldest(self) -> list[Sequence]:
        seqs, pending = self._launched[0]
        tokens = pending.result()
        self._launched.popleft()  # only once read: an interrupted read is settled later
        finished = self.scheduler.update(seqs, tokens)
        if self.grammars.live:
            self.grammars.advance(self.scheduler.abort, finished)
        if self._watched:
            self._find_stop_strings(finished)
        return finished

    def _raise_nonfinite(self, finished: list[Sequence]) -> None:
        if self.config.scheduler.nonfinite == "raise":
            failed = {s.seq_id: s.error for s in finished if s.finish_reason == "error"}
            if failed:
                self.abort_and_settle()
                raise NonFiniteLogitsError(failed)

    def _find_stop_strings(self, finished: list[Sequence]) -> None:
        """Decode the watched requests' new tokens; end each whose text now holds a
        stop string (finish reason ``"stop"``, added to ``finished``), dropping any
        token after the one that completed it.

        A request that just ended on a stop token or EOS is not searched in that
        token's text (as vLLM does); one that just reached its length limit is, and a
        stop string there makes its finish reason ``"stop"``.
        """
        for seq_id, seq in list(self._watched.items()):
            watch = seq.stop_watch
            assert watch is not None
            reason = seq.finish_reason
            if reason == "abort" or reason == "error":
                del self._watched[seq_id]
                continue
            upto = seq.num_output_tokens - (reason == "stop")
            if watch.feed(seq.token_ids, seq.num_prompt_tokens, upto, final=reason is not None):
                if reason is None:
                    # Safe with a step in flight: its token for seq is dropped (see
                    # Scheduler.abort).
                    self.scheduler.abort(seq_id, reason="stop")
                    finished.append(seq)
                seq.finish_reason = "stop"
                seq.stop_string = watch.matched
                keep = seq.num_prompt_tokens + watch.num_seen
                del seq.token_ids[keep:]
                del seq.logprobs[watch.num_seen:], seq.top_logprobs[watch.num_seen:]
                del seq.kept_mass[watch.num_seen:]
                del self._watched[seq_id]
            elif reason is not None:
                del self._watched[seq_id]

    def abort_and_settle(self) -> list[Sequence]:
        """Abort every unfinished request (freeing its blocks and state slots) and settle
        every launched step, leaving the engine empty and ready for the next call.

        For after an exception escaped :meth:`step` (a Ctrl-C held to a step's end
        included), whichever step it ended: the scheduler forgets the steps in flight,
        whose tokens now belong to nobody, then the executor waits for every answer
        still owed (so a tensor-parallel group is back in step and the device is done
        with the steps).
        Returns the requests aborted. An executor failure while settling (a rank that
        really died) is raised.
        """
        aborted = self.abort_all()
        self.scheduler.forget_in_flight()  # host state first: then a second Ctrl-C
        launched, self._launched = list(self._launched), deque()  # finds it clean
        self._watched.clear()
        self.parked = False
        settle = getattr(self.executor, "settle", None)
        if settle is not None:
            settle()
        else:  # an executor of the tests': its handles hold the tokens already
            for _, pending in launched:
                pending.result()
        return aborted

    def has_unfinished(self) -> bool:
        """Requests not yet finished (those waiting for their grammar too), or a
        launched step not yet applied."""
        return (self.scheduler.has_unfinished() or bool(self._launched)
                or bool(self.grammars.compiles))

    def _submit(self, step: StepInput) -> PendingTokens:
        submit = getattr(self.executor, "submit", None)
        return submit(step) if submit is not None else _Done(self.executor.execute(step))

    def _note_blocks_used(self) -> None:
        used = self.block_manager.num_blocks - self.block_manager.num_free_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, used)
