"""The engine -> runner boundary: what one step asks the runner to compute.

Plain, picklable data (no tensors), so the same object crosses to worker processes.
Crossing is a per-step cost on the decode path, so both directions travel as
columns (one list per field) rather than one pickled object per sequence: a
``StepInput`` pickles that way by itself, and a step's sampled tokens go through
:func:`pack_sampled` / :func:`unpack_sampled`. At batch 256 that is about 5x less
pickling work than the per-object form.
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


@attrs.frozen(kw_only=True)
class StepInput:
    chunks: tuple[SeqChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_decode(self) -> bool:
        return all(len(c.token_ids) == 1 and c.start_pos > 0 for c in self.chunks)

    def __reduce__(self) -> tuple:
        # Columns: lists of ints pickle in C; per-object attrs state does not. Equal
        # SamplingParams objects shared by many chunks pickle once (pickle's memo).
        cs = self.chunks
        return (_step_from_columns, (
            [c.seq_id for c in cs], [c.token_ids for c in cs], [c.start_pos for c in cs],
            [c.block_table for c in cs], [c.state_slot for c in cs], [c.sample for c in cs],
            [c.sampling for c in cs], [c.num_output_tokens for c in cs],
        ))


def _step_from_columns(*columns: list) -> StepInput:
    """Inverse of ``StepInput.__reduce__`` (a round-trip test pins the field order)."""
    return StepInput(chunks=tuple(
        SeqChunk(seq_id=seq_id, token_ids=token_ids, start_pos=start_pos,
                 block_table=block_table, state_slot=state_slot, sample=sample,
                 sampling=sampling, num_output_tokens=num_output_tokens)
        for seq_id, token_ids, start_pos, block_table, state_slot, sample, sampling,
        num_output_tokens in zip(*columns, strict=True)
    ))


@attrs.frozen(kw_only=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


#: a step's sampled tokens as columns: seq ids, token ids, logprobs, top logprobs
PackedSampled = tuple[list[int], list[int], list[float | None], list[dict[int, float] | None]]


def pack_sampled(tokens: list[SampledToken]) -> PackedSampled:
    """Columns of ``tokens``, for crossing a process boundary cheaply."""
    return (
        [t.seq_id for t in tokens],
        [t.token_id for t in tokens],
        [t.logprob for t in tokens],
        [t.top_logprobs for t in tokens],
    )


def unpack_sampled(packed: PackedSampled) -> list[SampledToken]:
    """Inverse of :func:`pack_sampled`."""
    return [
        SampledToken(seq_id=seq_id, token_id=token_id, logprob=logprob, top_logprobs=top)
        for seq_id, token_id, logprob, top in zip(*packed, strict=True)
    ]
