"""The engine -> runner boundary: what one step asks the runner to compute.

Plain, picklable data (no tensors), so the same object crosses to worker processes.
Crossing is a per-step cost on the decode path, so both directions travel as
columns (one list per field) rather than one pickled object per sequence: a
``StepInput`` pickles that way by itself, and the runner answers with the sampled
tokens as columns (:data:`PackedSampled`), which become :class:`SampledToken`
objects only in the engine's process (:func:`unpack_sampled`). At batch 256 that is
about 5x less pickling work than the per-object form.
"""

from __future__ import annotations

import attrs

from kvrunner.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class SeqChunk:
    """One sequence's share of a step: ``token_ids`` go in at ``start_pos`` onwards."""

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    state_slot: int
    sample: bool  # a token is sampled after this chunk (its prompt is complete)
    sampling: SamplingParams
    num_output_tokens: int  # tokens generated so far; keys the per-request seed


@attrs.frozen
class StepColumns:
    """A step as one list per :class:`SeqChunk` field; row ``i`` is chunk ``i``.

    Fields are in :class:`SeqChunk`'s order (positional construction relies on it).
    """

    seq_id: list[int]
    token_ids: list[tuple[int, ...]]
    start_pos: list[int]
    block_table: list[tuple[int, ...]]
    state_slot: list[int]
    sample: list[bool]
    sampling: list[SamplingParams]
    num_output_tokens: list[int]

    @classmethod
    def of(cls, chunks: tuple[SeqChunk, ...]) -> StepColumns:
        return cls(
            seq_id=[c.seq_id for c in chunks], token_ids=[c.token_ids for c in chunks],
            start_pos=[c.start_pos for c in chunks], block_table=[c.block_table for c in chunks],
            state_slot=[c.state_slot for c in chunks], sample=[c.sample for c in chunks],
            sampling=[c.sampling for c in chunks],
            num_output_tokens=[c.num_output_tokens for c in chunks],
        )

    def chunks(self) -> tuple[SeqChunk, ...]:
        return tuple(
            SeqChunk(seq_id=seq_id, token_ids=token_ids, start_pos=start_pos,
                     block_table=block_table, state_slot=state_slot, sample=sample,
                     sampling=sampling, num_output_tokens=num_output_tokens)
            for seq_id, token_ids, start_pos, block_table, state_slot, sample, sampling,
            num_output_tokens in zip(*attrs.astuple(self, recurse=False), strict=True)
        )


class StepInput:
    """One step's chunks, in order.

    Held as chunks (as the scheduler builds them), as columns (as a rank unpickles
    them), or both: each form is derived from the other on first use and kept. The
    runner reads columns, so a rank never builds one object per sequence.
    """

    __slots__ = ("_chunks", "_columns")

    def __init__(
        self, *, chunks: tuple[SeqChunk, ...] | None = None, columns: StepColumns | None = None
    ) -> None:
        if (chunks is None) == (columns is None):
            raise ValueError("StepInput takes chunks or columns, exactly one of them")
        self._chunks = None if chunks is None else tuple(chunks)
        self._columns = columns

    @property
    def chunks(self) -> tuple[SeqChunk, ...]:
        if self._chunks is None:
            self._chunks = self.columns.chunks()
        return self._chunks

    @property
    def columns(self) -> StepColumns:
        if self._columns is None:
            self._columns = StepColumns.of(self.chunks)
        return self._columns

    @property
    def num_seqs(self) -> int:
        return len(self._chunks) if self._chunks is not None else len(self.columns.seq_id)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.columns.token_ids))

    @property
    def is_decode(self) -> bool:
        cols = self.columns
        return all(len(t) == 1 for t in cols.token_ids) and all(p > 0 for p in cols.start_pos)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepInput) and self.chunks == other.chunks

    __hash__ = None  # type: ignore[assignment]  # equal by value, and holds lists

    def __repr__(self) -> str:
        return f"StepInput(chunks={self.chunks!r})"

    def __reduce__(self) -> tuple:
        # Columns: lists of ints pickle in C; per-object attrs state does not. Equal
        # SamplingParams objects shared by many chunks pickle once (pickle's memo).
        return (_step_from_columns, attrs.astuple(self.columns, recurse=False))


def _step_from_columns(*columns: list) -> StepInput:
    """Inverse of ``StepInput.__reduce__``: a step that builds no chunk until asked."""
    return StepInput(columns=StepColumns(*columns))


@attrs.frozen(kw_only=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


#: a step's sampled tokens as columns: seq ids, token ids, logprobs, top logprobs
PackedSampled = tuple[list[int], list[int], list[float | None], list[dict[int, float] | None]]


def no_samples() -> PackedSampled:
    """The columns of a step that sampled nothing."""
    return ([], [], [], [])


def unpack_sampled(packed: PackedSampled) -> list[SampledToken]:
    """One :class:`SampledToken` per row of the columns the runner answers with."""
    return [
        SampledToken(seq_id=seq_id, token_id=token_id, logprob=logprob, top_logprobs=top)
        for seq_id, token_id, logprob, top in zip(*packed, strict=True)
    ]
