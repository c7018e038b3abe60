"""The engine -> runner boundary: what one step asks the runner to compute.

Plain, picklable data (no tensors), so the same object crosses to worker processes.
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


@attrs.frozen(kw_only=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
