"""Steps the scheduler has handed out whose tokens it has not been told yet.

With synchronous steps there is at most one, between ``schedule()`` and
``update()``. With asynchronous steps the engine schedules step N+1 while step N
runs, so two can be in flight: the scheduler then plans from where each sequence
*will* be once the newest step is done (:meth:`InFlight.newest`), and the token that
step samples is a placeholder the runner fills in on the device.
"""

from __future__ import annotations

import itertools
from collections import deque

from kvrunner.batch import SampledTokens
from kvrunner.engine.decode_batch import DecodeBatch
from kvrunner.engine.sequence import Sequence

#: steps that may be in flight at once: the one running and the one being prepared
MAX_IN_FLIGHT = 2


class StepChunks:
    """One step as the scheduler remembers it: its rows, tokens per sequence, and who
    samples.

    Kept as the step's own columns; the dict and the set that the row loops look up
    are built in C-level passes, and only when first asked for: a step kept as a
    decode batch (``batch``) needs neither.
    """

    __slots__ = ("_num_tokens", "_sample_ids", "_samples", "batch", "sample", "seq_ids",
                 "seqs", "sizes")  # fmt: skip

    def __init__(
        self,
        seqs: list[Sequence],
        seq_ids: list[int],
        sizes: list[int],
        sample: list[bool],
        batch: DecodeBatch | None = None,
    ) -> None:
        #: the rows as ``schedule()`` returned them, and the tokens each feeds
        self.seqs = seqs
        self.sizes = sizes
        self.seq_ids = seq_ids
        self.sample = sample
        #: the step's columns, when every row samples in it (``decode_batch.py``)
        self.batch = batch
        self._num_tokens: dict[int, int] | None = None
        self._sample_ids: list[int] | None = None
        self._samples: set[int] | None = None

    @property
    def num_tokens(self) -> dict[int, int]:
        """seq id -> tokens its chunk feeds."""
        if self._num_tokens is None:
            self._num_tokens = dict(zip(self.seq_ids, self.sizes, strict=True))
        return self._num_tokens

    @property
    def sample_ids(self) -> list[int]:
        """seq ids whose chunk ends their known tokens, so the step samples for them,
        in row order (the order the runner answers in)."""
        if self._sample_ids is None:
            self._sample_ids = list(itertools.compress(self.seq_ids, self.sample))
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

    def newest(self) -> StepChunks | None:
        """The step the next ``schedule()`` plans after: for each sequence in it, its
        chunk counts as computed and, if it samples, one more token is on its way."""
        return self._steps[-1] if self._steps else None


#: per row of ``update()``'s sequences: tokens fed, and the sampled token, its logprob
#: and top logprobs (``None`` token: the row sampled nothing)
AlignedResult = tuple[list[int], list[int | None], list[float | None], list[dict | None]]


def check_step_result(
    chunks: StepChunks, seqs: list[Sequence], sampled: SampledTokens
) -> AlignedResult:
    """Validate ``update()``'s arguments before anything changes; the step's sizes and
    tokens row by row, aligned with ``seqs``.

    The engine passes back the very list ``schedule()`` returned and the runner
    answers in row order, so the columns are usually aligned already: two C-level
    list compares show it, and no per-sequence lookup is made. Otherwise the tokens
    are matched by seq id, and tokens for sequences that finished while the step ran
    (aborted, or ended by the step before it) are dropped: they were computed past
    the end.
    """
    if seqs == chunks.seqs and sampled.seq_ids == chunks.sample_ids:
        if len(sampled) == len(seqs):  # every row samples: a decode step
            return chunks.sizes, sampled.token_ids, sampled.logprobs, sampled.top_logprobs
        where = dict(zip(sampled.seq_ids, range(len(sampled)), strict=True))
    else:
        where = _match_by_id(chunks, seqs, sampled)
    picked = [where.get(seq.seq_id) for seq in seqs]
    return (
        [chunks.num_tokens[seq.seq_id] for seq in seqs],
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
