"""Steps the scheduler has handed out whose tokens it has not been told yet.

With synchronous steps there is at most one, between ``schedule()`` and
``update()``. With asynchronous steps the engine schedules step N+1 while step N
runs, so two can be in flight: the scheduler then plans from where each sequence
*will* be once the newest step is done (the running batch's columns count what the
steps in flight feed and sample), and the token that step samples is a placeholder
the runner fills in on the device.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np

from kvrunner.engine.sequence import Sequence
from kvrunner.engine.step_io import SampledTokens

#: steps that may be in flight at once: the one running and the one being prepared
MAX_IN_FLIGHT = 2


class StepChunks:
    """One step as the scheduler remembers it: its rows, the chunk each fed, and who
    samples.

    Kept as the step's own columns, and ``rows``: each row's index in the running
    batch (``running_batch.py``), renumbered when rows leave it (``-1``: the sequence
    left ``running`` since: finished, aborted or preempted). The dict and the set that
    matching tokens by seq id looks up are built in C-level passes, and only when
    first asked for.
    """

    __slots__ = ("_num_tokens", "_sample_ids", "_samples", "all_sample", "intact", "rows", "sample",
                 "sample_mask", "seq_ids", "seqs", "sizes", "starts")  # fmt: skip

    def __init__(
        self,
        seqs: list[Sequence],
        seq_ids: list[int],
        rows: np.ndarray,
        starts: np.ndarray,
        sizes: np.ndarray,
        sample_mask: np.ndarray,
        sample: list[bool],
    ) -> None:
        #: the rows as ``schedule()`` returned them, where each chunk starts and the
        #: tokens it feeds
        self.seqs = seqs
        self.seq_ids = seq_ids
        self.rows = rows
        self.starts = starts
        self.sizes = sizes
        #: whether each row samples, as an array and as the step's list
        self.sample_mask = sample_mask
        self.sample = sample
        self.all_sample = np.count_nonzero(sample_mask) == len(sample_mask)
        #: no row has left ``running`` since the step was planned (``rows`` as planned)
        self.intact = True
        self._num_tokens: dict[int, int] | None = None
        self._sample_ids: list[int] | None = None
        self._samples: set[int] | None = None

    @property
    def num_tokens(self) -> dict[int, int]:
        """seq id -> tokens its chunk feeds."""
        if self._num_tokens is None:
            self._num_tokens = dict(zip(self.seq_ids, self.sizes.tolist(), strict=True))
        return self._num_tokens

    @property
    def sample_ids(self) -> list[int]:
        """seq ids whose chunk ends their known tokens, so the step samples for them,
        in row order (the order the runner answers in)."""
        if self._sample_ids is None:
            self._sample_ids = (self.seq_ids if self.all_sample
                                else list(itertools.compress(self.seq_ids, self.sample)))
        return self._sample_ids

    @property
    def samples(self) -> set[int]:
        """:attr:`sample_ids` as a set."""
        if self._samples is None:
            self._samples = set(self.sample_ids)
        return self._samples


class InFlight:
    """Scheduled, not yet updated steps, oldest first."""

    def __init__(self) -> None:
        self._steps: deque[StepChunks] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def push(self, chunks: StepChunks) -> None:
        if len(self._steps) >= MAX_IN_FLIGHT:
            raise RuntimeError(
                f"schedule() called with {len(self._steps)} steps already in flight; "
                f"update() the oldest first"
            )
        self._steps.append(chunks)

    def oldest(self) -> StepChunks:
        if not self._steps:
            raise RuntimeError("update() called without a scheduled step")
        return self._steps[0]

    def pop_oldest(self) -> StepChunks:
        return self._steps.popleft()

    def renumber(self, new_index: np.ndarray | int) -> None:
        """The running batch lost rows: ``new_index[r]`` is where row ``r`` went
        (``-1``: gone), or, given an int ``n``, every row from ``n`` on was cut."""
        for chunks in self._steps:
            chunks.intact = False
            rows = chunks.rows
            if isinstance(new_index, int):
                rows[rows >= new_index] = -1
            else:
                chunks.rows = np.where(rows >= 0, new_index[rows], -1)

    def __iter__(self):
        return iter(self._steps)


#: per row of the step (in its own row order): the sampled token, its logprob and top
#: logprobs (``None``: the row sampled nothing, or its token is dropped)
AlignedResult = tuple[list[int | None], list[float | None], list[dict | None]]


def check_step_result(
    chunks: StepChunks, seqs: list[Sequence], sampled: SampledTokens
) -> AlignedResult:
    """Validate ``update()``'s arguments before anything changes; the step's tokens
    row by row, aligned with the step's rows (``chunks.seqs``).

    The engine passes back the very list ``schedule()`` returned and the runner
    answers in row order, so the columns are usually aligned already: two C-level
    list compares show it, and no per-sequence lookup is made. Otherwise the tokens
    are matched by seq id, and tokens for sequences that finished while the step ran
    (aborted, or ended by the step before it) are dropped: they were computed past
    the end.
    """
    if seqs == chunks.seqs and sampled.seq_ids == chunks.sample_ids:
        if len(sampled) == len(seqs):  # every row samples: a decode step
            return sampled.token_ids, sampled.logprobs, sampled.top_logprobs
        where = dict(zip(sampled.seq_ids, range(len(sampled)), strict=True))
    else:
        where = _match_by_id(chunks, seqs, sampled)
    picked = [where.get(seq_id) for seq_id in chunks.seq_ids]
    return (
        [None if k is None else sampled.token_ids[k] for k in picked],
        [None if k is None else sampled.logprobs[k] for k in picked],
        [None if k is None else sampled.top_logprobs[k] for k in picked],
    )


def _match_by_id(chunks: StepChunks, seqs: list[Sequence], sampled: SampledTokens) -> dict:
    """Seq id -> its row in ``sampled``, for the rows that apply; raises on any
    mismatch with the step."""
    ids = [s.seq_id for s in seqs]
    if sorted(ids) != sorted(chunks.num_tokens):
        raise ValueError(
            f"update() got sequences {ids}, the step scheduled {list(chunks.num_tokens)}"
        )
    by_id: dict[int, int] = {}
    for k, seq_id in enumerate(sampled.seq_ids):
        if seq_id in by_id:
            raise ValueError(f"two sampled tokens for sequence {seq_id}")
        by_id[seq_id] = k
    stray = set(by_id) - chunks.num_tokens.keys()
    if stray:
        raise ValueError(f"sampled tokens for sequences not in this step: {sorted(stray)}")
    for seq in seqs:
        if seq.is_finished:
            by_id.pop(seq.seq_id, None)
            continue
        samples = seq.seq_id in chunks.samples
        if samples and seq.seq_id not in by_id:
            raise ValueError(f"no sampled token for sequence {seq.seq_id}")
        if not samples and seq.seq_id in by_id:
            raise ValueError(f"sequence {seq.seq_id} was mid-prefill; it samples nothing")
    return by_id
