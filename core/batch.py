"""The engine -> runner boundary: what one step asks the runner to compute.

Plain, picklable data (no tensors), so the same object crosses to worker processes.
Crossing is a per-step cost on the decode path, so both directions are columns
(one list per field), never one object per sequence: a :class:`StepInput` is
columns, and the runner answers with the sampled tokens as columns
(:data:`PackedSampled`), which become :class:`SampledToken` objects only in the
engine's process (:func:`unpack_sampled`). At batch 256 that is about 5x less
pickling work than one object per sequence.
"""

from __future__ import annotations

import attrs

from kvrunner.sampling_params import SamplingParams

#: A token id in ``StepInput.token_ids`` that the host does not know yet: the token
#: this sequence sampled in the step just before, which is still on the device (async
#: scheduling). It is only ever the last token of a chunk, and the runner replaces it
#: with the device's token before the forward runs.
PLACEHOLDER_TOKEN = -1
#: the chunk of a decoding sequence whose newest token is still on the device (one
#: shared tuple: building one per sequence per step costs the host time it saves)
PLACEHOLDER_CHUNK = (PLACEHOLDER_TOKEN,)


@attrs.frozen(eq=True, hash=False)
class StepInput:
    """One step as columns: one list per field, row ``i`` of each is sequence ``i``'s share.

    Sequence ``i`` feeds ``token_ids[i]`` at positions ``start_pos[i]`` onwards (its
    last token may be :data:`PLACEHOLDER_TOKEN`: the previous step's sample). The
    scheduler builds it this way and the runner reads it this way, so no object per
    sequence is ever built. It pickles as its lists (shared ``SamplingParams``
    once, through pickle's memo).
    """

    seq_id: list[int]
    token_ids: list[tuple[int, ...]]
    start_pos: list[int]
    block_table: list[tuple[int, ...]]
    state_slot: list[int]
    #: a token is sampled after this share (its prompt is complete)
    sample: list[bool]
    sampling: list[SamplingParams]
    #: tokens generated so far; keys the per-request seed
    num_output_tokens: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_id)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.token_ids))

    @property
    def is_decode(self) -> bool:
        return all(len(t) == 1 for t in self.token_ids) and all(p > 0 for p in self.start_pos)

    def __reduce__(self) -> tuple:
        # The lists themselves: ints pickle in C; attrs' per-object state would not.
        return (StepInput, attrs.astuple(self, recurse=False))


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
