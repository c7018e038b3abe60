"""Build a :class:`~kvrunner.engine.step_io.StepInput` row by row, for tests and benchmarks.

The engine builds steps as columns directly; tests read better one sequence at a
time. ``Row`` has the step's fields in its order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import attrs

from kvrunner.engine.step_io import StepInput
from kvrunner.sampling_params import SamplingParams


class Row(NamedTuple):
    """One sequence's share of a step."""

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    state_slot: int
    sample: bool
    sampling: SamplingParams
    num_output_tokens: int
    #: the prompt tokens its chunk scores (None: the step scores no prompt)
    prompt_targets: tuple[int, ...] | None = None


def step_of(rows: Iterable[Row]) -> StepInput:
    """The step whose row ``i`` is ``rows[i]``."""
    rows = list(rows)
    columns = [list(column) for column in zip(*rows, strict=True)] or [
        [] for _ in attrs.fields(StepInput)]
    if all(t is None for t in columns[-1]):
        columns[-1] = None  # a step that scores no prompt
    else:
        columns[-1] = [() if t is None else tuple(t) for t in columns[-1]]
    return StepInput(*columns)


def rows_of(step: StepInput) -> list[Row]:
    """The step one sequence at a time."""
    columns = list(attrs.astuple(step, recurse=False))
    if columns[-1] is None:
        columns[-1] = [None] * step.num_seqs
    return [Row(*values) for values in zip(*columns, strict=True)]
