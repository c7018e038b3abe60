"""The running batch: every running sequence's scheduling state, as columns kept in place.

Row ``i`` of every column is ``seqs[i]``, the ``i``-th running sequence in admission
order (which is arrival order: see ``scheduler.py``). The scheduler plans each step
from these columns in a few numpy passes instead of reading a dozen fields off every
``Sequence``, and a step's columns are gathered from them. They are changed in place,
and only where the scheduler changes who runs or where they are:

* admission appends a row (:meth:`RunningBatch.append`), read off the sequence once,
  its sampling settings included (the step's :class:`SamplingColumns` are gathered
  from those columns: :meth:`RunningBatch.sampling_columns`);
* a planned step moves its rows on (:meth:`RunningBatch.advance`): each row's next
  chunk starts where this one ends, and a row that samples has one more token coming;
* a request with logit adjustments gets its
  :class:`~kvrunner.engine.logit_rules.LogitRules` at admission (:attr:`RunningBatch.rules`)
  and, when they read its tokens, a token-history row on the runner, freed with its
  row: the next step to carry it restarts that history from the request's tokens
  (:meth:`RunningBatch.take_history_init`);
* applying a step's samples takes them off the rows' count of samples in flight
  (:meth:`RunningBatch.applied`);
* a finish or an abort removes its rows (:meth:`RunningBatch.remove`, order kept), a
  preemption cuts the tail (:meth:`RunningBatch.truncate`); either clears the rows
  it frees and returns where every remaining row went, so the steps in flight can
  follow their rows.

What a row holds is what the sequence's own fields say plus what the steps in flight
add to it; ``tests/core/engine/engine_sim.py`` checks exactly that after every step.
"""

from __future__ import annotations

from itertools import compress

import numpy as np

from kvrunner.engine.logit_rules import LogitRules, logit_rules, needs_history
from kvrunner.engine.sequence import Sequence
from kvrunner.engine.step_io import SAMPLING_DTYPES, SamplingColumns, sampling_row

#: rows the columns start with; they double when outgrown
_INITIAL_ROWS = 64


