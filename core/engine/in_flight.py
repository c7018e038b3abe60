"""Steps the scheduler has handed out whose tokens it has not been told yet.

With synchronous steps there is at most one, between ``schedule()`` and
``update()``. With asynchronous steps the engine schedules step N+1 while step N
runs, so two can be in flight: the scheduler then plans from where each sequence
*will* be once the newest step is done (:meth:`InFlight.ahead`), and the token that
step samples is a placeholder the runner fills in on the device.
"""

from __future__ import annotations

import itertools
from collections import deque

from kvrunner.batch import SampledToken, StepInput
from kvrunner.engine.sequence import Sequence

#: steps that may be in flight at once: the one running and the one being prepared
MAX_IN_FLIGHT = 2


class StepChunks:
    """One step as the scheduler remembers it: tokens per sequence, and who samples.

    Built from the step's columns in C-level passes (a dict and a set, no object per
    sequence): it is made on every step, and per-sequence objects cost garbage
    collection time at batch 256.
    """

    __slots__ = ("num_tokens", "samples")

    def __init__(self, step: StepInput) -> None:
        #: seq id -> tokens its chunk feeds
        self.num_tokens: dict[int, int] = dict(zip(step.seq_id, map(len, step.token_ids),
                                                   strict=True))  # fmt: skip
        #: seq ids whose chunk ends their known tokens, so the step samples for them
        self.samples: set[int] = set(itertools.compress(step.seq_id, step.sample))


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


def check_step_result(
    chunks: StepChunks, seqs: list[Sequence], sampled: list[SampledToken]
) -> dict[int, SampledToken]:
    """Validate ``update()``'s arguments before anything changes; tokens by seq id.

    Tokens for sequences that finished while the step ran (aborted, or ended by the
    step before it) are dropped here: they were computed past the end.
    """
    ids = [s.seq_id for s in seqs]
    if sorted(ids) != sorted(chunks.num_tokens):
        raise ValueError(
            f"update() got sequences {ids}, the step scheduled {list(chunks.num_tokens)}"
        )
    by_id: dict[int, SampledToken] = {}
    for token in sampled:
        if token.seq_id in by_id:
            raise ValueError(f"two sampled tokens for sequence {token.seq_id}")
        by_id[token.seq_id] = token
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
