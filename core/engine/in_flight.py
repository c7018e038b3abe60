"""Steps the scheduler has handed out whose tokens it has not been told yet.

With synchronous steps there is at most one, between ``schedule()`` and
``update()``. With asynchronous steps the engine schedules step N+1 while step N
runs, so two can be in flight: the scheduler then plans from where each sequence
*will* be once the newest step is done (:meth:`InFlight.ahead`), and the token that
step samples is a placeholder the runner fills in on the device.
"""

from __future__ import annotations

from collections import deque

import attrs

from kvrunner.batch import SampledToken
from kvrunner.engine.sequence import Sequence

#: steps that may be in flight at once: the one running and the one being prepared
MAX_IN_FLIGHT = 2


@attrs.frozen
class Chunk:
    """One sequence's share of a scheduled step."""

    num_tokens: int
    #: the chunk ends the sequence's known tokens, so the step samples a token for it
    samples: bool


class InFlight:
    """Scheduled, not yet updated steps, oldest first: ``{seq_id: Chunk}`` each."""

    def __init__(self) -> None:
        self._steps: deque[dict[int, Chunk]] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def push(self, chunks: dict[int, Chunk]) -> None:
        if len(self._steps) >= MAX_IN_FLIGHT:
            raise RuntimeError(
                f"schedule() called with {len(self._steps)} steps already in flight; "
                f"update() the oldest first"
            )
        self._steps.append(chunks)

    def oldest(self) -> dict[int, Chunk]:
        if not self._steps:
            raise RuntimeError("update() called without a scheduled step")
        return self._steps[0]

    def pop_oldest(self) -> dict[int, Chunk]:
        return self._steps.popleft()

    def ahead(self, seq: Sequence) -> tuple[int, int]:
        """``(computed, tokens)`` that the newest in-flight step adds to ``seq``: the
        tokens it feeds, and 1 if it samples (a token the host does not know yet)."""
        if not self._steps:
            return 0, 0
        chunk = self._steps[-1].get(seq.seq_id)
        if chunk is None:
            return 0, 0
        return chunk.num_tokens, int(chunk.samples)


def check_step_result(
    chunks: dict[int, Chunk], seqs: list[Sequence], sampled: list[SampledToken]
) -> dict[int, SampledToken]:
    """Validate ``update()``'s arguments before anything changes; tokens by seq id.

    Tokens for sequences that finished while the step ran (aborted, or ended by the
    step before it) are dropped here: they were computed past the end.
    """
    ids = [s.seq_id for s in seqs]
    if sorted(ids) != sorted(chunks):
        raise ValueError(f"update() got sequences {ids}, the step scheduled {list(chunks)}")
    by_id: dict[int, SampledToken] = {}
    for token in sampled:
        if token.seq_id in by_id:
            raise ValueError(f"two sampled tokens for sequence {token.seq_id}")
        by_id[token.seq_id] = token
    stray = set(by_id) - set(chunks)
    if stray:
        raise ValueError(f"sampled tokens for sequences not in this step: {sorted(stray)}")
    for seq in seqs:
        if seq.is_finished:
            by_id.pop(seq.seq_id, None)
            continue
        samples = chunks[seq.seq_id].samples
        if samples and seq.seq_id not in by_id:
            raise ValueError(f"no sampled token for sequence {seq.seq_id}")
        if not samples and seq.seq_id in by_id:
            raise ValueError(f"sequence {seq.seq_id} was mid-prefill; it samples nothing")
    return by_id