class RunningBatch:
    """The running sequences' columns (rows ``0 .. len - 1``; every row past them is
    clear: zeros; ``-1`` table row, state slot, logprobs and prompt logprobs).

    ``pos``: where the row's next chunk starts (``num_computed_tokens`` plus what the
    steps in flight feed it). ``tokens``: how many tokens it has once the steps in
    flight are applied (``len(token_ids)`` plus ``pending``). ``pending``: steps in
    flight that sample for it. ``prompt``, ``limit``: ``num_prompt_tokens``,
    ``length_limit``. ``table_row``, ``state_slot``, ``seq_id``: the sequence's.
    ``temperature``, ``top_k``, ``top_p``, ``seed``, ``has_seed``, ``logprobs``,
    ``prompt_logprobs``, ``kept_mass``: its ``sampling_params`` as the :class:`SamplingColumns`
    hold them (``step_io.sampling_row``).
    """

    def __init__(self) -> None:
        #: the running sequences, in admission order (the scheduler's ``running``)
        self.seqs: list[Sequence] = []
        #: per row: its ``stop_on`` (objects: a list)
        self.stop_on: list[frozenset[int]] = []
        #: per row: its logit rules, None for a row without (most)
        self.rules: list[LogitRules | None] = []
        self._num_rules = 0  # rows with rules: none, and a step carries no rules
        #: token-history rows free for reuse, and how many were ever handed out
        self._free_history: list[int] = []
        self._num_history = 0
        #: histories the next step restarts: history row -> (prompt length, bad-word
        #: window, tokens)
        self._history_init: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        self.seq_id = np.zeros(_INITIAL_ROWS, np.int64)
        self.pos = np.zeros(_INITIAL_ROWS, np.int64)
        self.tokens = np.zeros(_INITIAL_ROWS, np.int64)
        self.pending = np.zeros(_INITIAL_ROWS, np.int64)
        self.prompt = np.zeros(_INITIAL_ROWS, np.int64)
        self.limit = np.zeros(_INITIAL_ROWS, np.int64)
        self.table_row = np.full(_INITIAL_ROWS, -1, np.intp)
        self.state_slot = np.full(_INITIAL_ROWS, -1, np.int64)
        self.temperature = np.zeros(_INITIAL_ROWS, np.float64)
        self.top_k = np.zeros(_INITIAL_ROWS, np.int64)
        self.top_p = np.zeros(_INITIAL_ROWS, np.float64)
        self.seed = np.zeros(_INITIAL_ROWS, np.int64)
        self.has_seed = np.zeros(_INITIAL_ROWS, np.bool_)
        self.logprobs = np.full(_INITIAL_ROWS, -1, np.int64)
        self.prompt_logprobs = np.full(_INITIAL_ROWS, -1, np.int64)
        self.kept_mass = np.zeros(_INITIAL_ROWS, np.bool_)
        #: every row's sampling columns as the last step took them (copies), until the
        #: rows change: a steady decode step takes the last one's
        self._every_row_sampling: SamplingColumns | None = None

    #: the sampling columns, in the :class:`SamplingColumns`' order
    _SAMPLING = tuple(SAMPLING_DTYPES)
    _NUMERIC = ("seq_id", "pos", "tokens", "pending", "prompt", "limit", "table_row",
                "state_slot", *_SAMPLING)  # fmt: skip
    #: what a cleared row holds, per numeric column
    _CLEAR = {"table_row": -1, "state_slot": -1, "logprobs": -1, "prompt_logprobs": -1}

    def __len__(self) -> int:
        return len(self.seqs)

    # -- who runs ---------------------------------------------------------------------

    def append(self, seq: Sequence) -> int:
        """A row for ``seq``, just admitted (it holds its blocks, nothing in flight);
        its row index."""
        i = len(self.seqs)
        if i == len(self.pos):
            self._grow()
        self._every_row_sampling = None
        self.seqs.append(seq)
        self.stop_on.append(seq.stop_on)
        self.rules.append(self._rules_for(seq))
        self.seq_id[i] = seq.seq_id
        self.pos[i] = seq.num_computed_tokens
        self.tokens[i] = len(seq.token_ids)
        self.pending[i] = 0
        self.prompt[i] = seq.num_prompt_tokens
        self.limit[i] = seq.length_limit
        self.table_row[i] = seq.table_row
        self.state_slot[i] = seq.state_slot
        (self.temperature[i], self.top_k[i], self.top_p[i], self.seed[i], self.has_seed[i],
         self.logprobs[i], self.prompt_logprobs[i], self.kept_mass[i]) = sampling_row(
            seq.sampling_params)
        return i

    def remove(self, rows: list[int]) -> np.ndarray:
        """Drop ``rows`` (finished or aborted), keeping the others' order; returns, for
        every old row, its new index (``-1``: dropped)."""
        n = len(self.seqs)
        keep = np.ones(n, bool)
        keep[rows] = False
        new_index = np.where(keep, np.cumsum(keep) - 1, -1)
        k = n - len(rows)
        self._every_row_sampling = None
        kept = keep.tolist()
        if self._num_rules:
            self._release_rules([self.rules[r] for r in rows])
            self.rules[:] = compress(self.rules, kept)
        else:
            del self.rules[k:]  # every entry is None
        self.seqs[:] = compress(self.seqs, kept)
        self.stop_on[:] = compress(self.stop_on, kept)
        for name in self._NUMERIC:
            column = getattr(self, name)
            column[:k] = column[:n][keep]
        self._clear(k, n)
        return new_index

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows (the tail was preempted)."""
        old = len(self.seqs)
        self._every_row_sampling = None
        self._release_rules(self.rules[n:])
        del self.seqs[n:], self.stop_on[n:], self.rules[n:]
        self._clear(n, old)

    # -- one step ---------------------------------------------------------------------

    def chunks(self, budget: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The running rows' chunks under ``budget`` tokens, in row order: the rows that
        feed anything, how many tokens each (before any room is made for them), and
        how many in all.

        Each row wants the rest of its tokens (1 for a decoding row); a row whose only
        token to come is the last the step in flight samples wants none. Rows take
        what they want in order until the budget runs out, the last one taking what
        is left (a partial prefill chunk)."""
        n = len(self.seqs)
        tokens = self.tokens[:n]
        want = tokens - self.pos[:n]
        done = tokens >= self.limit[:n]
        if done.any():
            want[done] = 0
        total = int(want.sum())
        if total <= budget:  # every row gets what it wants (a decode step)
            sizes = want
        else:
            before = np.cumsum(want) - want  # tokens the rows before it take
            sizes = np.minimum(want, np.maximum(budget - before, 0))
            total = budget
        if np.count_nonzero(sizes) == n:
            return np.arange(n), sizes, total
        rows = np.flatnonzero(sizes)
        return rows, sizes[rows], total

    def advance(self, rows: np.ndarray, sizes: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """Plan ``sizes`` tokens for ``rows``: per row the chunk's start, whether it
        samples (it feeds the row's last token), whether its last token is still in
        flight (a placeholder), and the outputs counted so far (seeds count the one in
        flight). Then each row moves past its chunk."""
        at = slice(0, len(rows)) if self.every_row(rows) else rows  # a slice is cheaper
        starts = self.pos[at].copy()
        tokens = self.tokens[at].copy()
        ends = starts + sizes
        samples = ends == tokens
        in_flight = self.pending[at] > 0
        outputs = tokens - self.prompt[at]
        self.pos[at] = ends
        self.tokens[at] = tokens + samples
        self.pending[at] += samples
        return starts, samples, in_flight, outputs

    def applied(self, rows: np.ndarray) -> None:
        """A step's samples for ``rows`` (increasing) are applied: in their tokens, no
        longer in flight."""
        self.pending[slice(0, len(rows)) if self.every_row(rows) else rows] -= 1

    def pick(self, column: list, rows: np.ndarray) -> list:
        """``column``'s entries at ``rows`` (in increasing order), as a new list."""
        if self.every_row(rows):
            return column[:]
        mask = np.zeros(len(self.seqs), bool)
        mask[rows] = True
        return list(compress(column, mask.tolist()))

    def sampling_columns(self, rows: np.ndarray) -> SamplingColumns:
        """The sampling columns of ``rows`` (increasing), as copies: a step carries them
        while these columns change under it. Every row's are taken once and shared by
        the steps until a row is appended, removed or cut (nothing else changes them,
        and nobody writes into a step's columns)."""
        if not self.every_row(rows):
            rules = None
            if self._num_rules:
                rules = tuple(self.pick(self.rules, rows))
                rules = rules if any(r is not None for r in rules) else None
            return SamplingColumns(*(getattr(self, name)[rows] for name in self._SAMPLING),
                                   rules=rules)  # fmt: skip
        if self._every_row_sampling is None:
            n = len(rows)
            columns = [getattr(self, name)[:n].copy() for name in self._SAMPLING]
            for column in columns:
                column.flags.writeable = False  # shared by steps: read only
            rules = tuple(self.rules) if self._num_rules else None
            self._every_row_sampling = SamplingColumns(*columns, rules=rules)
        return self._every_row_sampling

    def take_history_init(self) -> dict[int, tuple[int, int, tuple[int, ...]]] | None:
        """The token histories the next step restarts (``StepInput.history_init``), handed
        over once: every history row given out since the last step, with its
        request's prompt length, bad-word window and tokens."""
        if not self._history_init:
            return None
        init, self._history_init = self._history_init, {}
        return init

    def every_row(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` (increasing, distinct) is every row, in order."""
        return len(rows) == len(self.seqs)

    # -- internals --------------------------------------------------------------------

    def _rules_for(self, seq: Sequence) -> LogitRules | None:
        """``seq``'s logit rules (None without any), with a history row where they read
        its tokens: one freed before, else a new one."""
        params = seq.sampling_params
        if not params.adjusts_logits:
            return None
        self._num_rules += 1
        history_row = -1
        if needs_history(params, seq.bad_word_ids):
            if self._free_history:
                history_row = self._free_history.pop()
            else:
                history_row, self._num_history = self._num_history, self._num_history + 1
        rules = logit_rules(params, stop_on=seq.stop_on, bad_words=seq.bad_word_ids,
                            history_row=history_row)  # fmt: skip
        if history_row >= 0:
            self._history_init[history_row] = (seq.num_prompt_tokens, rules.window,
                                               tuple(seq.token_ids))  # fmt: skip
        return rules

    def _release_rules(self, rules: list[LogitRules | None]) -> None:
        """Rows with ``rules`` leave: their history rows are free for the next admission
        (whose step restarts them after any step in flight wrote its last token)."""
        for rule in rules:
            if rule is None:
                continue
            self._num_rules -= 1
            if rule.history_row >= 0:
                self._history_init.pop(rule.history_row, None)
                self._free_history.append(rule.history_row)

    def _clear(self, start: int, end: int) -> None:
        for name in self._NUMERIC:
            getattr(self, name)[start:end] = self._CLEAR.get(name, 0)

    def _grow(self) -> None:
        for name in self._NUMERIC:
            column = getattr(self, name)
            grown = np.full(2 * len(column), self._CLEAR.get(name, 0), column.dtype)
            grown[: len(column)] = column
            setattr(self, name, grown)
